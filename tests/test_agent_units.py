"""The agent's parts, and the agent against the real app in-process (ASGI transport, real
PostgreSQL): fast checks of what the process-level acceptance tests cover end to end."""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import msgspec
import pytest
import structlog

from agent.config import AgentConfig
from agent.enrollment import enroll
from agent.errors import EXIT_STOPPED, AgentError
from agent.runner import Agent
from agent.sanitize import sanitize_observation, validate_observation
from agent.sending import backoff_delay, classify, held_against_report
from agent.spool import Spool
from agent.state import CREDENTIAL_FILE, SEQUENCES_FILE, Credential, Sequences, load_credential
from api.wiring import Services
from collectors.facts import Known, TemporarilyFailed
from collectors.nvml import NvidiaNvmlCollector
from collectors.observations import HostObservation
from domain.node import node_id_for
from tests.agent_support import observation, wait_for
from tests.builders import host
from tests.fakes.fake_pynvml import FakeNvml
from tests.fixtures_nvml import multi_gpu_scenario

SERVER = "http://plane.test"


class FakeHost:
    def __init__(self, obs: HostObservation | None = None) -> None:
        self.obs = obs or host("unit-host")

    async def collect_async(self) -> HostObservation:
        return self.obs


class Plane:
    def __init__(self, app: Any, pool: asyncpg.Pool, services: Services, tmp: Path) -> None:
        self.app = app
        self.pool = pool
        self.services = services
        self.tmp = tmp

    def transport(self) -> httpx.ASGITransport:
        return httpx.ASGITransport(app=self.app)

    async def token(self, uses: int = 1) -> str:
        return str((await self.services.enrollment.create_token(600, uses)).token)

    def agent(self, state: Path, node: str, host_obs: HostObservation | None = None, **config: Any) -> Agent:
        return Agent(
            AgentConfig(servers=[SERVER], state_dir=state, node_id=node, once=True, **config),
            host_collector=FakeHost(host_obs),
            nvml_collector=NvidiaNvmlCollector(nvml=FakeNvml(multi_gpu_scenario(2)), timeout_seconds=5),
            transport=self.transport(),
        )


@pytest.fixture
async def plane(pool: asyncpg.Pool, tmp_path: Path) -> AsyncIterator[Plane]:
    from api.config import ServerConfig
    from api.http.app import create_app
    from api.http.context import AppContext
    from api.services.reads.repository import HardwareRepository
    from api.wiring import build_service
    from runtime.secrets import digest

    service = build_service(pool, ServerConfig(state_dir=tmp_path / "server", node_id="server-host"))
    context = AppContext(
        pool=pool,
        service=service,
        repository=HardwareRepository(pool),
        admin_token_hash=digest("op"),
    )
    yield Plane(create_app(context), pool, context.services, tmp_path)


async def test_agent_in_process_enrolls_reports_and_resynchronizes_after_losing_its_sequences(
    plane: Plane, tmp_path: Path
) -> None:
    state = tmp_path / "agent"
    credential = await enroll(
        SERVER, await plane.token(uses=2), state, node_id="unit-1", transport=plane.transport()
    )
    assert credential.node_id == node_id_for("unit-1")
    assert oct((state / CREDENTIAL_FILE).stat().st_mode & 0o777) == "0o600"
    assert credential.credential not in repr(credential)

    # Every start of the agent reports on the inventory stream first.
    assert await plane.agent(state, "unit-1").run() == 0
    assert await plane.agent(state, "unit-1").run() == 0
    positions = {
        s.stream: s.last_sequence for s in await plane.services.credentials.list_streams(credential.node_id)
    }
    assert positions == {"inventory": 2}

    # The state directory is restored from an old backup: the numbers fall behind the server's.
    (state / SEQUENCES_FILE).unlink()
    with structlog.testing.capture_logs() as logs:
        assert await plane.agent(state, "unit-1").run() == 0  # inventory 1 again: 409, quarantined
    events = [e["event"] for e in logs]
    assert "agent.report_quarantined" in events and "agent.sequence_resynchronized" in events
    assert Sequences(state).last("inventory") == 2
    assert await plane.agent(state, "unit-1").run() == 0
    positions = {
        s.stream: s.last_sequence for s in await plane.services.credentials.list_streams(credential.node_id)
    }
    assert positions["inventory"] == 3

    # Lost entirely: enrolling again continues above the server's sequences.
    for name in (CREDENTIAL_FILE, SEQUENCES_FILE):
        (state / name).unlink()
    again = await enroll(SERVER, await plane.token(), state, node_id="unit-1", transport=plane.transport())
    assert again.node_id == credential.node_id and again.credential_id != credential.credential_id
    assert Sequences(state).last("inventory") == 3
    creds = {
        c.credential_id: c.status
        for c in await plane.services.credentials.list_credentials(credential.node_id)
    }
    assert creds == {credential.credential_id: "revoked", again.credential_id: "active"}


async def test_agent_stops_with_exit_78_when_its_credential_is_revoked(plane: Plane, tmp_path: Path) -> None:
    state = tmp_path / "agent"
    credential = await enroll(
        SERVER, await plane.token(), state, node_id="unit-2", transport=plane.transport()
    )
    await plane.services.credentials.revoke_credential(credential.credential_id, "test")
    with structlog.testing.capture_logs() as logs:
        assert await plane.agent(state, "unit-2").run() == EXIT_STOPPED
    stopped = [e for e in logs if e["event"] == "agent.publishing_stopped"]
    assert stopped and stopped[0]["status"] == 401 and "revoked" in stopped[0]["reason"]
    assert "agent enroll --force" in stopped[0]["hint"]
    assert len(list((state / "agent-spool").glob("*.json"))) == 1  # kept, not lost


async def test_agent_refuses_an_identity_the_credential_was_not_issued_for(
    plane: Plane, tmp_path: Path
) -> None:
    state = tmp_path / "agent"
    await enroll(SERVER, await plane.token(), state, node_id="unit-3", transport=plane.transport())
    with pytest.raises(AgentError) as err:
        await plane.agent(state, "someone-else").run()
    assert err.value.exit_code == EXIT_STOPPED
    with pytest.raises(AgentError, match="already enrolled"):
        await enroll(SERVER, await plane.token(), state, node_id="unit-3", transport=plane.transport())
    with pytest.raises(AgentError, match="not enrolled"):
        await plane.agent(tmp_path / "empty", "unit-3").run()


async def test_spooled_reports_survive_an_outage_and_enrolling_as_another_identity_discards_them(
    plane: Plane, tmp_path: Path
) -> None:
    state = tmp_path / "agent"
    await enroll(SERVER, await plane.token(), state, node_id="unit-5", transport=plane.transport())
    down = httpx.MockTransport(lambda request: httpx.Response(503, json={"detail": "maintenance"}))
    agent = plane.agent(state, "unit-5")
    agent.transport = down
    assert await agent.run() == 1  # --once: the server could not take it; the report stays
    assert len(list((state / "agent-spool").glob("*.json"))) == 1
    assert await plane.agent(state, "unit-5").run() == 0  # back up: the spool drains
    assert not list((state / "agent-spool").glob("*.json"))
    agent = plane.agent(state, "unit-5")
    agent.transport = down
    assert await agent.run() == 1

    # The host is given another identity: its old spool and numbers were another node's.
    again = await enroll(
        SERVER, await plane.token(), state, node_id="unit-6", force=True, transport=plane.transport()
    )
    assert again.node_id == node_id_for("unit-6")
    assert not list((state / "agent-spool").glob("*.json"))
    assert Sequences(state).last("inventory") == 0
    assert await plane.agent(state, "unit-6").run() == 0
    streams = {
        s.stream: s.last_sequence for s in await plane.services.credentials.list_streams(again.node_id)
    }
    assert streams == {"inventory": 1}


async def test_agent_fails_over_to_the_next_server_and_keeps_running(plane: Plane, tmp_path: Path) -> None:
    state = tmp_path / "agent"
    await enroll(SERVER, await plane.token(), state, node_id="unit-7", transport=plane.transport())
    asgi = plane.transport()
    tried: list[str] = []

    class Routed(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            tried.append(request.url.host)
            if request.url.host == "down.test":
                raise httpx.ConnectError("connection refused", request=request)
            return await asgi.handle_async_request(request)

    agent = Agent(
        AgentConfig(
            servers=["http://down.test", SERVER],
            state_dir=state,
            node_id="unit-7",
            interval=0.05,
            backoff_initial=0.01,
            backoff_max=0.02,
        ),
        host_collector=FakeHost(),
        nvml_collector=NvidiaNvmlCollector(nvml=FakeNvml(multi_gpu_scenario(1)), timeout_seconds=5),
        transport=Routed(),
    )
    running = asyncio.create_task(agent.run())

    async def enough() -> bool:
        streams = await plane.services.credentials.list_streams(node_id_for("unit-7"))
        return sum(s.reports for s in streams) >= 3

    await wait_for(enough, 10, "reports through the second server")
    agent.stop("test")
    assert await running == 0
    assert tried[0] == "down.test" and "plane.test" in tried


async def test_a_confused_sensor_costs_one_fact_not_the_report(plane: Plane, tmp_path: Path) -> None:
    state = tmp_path / "agent"
    await enroll(SERVER, await plane.token(), state, node_id="unit-4", transport=plane.transport())
    bad = host("unit-host")
    bad = msgspec.structs.replace(bad, telemetry={**bad.telemetry, "memory_available_bytes": Known(-1)})
    assert await plane.agent(state, "unit-4", host_obs=bad).run() == 0
    async with plane.pool.acquire() as conn:
        metrics = await conn.fetchval(
            "SELECT metrics FROM hw_host_telemetry WHERE node_id = $1", node_id_for("unit-4")
        )
    assert metrics["memory_available_bytes"]["state"] == "temporarily_failed"


def test_validation_refuses_negative_and_non_finite_numbers_and_sanitize_repairs_them() -> None:
    obs = observation()
    assert validate_observation(obs) == []
    h = msgspec.structs.replace(
        obs.host,
        telemetry={"memory_available_bytes": Known(-3), "memory_total_bytes": Known(math.nan)},
    )
    gpu0 = msgspec.structs.replace(obs.nvml.accelerators[0], telemetry={"power_watts": Known(math.inf)})
    broken = msgspec.structs.replace(
        obs, host=h, nvml=msgspec.structs.replace(obs.nvml, accelerators=[gpu0, *obs.nvml.accelerators[1:]])
    )
    errors = validate_observation(broken)
    assert len(errors) == 3 and any(">= 0" in e for e in errors) and any("nan" in e for e in errors)
    fixed = sanitize_observation(broken)
    assert validate_observation(fixed) == []
    assert isinstance(fixed.host.telemetry["memory_available_bytes"], TemporarilyFailed)
    assert fixed.host.telemetry["memory_total_bytes"] != Known(0)  # never a substitute value
    assert isinstance(fixed.nvml.accelerators[0].telemetry["power_watts"], TemporarilyFailed)
    # Zero is a measured value.
    zero = msgspec.structs.replace(
        obs, host=msgspec.structs.replace(obs.host, telemetry={"memory_available_bytes": Known(0)})
    )
    assert validate_observation(zero) == []


def test_spool_keeps_order_drops_oldest_telemetry_first_and_survives_a_restart(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", max_reports=3)
    spool.add(1, "inventory", 1, b"i1")
    spool.add(2, "telemetry", 1, b"t1")
    spool.add(3, "telemetry", 2, b"t2")
    with structlog.testing.capture_logs() as logs:
        dropped = spool.add(4, "telemetry", 3, b"t3")
    assert [(d.stream, d.sequence) for d in dropped] == [("telemetry", 1)]
    assert [e for e in logs if e["event"] == "spool.dropped"]
    (tmp_path / "spool" / ".0000000000000005-telemetry-4.json.x.tmp").write_bytes(b"half")
    reopened = Spool(tmp_path / "spool", max_reports=3)
    assert [(e.stream, e.sequence) for e in reopened.entries()] == [
        ("inventory", 1),
        ("telemetry", 2),
        ("telemetry", 3),
    ]
    assert reopened.read(reopened.entries()[0]) == b"i1"
    assert not list((tmp_path / "spool").glob(".*.tmp"))
    # Only inventory left and still too many: the oldest goes.
    only = Spool(tmp_path / "only", max_reports=1)
    only.add(1, "inventory", 1, b"a")
    assert [d.sequence for d in only.add(2, "inventory", 2, b"b")] == [1]


def test_sequences_survive_restarts_and_are_never_reused(tmp_path: Path) -> None:
    seq = Sequences(tmp_path)
    assert [seq.allocate("telemetry")[1] for _ in range(3)] == [1, 2, 3]
    assert seq.allocate("inventory") == (4, 1)
    again = Sequences(tmp_path)
    assert again.allocate("telemetry") == (5, 4)
    assert again.raise_to({"telemetry": 2}) is False and again.raise_to({"telemetry": 10}) is True
    assert Sequences(tmp_path).allocate("telemetry")[1] == 11
    assert oct(os.stat(tmp_path / SEQUENCES_FILE).st_mode & 0o777) == "0o600"
    (tmp_path / SEQUENCES_FILE).write_text("{garbage")
    with pytest.raises(Exception, match="damaged"):
        Sequences(tmp_path)


def test_credential_file_round_trip(tmp_path: Path) -> None:
    assert load_credential(tmp_path) is None
    (tmp_path / CREDENTIAL_FILE).write_text("{}")
    with pytest.raises(Exception, match="damaged"):
        load_credential(tmp_path)
    c = Credential(
        server="https://x",
        node_id="n",
        identity_key="k",
        credential_id="c",
        credential="mfc_secret",
        enrolled_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    assert "mfc_secret" not in repr(c)


def test_responses_are_classified_by_what_a_retry_can_change() -> None:
    def r(status: int, body: Any = None, headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.Response(status, json=body or {}, headers=headers)

    assert classify(r(200, {"status": "duplicate"})).detail == "duplicate"
    assert [classify(r(s)).kind for s in (401, 410)] == ["stop"] * 2
    assert [classify(r(s)).kind for s in (400, 403, 409, 413, 422)] == ["quarantine"] * 5
    assert [classify(r(s)).kind for s in (404, 408, 429, 500, 502, 503)] == ["retry"] * 6
    # Only a 500-like answer counts towards quarantining the report; "unavailable" never does.
    assert [held_against_report(classify(r(s))) for s in (500, 501, 502, 503, 504, 429)] == [
        True,
        True,
        False,
        False,
        False,
        False,
    ]
    assert classify(r(503, headers={"Retry-After": "7"})).retry_after == 7.0


def test_backoff_is_exponential_jittered_and_capped() -> None:
    for attempt, top in ((1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (10, 8.0)):
        delays = [backoff_delay(attempt, 1.0, 8.0) for _ in range(50)]
        assert all(top / 2 <= d <= top for d in delays) and len(set(delays)) > 1
    assert backoff_delay(1, 1.0, 8.0, retry_after=5.0) >= 5.0
    assert backoff_delay(1, 1.0, 8.0, retry_after=500.0) <= 8.0


def test_collector_timeout_help_and_behaviour_agree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from agent import config as agent_config
    from agent import runner
    from agent.cli import run_config
    from api.cli.main import main

    for name in list(os.environ):
        if name.startswith("MODELFORGE_"):
            monkeypatch.delenv(name)
    config = run_config()
    assert config.collector_timeout == agent_config.DEFAULT_COLLECTOR_TIMEOUT
    assert AgentConfig(state_dir=tmp_path).collector_timeout == config.collector_timeout
    saved = structlog.get_config()
    seen: list[AgentConfig] = []

    async def started(config: AgentConfig) -> int:
        seen.append(config)
        return 0

    monkeypatch.setattr(runner, "run_agent", started)
    try:
        assert main(["agent", "run", "--help"]) == 0
        text = " ".join(capsys.readouterr().out.split())
        expected = f"(env MODELFORGE_COLLECTOR_TIMEOUT, default {config.collector_timeout:g})"
        assert expected in text, text
        # The variable, then the flag over it, reach the agent's configuration.
        monkeypatch.setenv("MODELFORGE_COLLECTOR_TIMEOUT", "2.5")
        assert main(["agent", "run", "--state-dir", str(tmp_path)]) == 0
        assert main(["agent", "run", "--state-dir", str(tmp_path), "--collector-timeout", "3"]) == 0
    finally:
        structlog.configure(**saved)
    assert [c.collector_timeout for c in seen] == [2.5, 3]
    assert run_config().collector_timeout == 2.5
    # ...and that is the timeout the collectors get.
    agent = Agent(config, host_collector=FakeHost())
    assert isinstance(agent.nvml_collector, NvidiaNvmlCollector)
    assert agent.nvml_collector.timeout_seconds == config.collector_timeout


def test_the_configuration_reference_states_the_agent_s_real_defaults() -> None:
    from agent import config as agent_config
    from api.config import SETTINGS

    defaults = {s.env: s.default for s in SETTINGS}
    for env, value in (
        ("MODELFORGE_COLLECTOR_TIMEOUT", agent_config.DEFAULT_COLLECTOR_TIMEOUT),
        ("MODELFORGE_AGENT_INTERVAL", agent_config.DEFAULT_INTERVAL),
        ("MODELFORGE_AGENT_INVENTORY_EVERY", agent_config.DEFAULT_INVENTORY_EVERY),
        ("MODELFORGE_AGENT_SPOOL_MAX", agent_config.DEFAULT_SPOOL_MAX),
        ("MODELFORGE_AGENT_BACKOFF_INITIAL", agent_config.DEFAULT_BACKOFF_INITIAL),
        ("MODELFORGE_AGENT_BACKOFF_MAX", agent_config.DEFAULT_BACKOFF_MAX),
        ("MODELFORGE_AGENT_REQUEST_TIMEOUT", agent_config.DEFAULT_REQUEST_TIMEOUT),
        ("MODELFORGE_AGENT_QUARANTINE_AFTER", agent_config.DEFAULT_QUARANTINE_AFTER),
    ):
        assert float(defaults[env]) == value, env
