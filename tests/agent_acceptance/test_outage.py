"""A server outage: the agent spools its reports and every one arrives after, in order, none twice."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import asyncpg
import httpx

from tests.agent_acceptance.plane import (
    assert_strictly_increasing,
    report_sequences,
    tag,
    wait_reports,
)
from tests.agent_support import (
    AgentProcess,
    ServerProcess,
    create_token,
    wait_for,
)
from tests.sample_reads import logged


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
