"""What the acceptance tests of the agent share: the plane's liveness thresholds and what they read
back from its database and API."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import asyncpg
import httpx

from tests.agent_support import OPERATOR, AgentProcess, wait_for
from tests.sample_reads import logged

STALE_AFTER = 2.0
OFFLINE_AFTER = 4.0


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


async def more_reports(db: asyncpg.Pool, node_id: str, at_least: int) -> bool:
    return await reports_of(db, node_id) >= at_least


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


def parse_moment(moment: str) -> float:
    return datetime.fromisoformat(moment.replace("Z", "+00:00")).timestamp()
