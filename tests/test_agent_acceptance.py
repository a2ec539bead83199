"""The outbound agent, enrollment and the report protocol, end to end.

Real PostgreSQL, real `modelforge-hw serve` processes on 127.0.0.1 and real agent processes (with
the fake NVML, tests/agent_wrapper.py), each with its own state directory and MODELFORGE_NODE_ID.
One server process (small liveness thresholds) serves the whole module on one database; tests
use identities of their own, so they do not see each other's nodes.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from collectors.facts import Known
from domain.node import node_id_for
from ledger.db import create_pool
from tests.agent_support import (
    OPERATOR,
    OPERATOR_TOKEN,
    ROOT,
    AgentProcess,
    ServerProcess,
    assert_no_secrets,
    assert_problem,
    clean_env,
    create_token,
    enroll_direct,
    observation,
    post_report,
    report_body,
    wait_for,
)
from tests.conftest import dsn_for_database
from tests.sample_reads import logged

STALE_AFTER = 2.0
OFFLINE_AFTER = 4.0


@pytest.fixture(scope="module")
async def plane_dsn(pg_server_dsn: str, template_database: str) -> AsyncIterator[str]:
    name = f"mf_test_{template_database[-12:]}_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(pg_server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"')
    finally:
        await admin.close()
    yield dsn_for_database(pg_server_dsn, name)
    admin = await asyncpg.connect(pg_server_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture(scope="module")
async def db(plane_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await create_pool(plane_dsn, min_size=1, max_size=4)
    yield pool
    await pool.close()


@pytest.fixture(scope="module")
async def server(plane_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ServerProcess]:
    s = ServerProcess(
        plane_dsn, tmp_path_factory.mktemp("plane"), stale_after=STALE_AFTER, offline_after=OFFLINE_AFTER
    ).start()
    try:
        await s.wait_healthy()
        yield s
    finally:
        assert s.stop() == 0, s.log_text()[-4000:]


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=15) as client:
        yield client


def tag() -> str:
    return uuid.uuid4().hex[:8]


async def event_count(db: asyncpg.Pool, node_id: str) -> int:
    async with db.acquire() as conn:
        return int(await conn.fetchval("SELECT count(*) FROM events WHERE stream_id = $1", node_id))


async def reports_of(db: asyncpg.Pool, node_id: str) -> int:
    async with db.acquire() as conn:
        return int(
            await conn.fetchval(
                "SELECT coalesce(sum(reports), 0) FROM agent_stream_positions WHERE node_id = $1", node_id
            )
        )


async def wait_reports(
    db: asyncpg.Pool, agents: list[AgentProcess], at_least: int, within: float = 20.0
) -> None:
    async def enough() -> bool:
        for a in agents:
            assert a.proc is None or a.alive(), f"agent {a.node_id} exited:\n{a.log_text()[-3000:]}"
        counts = [await reports_of(db, a.expected_node_id) for a in agents]
        return all(c >= at_least for c in counts)

    await wait_for(enough, within, f"{at_least} reports from each agent")


async def nodes_tagged(http: httpx.AsyncClient, url: str, prefix: str) -> list[dict[str, Any]]:
    r = await http.get(url + "/api/v1/hardware/nodes", params={"limit": "1000"}, headers=OPERATOR)
    assert r.status_code == 200, r.text
    return [n for n in r.json()["items"] if (n["identity_key"] or "").startswith(prefix)]


async def accelerator_counts(db: asyncpg.Pool, node_ids: list[str]) -> dict[str, int]:
    async with db.acquire() as conn:
        rows = await conn.fetch(
            "SELECT node_id, count(*) AS n, count(DISTINCT uuid) AS distinct_uuids FROM hw_accelerators "
            "WHERE node_id = ANY($1) GROUP BY node_id",
            node_ids,
        )
    for r in rows:
        assert r["n"] == r["distinct_uuids"], "an accelerator is duplicated"
    return {r["node_id"]: r["n"] for r in rows}


async def discovered_counts(db: asyncpg.Pool, node_ids: list[str]) -> dict[str, int]:
    async with db.acquire() as conn:
        rows = await conn.fetch(
            "SELECT stream_id, count(*) AS n FROM events WHERE event_type = 'NODE_DISCOVERED' "
            "AND stream_id = ANY($1) GROUP BY stream_id",
            node_ids,
        )
    return {r["stream_id"]: r["n"] for r in rows}


async def report_sequences(db: asyncpg.Pool, node_id: str) -> dict[str, list[int]]:
    """Per agent stream, the sequence of each accepted report in the order the log holds them (one
    NODE_TELEMETRY_OBSERVED per report)."""
    async with db.acquire() as conn:
        events = await logged(conn, "stream_id = $1 AND event_type = 'NODE_TELEMETRY_OBSERVED'", node_id)
    out: dict[str, list[int]] = {}
    for e in events:
        out.setdefault(e.metadata.agent_stream or "", []).append(e.metadata.agent_sequence or 0)
    return out


def assert_strictly_increasing(sequences: dict[str, list[int]]) -> None:
    for stream, seqs in sequences.items():
        assert seqs == sorted(set(seqs)), f"stream {stream}: a report twice or out of order: {seqs}"


# --- three agents, three nodes ------------------------------------------------------------------------


async def test_three_agents_enroll_and_report_three_nodes_and_a_restart_makes_no_new_node(
    server: ServerProcess, db: asyncpg.Pool, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    prefix = f"fleet-{tag()}-"
    # The operator's command line on the server host: one token for three agents.
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "api.cli", "token", "create", "--ttl", "1h", "--uses", "3", "--json"],
        env=clean_env(MODELFORGE_DATABASE_URL=server.dsn, MODELFORGE_STATE_DIR=str(tmp_path / "cli")),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    token = json.loads(out.stdout)["token"]
    gpus = {"a": 2, "b": 3, "c": 1}
    agents = [AgentProcess(tmp_path, prefix + name, gpus=n) for name, n in gpus.items()]
    enrolled = await asyncio.gather(*(a.enroll(server.url, token) for a in agents))
    assert [e.returncode for e in enrolled] == [0, 0, 0], [e.stderr for e in enrolled]
    for a in agents:
        path = a.state_dir / "agent-credential.json"
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        assert a.credential()["node_id"] == a.expected_node_id
    try:
        for a in agents:
            a.start(server.url)
        await wait_reports(db, agents, 2)
        nodes = await nodes_tagged(http, server.url, prefix)
        assert sorted(n["id"] for n in nodes) == sorted(a.expected_node_id for a in agents)
        assert all(n["liveness"] == "online" and n["source"] == "agent" for n in nodes)
        ids = [a.expected_node_id for a in agents]
        assert await accelerator_counts(db, ids) == {a.expected_node_id: a.gpus for a in agents}

        # Restart one agent: same node, same accelerators, its sequences continue.
        first = agents[0]
        assert first.stop() == 0
        before = await reports_of(db, first.expected_node_id)
        first.start(server.url)
        await wait_for(
            lambda: _more_reports(db, first.expected_node_id, before + 2), 20, "reports after the restart"
        )
        nodes_after = await nodes_tagged(http, server.url, prefix)
        assert sorted(n["id"] for n in nodes_after) == sorted(ids)
        assert await discovered_counts(db, ids) == dict.fromkeys(ids, 1)
        assert await accelerator_counts(db, ids) == {a.expected_node_id: a.gpus for a in agents}
        for node_id in ids:
            assert_strictly_increasing(await report_sequences(db, node_id))
    finally:
        codes = [a.stop() for a in agents if a.proc is not None]
    assert codes == [0, 0, 0]
    for a in agents:
        assert "agent.report_quarantined" not in a.log_text(), a.log_text()[-3000:]
    # The token's three uses are spent.
    r = await enroll_direct(http, server.url, token, prefix + "d")
    assert_problem(r, 401, "enrollment-token-used-up")
    assert_no_secrets(
        {"server": server.log_text(), **{a.node_id: a.log_text() for a in agents}},
        [token, OPERATOR_TOKEN, *(a.credential()["credential"] for a in agents)],
    )


async def _more_reports(db: asyncpg.Pool, node_id: str, at_least: int) -> bool:
    return await reports_of(db, node_id) >= at_least


# --- replay, reordering, gaps ------------------------------------------------------------------------


async def test_replay_is_idempotent_other_content_or_older_sequence_is_409_and_gaps_are_recorded(
    server: ServerProcess, db: asyncpg.Pool, http: httpx.AsyncClient
) -> None:
    key = f"replay-{tag()}"
    node_id = node_id_for(key)
    token = (await create_token(http, server.url))["token"]
    r = await enroll_direct(http, server.url, token, key)
    assert r.status_code == 201, r.text
    credential = r.json()["credential"]

    captured = report_body(key, 1, mem_avail=100)
    r = await post_report(http, server.url, credential, captured)
    assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
    assert r.json()["previous_sequence"] is None and r.json()["gap"] == 0
    appended = await event_count(db, node_id)

    # The captured report again, unchanged: an idempotent retry.
    r = await post_report(http, server.url, credential, captured)
    assert r.status_code == 200 and r.json()["status"] == "duplicate" and r.json()["events"] == 0, r.text
    assert await event_count(db, node_id) == appended

    # The same sequence with any other content.
    p = assert_problem(
        await post_report(http, server.url, credential, report_body(key, 1, mem_avail=101)),
        409,
        "sequence-conflict",
    )
    assert p["last_sequence"] == 1 and p["stream"] == "telemetry"
    assert await event_count(db, node_id) == appended

    # A newer one, then an older one (other content) and the old one unchanged.
    r = await post_report(http, server.url, credential, report_body(key, 2, mem_avail=102))
    assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
    appended = await event_count(db, node_id)
    p = assert_problem(
        await post_report(http, server.url, credential, report_body(key, 1, mem_avail=99)),
        409,
        "sequence-conflict",
    )
    assert "older" in p["detail"] and p["last_sequence"] == 2
    r = await post_report(http, server.url, credential, captured)
    assert r.status_code == 200 and r.json()["status"] == "duplicate"
    assert await event_count(db, node_id) == appended

    # Streams have their own sequences.
    r = await post_report(http, server.url, credential, report_body(key, 1, stream="inventory"))
    assert r.status_code == 200 and r.json()["status"] == "accepted"

    # A gap is accepted and recorded: in the answer, the events' metadata and the stream position.
    r = await post_report(http, server.url, credential, report_body(key, 5, mem_avail=105))
    assert r.status_code == 200 and r.json()["gap"] == 2 and r.json()["previous_sequence"] == 2, r.text
    async with db.acquire() as conn:
        gaps = [
            {"gap": gap}
            for gap in {
                e.metadata.agent_sequence_gap
                for e in await logged(conn, "stream_id = $1", node_id)
                if e.metadata.agent_sequence == 5
            }
        ]
        position = await conn.fetchrow(
            "SELECT last_sequence, skipped, reports FROM agent_stream_positions "
            "WHERE node_id = $1 AND stream = 'telemetry'",
            node_id,
        )
    assert [g["gap"] for g in gaps] == [2]
    assert dict(position) == {"last_sequence": 5, "skipped": 2, "reports": 3}
    streams = (
        await http.get(server.url + "/api/v1/agent-streams", params={"node_id": node_id}, headers=OPERATOR)
    ).json()
    assert {s["stream"]: s["last_sequence"] for s in streams["items"]} == {"inventory": 1, "telemetry": 5}


# --- credentials -------------------------------------------------------------------------------------


async def test_credential_of_node_a_cannot_publish_for_node_b(
    server: ServerProcess, db: asyncpg.Pool, http: httpx.AsyncClient
) -> None:
    t = tag()
    key_a, key_b = f"a-{t}", f"b-{t}"
    token = (await create_token(http, server.url, uses=2))["token"]
    cred_a = (await enroll_direct(http, server.url, token, key_a)).json()["credential"]
    cred_b = (await enroll_direct(http, server.url, token, key_b)).json()["credential"]
    before = await event_count(db, node_id_for(key_b))
    assert_problem(
        await post_report(http, server.url, cred_a, report_body(key_b, 1)), 403, "credential-node-mismatch"
    )
    assert_problem(
        await post_report(http, server.url, cred_b, report_body(key_a, 1)), 403, "credential-node-mismatch"
    )
    assert await event_count(db, node_id_for(key_b)) == before
    assert await event_count(db, node_id_for(key_a)) == 1  # its CREDENTIAL_ISSUED only
    # node_id that is not the identity's: refused before any credential question.
    forged = json.loads(report_body(key_a, 1))
    forged["node_id"] = node_id_for(key_b)
    assert_problem(
        await post_report(http, server.url, cred_a, json.dumps(forged).encode()), 400, "node-id-mismatch"
    )
    r = await post_report(http, server.url, cred_b, report_body(key_b, 1))
    assert r.status_code == 200, r.text


async def test_revoked_credential_is_401_and_the_agent_stops_saying_why(
    server: ServerProcess, db: asyncpg.Pool, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    token = (await create_token(http, server.url))["token"]
    agent = AgentProcess(tmp_path, f"revoked-{tag()}")
    assert (await agent.enroll(server.url, token)).returncode == 0, agent.log_text()
    agent.start(server.url)
    try:
        await wait_reports(db, [agent], 2)
        credential = agent.credential()
        r = await http.post(
            f"{server.url}/api/v1/agent-credentials/{credential['credential_id']}/revoke",
            json={"reason": "host reimaged"},
            headers=OPERATOR,
        )
        assert r.status_code == 200 and r.json()["status"] == "revoked", r.text
        after_revoke = await event_count(db, agent.expected_node_id)
        await wait_for(lambda: _exited(agent), 15, "the agent to stop publishing")
        assert agent.proc is not None and agent.proc.returncode == 78, agent.log_text()[-3000:]
    finally:
        if agent.alive():
            agent.stop()
    log = agent.log_text()
    assert "agent.publishing_stopped" in log and "revoked" in log
    assert await event_count(db, agent.expected_node_id) == after_revoke  # nothing after the revocation
    p = assert_problem(
        await post_report(http, server.url, credential["credential"], report_body(agent.node_id, 10_000)),
        401,
        "credential-revoked",
    )
    assert p["detail"]
    listed = await http.get(
        server.url + "/api/v1/agent-credentials", params={"node_id": agent.expected_node_id}, headers=OPERATOR
    )
    assert [c["status"] for c in listed.json()["items"]] == ["revoked"]
    assert "secret" not in listed.text and credential["credential"] not in listed.text


async def _exited(agent: AgentProcess) -> bool:
    return agent.proc is not None and agent.proc.poll() is not None


async def test_expired_used_up_revoked_or_forged_enrollment_tokens_are_401(
    server: ServerProcess, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    t = tag()
    expiring = await create_token(http, server.url, ttl=1)
    once = await create_token(http, server.url, uses=1)
    twice = await create_token(http, server.url, uses=2)
    revoked = await create_token(http, server.url)
    r = await http.post(
        f"{server.url}/api/v1/enrollment-tokens/{revoked['token_id']}/revoke", headers=OPERATOR, json={}
    )
    assert r.status_code == 200 and r.json()["status"] == "revoked"

    assert (await enroll_direct(http, server.url, once["token"], f"once-{t}")).status_code == 201
    assert_problem(
        await enroll_direct(http, server.url, once["token"], f"once2-{t}"), 401, "enrollment-token-used-up"
    )
    assert_problem(
        await enroll_direct(http, server.url, revoked["token"], f"rev-{t}"), 401, "enrollment-token-revoked"
    )
    forged = twice["token"][:-4] + ("AAAA" if not twice["token"].endswith("AAAA") else "BBBB")
    assert_problem(
        await enroll_direct(http, server.url, forged, f"forged-{t}"), 401, "enrollment-token-invalid"
    )
    assert_problem(
        await enroll_direct(http, server.url, "nonsense", f"x-{t}"), 401, "enrollment-token-invalid"
    )

    # Uses are counted atomically: five agents racing for a two-use token, two win.
    racing = await asyncio.gather(
        *(enroll_direct(http, server.url, twice["token"], f"race{i}-{t}") for i in range(5))
    )
    assert sorted(r.status_code for r in racing) == [201, 201, 401, 401, 401]

    await asyncio.sleep(max(0.0, _parse(expiring["expires_at"]) - time.time() + 0.2))
    assert_problem(
        await enroll_direct(http, server.url, expiring["token"], f"exp-{t}"), 401, "enrollment-token-expired"
    )
    # The agent's command line says so in one line, and keeps no credential.
    agent = AgentProcess(tmp_path, f"exp-cli-{t}")
    done = await agent.enroll(server.url, expiring["token"])
    assert done.returncode == 2 and "expired" in done.stderr, done.stderr
    assert not (agent.state_dir / "agent-credential.json").exists()

    # Token routes are operator routes.
    assert_problem(await http.post(server.url + "/api/v1/enrollment-tokens", json={}), 401)
    assert_problem(
        await http.get(server.url + "/api/v1/enrollment-tokens", headers={"Authorization": "Bearer nope"}),
        401,
    )
    listed = await http.get(server.url + "/api/v1/enrollment-tokens", headers=OPERATOR)
    by_id = {x["token_id"]: x for x in listed.json()["items"]}
    assert (
        by_id[once["token_id"]]["status"] == "used_up" and by_id[revoked["token_id"]]["status"] == "revoked"
    )
    assert by_id[expiring["token_id"]]["status"] == "expired"
    assert all(x["token"] not in listed.text for x in (once, twice, revoked, expiring))


def _parse(moment: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(moment.replace("Z", "+00:00")).timestamp()


async def test_no_secret_appears_in_any_log(
    server: ServerProcess, db: asyncpg.Pool, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    token = (await create_token(http, server.url))["token"]
    agent = AgentProcess(tmp_path, f"secret-{tag()}")
    enrolled = await agent.enroll(server.url, token, "--log-level", "DEBUG")
    assert enrolled.returncode == 0, enrolled.stderr
    credential = agent.credential()
    done = await asyncio.to_thread(
        subprocess.run,
        agent.command("run", "--once", "--server", server.url, "--log-level", "DEBUG"),
        env=agent.env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    r = await http.post(
        f"{server.url}/api/v1/agent-credentials/{credential['credential_id']}/revoke",
        headers=OPERATOR,
        json={},
    )
    assert r.status_code == 200
    stopped = await asyncio.to_thread(
        subprocess.run,
        agent.command("run", "--once", "--server", server.url, "--log-level", "DEBUG"),
        env=agent.env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stopped.returncode == 78
    logs = {
        "server": server.log_text(),
        "enroll": enrolled.stdout + enrolled.stderr,
        "run": done.stdout + done.stderr,
        "stopped": stopped.stdout + stopped.stderr,
    }
    assert '"agent.report_sent"' in logs["run"] and "agent.publishing_stopped" in logs["stopped"]
    assert_no_secrets(logs, [token, credential["credential"], OPERATOR_TOKEN])


# --- bad input ---------------------------------------------------------------------------------------


async def test_bad_input_is_400_or_413_problem_json_and_nothing_is_appended(
    server: ServerProcess, db: asyncpg.Pool, http: httpx.AsyncClient
) -> None:
    key = f"bad-{tag()}"
    node_id = node_id_for(key)
    token = (await create_token(http, server.url))["token"]
    credential = (await enroll_direct(http, server.url, token, key)).json()["credential"]
    r = await post_report(http, server.url, credential, report_body(key, 1))
    assert r.status_code == 200
    before = await event_count(db, node_id)

    def mutated(**changes: Any) -> bytes:
        doc = json.loads(report_body(key, 2))
        doc.update(changes)
        return json.dumps(doc).encode()

    marker = 987_654_321
    template = report_body(key, 2, mem_avail=marker)
    negative_obs = observation()
    negative_obs = type(negative_obs)(
        observed_at=negative_obs.observed_at,
        host=type(negative_obs.host)(
            **{
                **{f: getattr(negative_obs.host, f) for f in negative_obs.host.__struct_fields__},
                "telemetry": {"memory_available_bytes": Known(-5)},
            }
        ),
        nvml=negative_obs.nvml,
    )
    cases: list[tuple[str, bytes, int, str]] = [
        ("malformed JSON", b'{"protocol": 1, "node_id": ', 400, "malformed-json"),
        ("not an object", b"[1, 2, 3]", 400, "validation-failed"),
        ("wrong type", mutated(sequence="two"), 400, "validation-failed"),
        ("sequence 0", mutated(sequence=0), 400, "validation-failed"),
        ("unknown field", mutated(extra=True), 400, "validation-failed"),
        ("naive time", mutated(observed_at="2026-11-30T12:00:00"), 400, "validation-failed"),
        ("unknown stream", mutated(stream="gossip"), 400, "unknown-stream"),
        ("protocol", mutated(protocol=2), 400, "unsupported-protocol"),
        ("negative metric", report_body(key, 2, obs=negative_obs), 400, "validation-failed"),
        ("NaN metric", template.replace(str(marker).encode(), b"NaN"), 400, "malformed-json"),
        ("infinite metric", template.replace(str(marker).encode(), b"1e999"), 400, "validation-failed"),
        ("negative literal", template.replace(str(marker).encode(), b"-1.5"), 400, "validation-failed"),
        ("over the size limit", b'{"pad": "' + b"x" * (1024 * 1024) + b'"}', 413, "payload-too-large"),
    ]
    # What PostgreSQL would refuse (never a 500) and garbage that would become history.
    host_ = ("observation", "host")
    gpu0 = ("observation", "nvml", "accelerators", 0)
    outside_the_contract: list[tuple[str, tuple[Any, ...], Any]] = [
        ("NUL in hostname", (*host_, "hostname"), "gpu\u0000host"),
        ("NUL in os.name", (*host_, "os", "name"), {"state": "known", "value": "Ubuntu\u0000"}),
        ("NUL in a GPU uuid", (*gpu0, "uuid"), "GPU-\u0000"),
        ("NUL in a mount path", (*host_, "storage", 0, "mount"), "/\u0000"),
        ("NUL in a reason", (*gpu0, "name"), {"state": "unavailable", "reason": "\u0000"}),
        ("year 9999, offset -23:59", ("observed_at",), "9999-12-31T23:59:59-23:59"),
        ("year 1, offset +23:59", ("observation", "observed_at"), "0001-01-01T00:00:00+23:59"),
        (
            "a string for bytes",
            (*host_, "telemetry", "memory_available_bytes"),
            {"state": "known", "value": "abc"},
        ),
        (
            "a bool for bytes",
            (*host_, "telemetry", "memory_available_bytes"),
            {"state": "known", "value": True},
        ),
        ("bytes 2^64+1", (*host_, "memory_total_bytes"), {"state": "known", "value": 2**64 + 1}),
        ("GPU index 2^63", (*gpu0, "index"), {"state": "known", "value": 2**63}),
        (
            "a metric of 10^100",
            (*gpu0, "telemetry", "temperature_celsius"),
            {"state": "known", "value": 10**100},
        ),
        (
            "a percentage of 101",
            (*gpu0, "telemetry", "utilization_gpu_percent"),
            {"state": "known", "value": 101},
        ),
        ("an unknown metric", (*gpu0, "telemetry", "joy_percent"), {"state": "known", "value": 1}),
        ("sequence 2^63-1", ("sequence",), 2**63 - 1),
    ]
    for name, path, value in outside_the_contract:
        doc = json.loads(report_body(key, 2))
        target = doc
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value
        # A NUL is refused before the body is decoded (api/http/guards.py), the rest by the contract.
        refusal = "nul-character" if name.startswith("NUL") else "validation-failed"
        cases.append((name, json.dumps(doc).encode(), 400, refusal))
    duplicated = report_body(key, 2).replace(b'{"protocol":1,', b'{"protocol":1,"sequence":3,', 1)
    assert duplicated != report_body(key, 2)
    cases.append(("a duplicate key", duplicated, 400, "validation-failed"))
    twice = json.loads(report_body(key, 2))
    twice["observation"]["nvml"]["accelerators"].append(twice["observation"]["nvml"]["accelerators"][0])
    cases.append(("the same GPU twice", json.dumps(twice).encode(), 400, "invalid-observation"))
    for name, body, status, type_ in cases:
        r = await post_report(http, server.url, credential, body)
        assert r.status_code == status, (name, r.status_code, r.text)
        problem = assert_problem(r, status, type_)
        assert problem["detail"], name
    # Enrollment and token bodies are validated too.
    assert_problem(
        await http.post(
            server.url + "/api/v1/agent/enroll",
            content=b"{oops",
            headers={"Authorization": f"Bearer {token}"},
        ),
        400,
    )
    assert_problem(
        await http.post(server.url + "/api/v1/enrollment-tokens", json={"uses": "many"}, headers=OPERATOR),
        400,
    )
    assert_problem(
        await http.post(server.url + "/api/v1/enrollment-tokens", json={"uses": 0}, headers=OPERATOR), 400
    )
    assert await event_count(db, node_id) == before
    assert "Traceback" not in server.log_text()
    # The stream is where it was: sequence 2 is still free.
    r = await post_report(http, server.url, credential, report_body(key, 2))
    assert r.status_code == 200 and r.json()["previous_sequence"] == 1


# --- liveness and clock skew -------------------------------------------------------------------------


async def test_clock_skew_of_3h_either_way_is_online_while_reporting_then_stale_and_offline_by_central_clock(
    server: ServerProcess, db: asyncpg.Pool, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    t = tag()
    token = (await create_token(http, server.url, uses=2))["token"]
    ahead = AgentProcess(tmp_path, f"ahead-{t}", clock_offset=3 * 3600)
    behind = AgentProcess(tmp_path, f"behind-{t}", clock_offset=-3 * 3600)
    agents = [ahead, behind]
    assert [(await a.enroll(server.url, token)).returncode for a in agents] == [0, 0]
    for a in agents:
        a.start(server.url)
    try:
        await wait_reports(db, agents, 3)
        for a, sign in ((ahead, 1), (behind, -1)):
            node = (
                await http.get(f"{server.url}/api/v1/hardware/nodes/{a.expected_node_id}", headers=OPERATOR)
            ).json()
            assert node["liveness"] == "online", node
            assert abs(node["clock_skew_seconds"] - sign * 3 * 3600) < 120, node["clock_skew_seconds"]
    finally:
        assert [a.stop() for a in agents] == [0, 0]

    seen: dict[str, list[tuple[str, float]]] = {a.node_id: [] for a in agents}
    deadline = time.monotonic() + OFFLINE_AFTER + 8
    while time.monotonic() < deadline:
        for a in agents:
            node = (
                await http.get(f"{server.url}/api/v1/hardware/nodes/{a.expected_node_id}", headers=OPERATOR)
            ).json()
            age = time.time() - _parse(node["last_received_at"])
            if not seen[a.node_id] or seen[a.node_id][-1][0] != node["liveness"]:
                seen[a.node_id].append((node["liveness"], age))
        if all(s[-1][0] == "offline" for s in seen.values()):
            break
        await asyncio.sleep(0.15)
    for name, states in seen.items():
        order = [s for s, _ in states]
        assert order in (["online", "stale", "offline"], ["stale", "offline"]), (name, states)
        stale_age = next(age for s, age in states if s == "stale")
        offline_age = next(age for s, age in states if s == "offline")
        # Judged by the server's clock against its own receive time (same host clock as this test).
        assert STALE_AFTER - 0.5 <= stale_age <= OFFLINE_AFTER + 0.5, states
        assert offline_age >= OFFLINE_AFTER - 0.5, states


# --- resilience --------------------------------------------------------------------------------------


async def test_server_down_then_up_every_spooled_report_arrives_in_order_none_twice(
    plane_dsn: str, db: asyncpg.Pool, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    own = ServerProcess(plane_dsn, tmp_path / "own-server").start()
    await own.wait_healthy()
    agent = AgentProcess(tmp_path, f"outage-{tag()}")
    try:
        token = (await create_token(http, own.url))["token"]
        assert (await agent.enroll(own.url, token)).returncode == 0
        agent.start(own.url, interval=0.25)
        await wait_reports(db, [agent], 2)

        assert own.stop() == 0
        await wait_for(lambda: _spooled(agent, 6), 15, "reports piling up in the spool")
        assert agent.alive(), agent.log_text()[-3000:]

        own.start()
        await own.wait_healthy()
        await wait_for(lambda: _spooled_at_most(agent, 1), 30, "the spool to drain")
        await asyncio.sleep(0.5)
        assert agent.alive(), agent.log_text()[-3000:]
    finally:
        if agent.proc is not None:
            assert agent.stop() == 0, agent.log_text()[-3000:]
        if own.proc is not None and own.proc.poll() is None:
            own.stop()

    log = agent.log_text()
    assert "agent.send_failed" in log and "agent.report_quarantined" not in log and "Traceback" not in log
    counters = json.loads((agent.state_dir / "agent-sequences.json").read_text())["streams"]
    still_spooled = {
        (p.name.split("-")[1], int(p.name.split("-")[2].removesuffix(".json")))
        for p in (agent.state_dir / "agent-spool").glob("*.json")
    }
    arrived = await report_sequences(db, agent.expected_node_id)
    assert_strictly_increasing(arrived)
    for stream, last in counters.items():
        got = set(arrived.get(stream, []))
        pending = {q for s, q in still_spooled if s == stream}
        assert got | pending == set(range(1, last + 1)) and not got & pending, (stream, arrived, pending)
    # Arrival order is creation order across both streams (the agent's observation times).
    async with db.acquire() as conn:
        observed = await logged(
            conn, "stream_id = $1 AND event_type = 'NODE_TELEMETRY_OBSERVED'", agent.expected_node_id
        )
    times = [e.metadata.observed_at for e in observed]
    assert times == sorted(times)
    # The backlog arrived late, but the skew is measured at send time: no phantom skew.
    async with db.acquire() as conn:
        skew = await conn.fetchval(
            "SELECT clock_skew_seconds FROM hw_host_telemetry WHERE node_id = $1", agent.expected_node_id
        )
    assert abs(skew) < 2.0, skew


async def _spooled(agent: AgentProcess, at_least: int) -> bool:
    assert agent.alive(), agent.log_text()[-3000:]
    return agent.spooled() >= at_least


async def _spooled_at_most(agent: AgentProcess, at_most: int) -> bool:
    assert agent.alive(), agent.log_text()[-3000:]
    return agent.spooled() <= at_most


# --- scale-out ---------------------------------------------------------------------------------------


async def test_two_servers_on_one_database_no_duplicates_and_sequences_enforced_across_both(
    server: ServerProcess, plane_dsn: str, db: asyncpg.Pool, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    second = ServerProcess(
        plane_dsn, tmp_path / "second", stale_after=STALE_AFTER, offline_after=OFFLINE_AFTER
    )
    second.start()
    await second.wait_healthy()
    prefix = f"scale-{tag()}-"
    x = AgentProcess(tmp_path, prefix + "x", gpus=2)
    y = AgentProcess(tmp_path, prefix + "y", gpus=3)
    z = AgentProcess(tmp_path, prefix + "z", gpus=2)
    agents = [x, y, z]
    try:
        token = (await create_token(http, server.url, uses=4))["token"]
        assert (await x.enroll(server.url, token)).returncode == 0
        assert (await y.enroll(second.url, token)).returncode == 0
        assert (await z.enroll(server.url, token)).returncode == 0
        x.start(server.url)
        y.start(second.url)
        z.start(server.url)
        await wait_reports(db, agents, 3)
        # z is switched from the first server to the second mid-run.
        assert z.stop() == 0
        switched_at = await reports_of(db, z.expected_node_id)
        z.start(second.url)
        await wait_for(
            lambda: _more_reports(db, z.expected_node_id, switched_at + 3), 20, "z via the second server"
        )

        # The same report to both servers at once: one appends, the other answers duplicate.
        key = prefix + "direct"
        credential = (await enroll_direct(http, second.url, token, key)).json()["credential"]
        body = report_body(key, 1)
        both = await asyncio.gather(
            post_report(http, server.url, credential, body), post_report(http, second.url, credential, body)
        )
        assert [r.status_code for r in both] == [200, 200], [r.text for r in both]
        assert sorted(r.json()["status"] for r in both) == ["accepted", "duplicate"]
        # The same next sequence with different content to both at once: exactly one wins.
        racing = await asyncio.gather(
            post_report(http, server.url, credential, report_body(key, 2, mem_avail=1)),
            post_report(http, second.url, credential, report_body(key, 2, mem_avail=2)),
        )
        assert sorted(r.status_code for r in racing) == [200, 409]
        # Older than what the other server accepted: refused here too.
        assert_problem(
            await post_report(http, second.url, credential, report_body(key, 1, mem_avail=3)),
            409,
            "sequence-conflict",
        )
        assert_problem(
            await post_report(http, server.url, credential, report_body(key, 2, mem_avail=4)),
            409,
            "sequence-conflict",
        )
    finally:
        codes = [a.stop() for a in agents if a.proc is not None]
        assert second.stop() == 0, second.log_text()[-3000:]
    assert codes == [0, 0, 0]

    ids = [a.expected_node_id for a in agents] + [node_id_for(key)]
    nodes = await nodes_tagged(http, server.url, prefix)
    assert sorted(n["id"] for n in nodes) == sorted(ids)
    assert await discovered_counts(db, ids) == dict.fromkeys(ids, 1)
    assert await accelerator_counts(db, ids) == {
        x.expected_node_id: 2,
        y.expected_node_id: 3,
        z.expected_node_id: 2,
        ids[-1]: 2,
    }
    for node_id in ids:
        assert_strictly_increasing(await report_sequences(db, node_id))
    assert (await report_sequences(db, ids[-1])) == {"telemetry": [1, 2]}
    for a in agents:
        assert "agent.report_quarantined" not in a.log_text(), a.log_text()[-3000:]


# --- the read models rebuild to the same rows --------------------------------------------------------


async def test_rebuild_reproduces_credentials_and_tokens_row_for_row(
    server: ServerProcess, db: asyncpg.Pool, http: httpx.AsyncClient
) -> None:
    from projections.inventory import ALL_PROJECTIONS
    from projections.rebuild import rebuild

    key = f"rebuild-{tag()}"
    token = (await create_token(http, server.url, uses=2))["token"]
    first = (await enroll_direct(http, server.url, token, key)).json()
    again = (await enroll_direct(http, server.url, token, key)).json()  # re-enrollment supersedes
    assert again["superseded_credentials"] == [first["credential_id"]]
    assert (await post_report(http, server.url, again["credential"], report_body(key, 1))).status_code == 200
    assert_problem(
        await post_report(http, server.url, first["credential"], report_body(key, 2)),
        401,
        "credential-revoked",
    )
    report = await rebuild(db, ALL_PROJECTIONS, verify=True)
    assert report.differences == []
    await rebuild(db, ALL_PROJECTIONS)  # swap in, while the server keeps serving
    r = await post_report(http, server.url, again["credential"], report_body(key, 2, mem_avail=5))
    assert r.status_code == 200 and r.json()["previous_sequence"] == 1, r.text
