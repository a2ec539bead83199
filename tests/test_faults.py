"""Fault injection with real processes: a server on its embedded PostgreSQL, three agents (fake NVML),
and in turn: kill -9 of the server while agents report, kill -9 of the database's postmaster, a
stopped agent (SIGSTOP/SIGCONT). Afterwards nothing is lost, nothing duplicated, no sequence gap,
`verify` is clean, the liveness states were as configured, and a clean stop leaves no PostgreSQL.

The figures (reports sent, accepted, lost, duplicated) are printed: `pytest -s` shows them."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import psutil
import pytest

from tests.agent_support import (
    OPERATOR,
    ROOT,
    AgentProcess,
    ServerProcess,
    clean_env,
    create_token,
    wait_for,
)
from tests.sample_reads import logged

STALE_AFTER = 2.0


class Embedded:
    """Reads the embedded database of a server's state directory, one short connection at a time
    (a pool would break with the postmaster it is about to lose)."""

    def __init__(self, state: Path) -> None:
        self.data = state / "postgres"
        self.dsn = f"postgresql://postgres:@/postgres?host={self.data}"

    def postmaster_pid(self) -> int:
        return int((self.data / "postmaster.pid").read_text().splitlines()[0])

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(self.dsn)
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()

    def running(self) -> list[int]:
        found = []
        for p in psutil.process_iter(["name", "cmdline"]):
            cmd = p.info["cmdline"] or []
            if p.info["name"] == "postgres" and str(self.data) in cmd:
                found.append(p.pid)
        return found


async def accepted(db: Embedded, node_id: str) -> int:
    rows = await db.fetch(
        "SELECT coalesce(sum(reports), 0) AS n FROM agent_stream_positions WHERE node_id = $1", node_id
    )
    return int(rows[0]["n"])


async def more_reports(db: Embedded, agents: list[AgentProcess], than: dict[str, int], within: float) -> None:
    async def grown() -> bool:
        for a in agents:
            assert a.alive(), a.log_text()[-3000:]
        try:
            counts = {a.node_id: await accepted(db, a.expected_node_id) for a in agents}
        except (OSError, asyncpg.PostgresError):
            return False
        return all(counts[a.node_id] >= than.get(a.node_id, 0) + 2 for a in agents)

    await wait_for(grown, within, "two more accepted reports from every agent", every=0.2)


async def snapshot(db: Embedded, agents: list[AgentProcess]) -> dict[str, int]:
    return {a.node_id: await accepted(db, a.expected_node_id) for a in agents}


async def liveness(http: httpx.AsyncClient, url: str, node_id: str) -> str:
    r = await http.get(f"{url}/api/v1/hardware/nodes/{node_id}", headers=OPERATOR)
    assert r.status_code == 200, r.text
    return str(r.json()["liveness"])


@pytest.fixture
def workdir() -> Iterator[Path]:
    """Not under pytest's tmp_path: pytest resets its root to mode 0700 whenever a pytest starts,
    which locks out the embedded PostgreSQL's own user (pgserver runs it as `pgserver` under root)."""
    path = Path(tempfile.mkdtemp(prefix="mf-faults-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def test_kill_server_kill_database_stop_an_agent_nothing_lost_nothing_twice(workdir: Path) -> None:
    tmp_path = workdir
    tag = uuid.uuid4().hex[:6]
    # An empty URL: the server runs (and supervises) its embedded PostgreSQL.
    server = ServerProcess("", tmp_path, stale_after=STALE_AFTER, offline_after=120)
    db = Embedded(tmp_path / "server-state")
    agents = [AgentProcess(tmp_path, f"fault-{tag}-{i}") for i in range(3)]
    http = httpx.AsyncClient(timeout=10)
    try:
        server.start()
        await server.wait_healthy(within=60)
        token = (await create_token(http, server.url, uses=3))["token"]
        for a in agents:
            assert (await a.enroll(server.url, token)).returncode == 0, a.log_text()
            a.start(server.url, interval=0.3)
        await more_reports(db, agents, {}, 30)

        # 1. kill -9 of the server while the agents report; a new one on the same state directory.
        before = await snapshot(db, agents)
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        await asyncio.sleep(1.5)  # reports pile up in the spools
        server.start()
        await server.wait_healthy(within=60)
        await more_reports(db, agents, before, 30)

        # 2. kill -9 of the postmaster: 503 (not 500) meanwhile, alive throughout, then served again.
        before = await snapshot(db, agents)
        os.kill(db.postmaster_pid(), signal.SIGKILL)
        seen: set[tuple[str, int]] = set()

        async def recovered() -> bool:
            live = await http.get(server.url + "/api/v1/health/live")
            health = await http.get(server.url + "/api/v1/health")
            nodes = await http.get(server.url + "/api/v1/hardware/nodes", headers=OPERATOR)
            seen.update(
                {("live", live.status_code), ("health", health.status_code), ("nodes", nodes.status_code)}
            )
            assert live.status_code == 200
            assert nodes.status_code in (200, 503), nodes.text
            if nodes.status_code == 503:
                assert nodes.headers["content-type"].startswith("application/problem+json")
                assert "retry-after" in nodes.headers
            return health.status_code == 200 and ("health", 503) in seen

        await wait_for(recovered, 30, "503 while the database is gone, then 200", every=0.05)
        assert server.proc.poll() is None, "the server exited instead of restarting its database"
        await more_reports(db, agents, before, 30)

        # 3. a stopped agent: its node turns stale by the central clock, then online again.
        stopped = agents[0]
        assert stopped.proc is not None
        before = await snapshot(db, agents)
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        try:
            await wait_for(
                lambda: _is(http, server.url, stopped.expected_node_id, "stale"),
                15,
                "the stopped agent's node stale",
            )
        finally:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        await wait_for(
            lambda: _is(http, server.url, stopped.expected_node_id, "online"), 15, "the node online again"
        )
        await more_reports(db, agents, before, 30)

        async def drained() -> bool:
            return all(a.spooled() <= 1 for a in agents)

        await wait_for(drained, 30, "every spool drained (one report may be in flight)")
    finally:
        for a in agents:
            if a.proc is not None and a.proc.poll() is None:
                assert a.stop() == 0, a.log_text()[-3000:]

    try:
        figures = await account(db, agents)
        print(
            "\nfault suite: reports sent={sent} accepted={accepted} still spooled={spooled} "
            "lost={lost} duplicated={duplicated} sequence gaps={gaps}".format(**figures)
        )
        assert figures["lost"] == 0 and figures["duplicated"] == 0 and figures["gaps"] == 0, figures
        verify = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "api.cli", "verify"],
            env=clean_env(MODELFORGE_DATABASE_URL=db.dsn),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert verify.returncode == 0, verify.stdout + verify.stderr
    finally:
        await http.aclose()
        assert server.stop() == 0, server.log_text()[-3000:]

    log = server.log_text()
    assert "embedded_postgres.restarted" in log and "embedded_postgres.stale_handles_dropped" in log
    assert "http.unexpected_error" not in log and "Traceback" not in log, log[-5000:]

    # The server killed with -9 left its handle behind; the clean stop still stopped PostgreSQL.
    async def gone() -> bool:
        return not db.running()

    await wait_for(gone, 10, "no postmaster left after a clean stop")


async def _is(http: httpx.AsyncClient, url: str, node_id: str, state: str) -> bool:
    return await liveness(http, url, node_id) == state


async def account(db: Embedded, agents: list[AgentProcess]) -> dict[str, int]:
    """Per agent and stream: the sequences it made (its counter) against those the log holds once
    each and those still in its spool."""
    sent = accepted_n = spooled = lost = duplicated = 0
    for a in agents:
        counters: dict[str, int] = json.loads((a.state_dir / "agent-sequences.json").read_text())["streams"]
        pending = {
            (p.name.split("-")[1], int(p.name.split("-")[2].removesuffix(".json")))
            for p in (a.state_dir / "agent-spool").glob("*.json")
        }
        snapshots = await logged(
            db, "stream_id = $1 AND event_type = 'NODE_TELEMETRY_OBSERVED'", a.expected_node_id
        )
        arrived = [(e.metadata.agent_stream, e.metadata.agent_sequence) for e in snapshots]
        duplicated += len(arrived) - len(set(arrived))
        for stream, last in counters.items():
            made = {(stream, q) for q in range(1, last + 1)}
            sent += len(made)
            lost += len(made - set(arrived) - pending)
        accepted_n += len(set(arrived))
        spooled += len(pending)
    gaps = await db.fetch("SELECT coalesce(sum(skipped), 0) AS n FROM agent_stream_positions")
    return {
        "sent": sent,
        "accepted": accepted_n,
        "spooled": spooled,
        "lost": lost,
        "duplicated": duplicated,
        "gaps": int(gaps[0]["n"]),
    }


async def test_a_database_that_cannot_start_again_makes_the_server_exit_non_zero(workdir: Path) -> None:
    """The postmaster dies and its configuration no longer lets it start: after its attempts the
    server exits 1 (so systemd or compose starts a fresh one) instead of serving 503s forever."""
    server = ServerProcess("", workdir)
    db = Embedded(workdir / "server-state")
    server.start()
    try:
        await server.wait_healthy(within=60)
        with (db.data / "postgresql.auto.conf").open("a") as conf:
            conf.write("\nshared_buffers = 'not a size'\n")
        os.kill(db.postmaster_pid(), signal.SIGKILL)
        assert server.proc is not None
        code = await asyncio.to_thread(server.proc.wait, 60)
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.stop()
    log = server.log_text()
    assert code == 1, log[-3000:]
    assert log.count("embedded_postgres.restart_failed") == 5 and "embedded_postgres.gave_up" in log, log[
        -3000:
    ]
    assert "Traceback" not in log, log[-3000:]
