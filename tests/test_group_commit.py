"""Group commit (ledger/group_commit.py): concurrent units of work share one transaction, each
caller gets its own unit's outcome, and a unit that fails fails nobody else."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
import pytest

from agent.protocol import EnrollRequest
from api.config import ServerConfig
from api.wiring import build_services
from ledger.group_commit import GroupCommit
from tests.agent_support import report_body


@pytest.fixture
async def probe(pool: asyncpg.Pool) -> asyncpg.Pool:
    async with pool.acquire() as conn:
        await conn.execute(
            "CREATE TABLE gc_probe (k text NOT NULL, tx xid8 NOT NULL DEFAULT pg_current_xact_id())"
        )
    return pool


def inserting(key: str, fail: bool = False):  # type: ignore[no-untyped-def]
    async def unit(conn: asyncpg.Connection) -> str:
        await conn.execute("INSERT INTO gc_probe (k) VALUES ($1)", key)
        if fail:
            raise ValueError(f"unit {key} refuses")
        return key.upper()

    return unit


async def rows(pool: asyncpg.Pool) -> list[tuple[str, int]]:
    async with pool.acquire() as conn:
        return [
            (r["k"], r["n"])
            for r in await conn.fetch("SELECT k, count(*) AS n FROM gc_probe GROUP BY k ORDER BY k")
        ]


async def test_units_that_arrive_together_commit_in_one_transaction(probe: asyncpg.Pool) -> None:
    group = GroupCommit(probe, max_batch=8, concurrency=1)
    keys = [f"k{i}" for i in range(8)]
    results = await asyncio.gather(*(group.run(k, inserting(k)) for k in keys))
    assert results == [k.upper() for k in keys]
    async with probe.acquire() as conn:
        transactions = await conn.fetchval("SELECT count(DISTINCT tx) FROM gc_probe")
    assert transactions == 1 and (group.batches, group.units) == (1, 8)
    assert await rows(probe) == [(k, 1) for k in keys]


async def test_a_batch_never_exceeds_max_batch(probe: asyncpg.Pool) -> None:
    group = GroupCommit(probe, max_batch=3, concurrency=1)
    keys = [f"k{i:02d}" for i in range(10)]
    await asyncio.gather(*(group.run(k, inserting(k)) for k in keys))
    async with probe.acquire() as conn:
        sizes = [r["n"] for r in await conn.fetch("SELECT count(*) AS n FROM gc_probe GROUP BY tx")]
    assert sorted(sizes) == [1, 3, 3, 3] and group.units == 10


async def test_a_failing_unit_fails_only_itself_and_the_others_are_stored_once(probe: asyncpg.Pool) -> None:
    group = GroupCommit(probe, max_batch=8, concurrency=1)
    keys = [f"k{i}" for i in range(5)]
    outcomes = await asyncio.gather(
        *(group.run(k, inserting(k, fail=k == "k2")) for k in keys), return_exceptions=True
    )
    assert [o if isinstance(o, str) else type(o).__name__ for o in outcomes] == [
        "K0",
        "K1",
        "ValueError",
        "K3",
        "K4",
    ]
    assert await rows(probe) == [("k0", 1), ("k1", 1), ("k3", 1), ("k4", 1)], "nothing of k2, nothing twice"


async def test_a_batch_runs_its_units_in_key_order_and_one_key_in_arrival_order(probe: asyncpg.Pool) -> None:
    group = GroupCommit(probe, max_batch=16, concurrency=1)
    ran: list[str] = []

    def recording(key: str, tag: str):  # type: ignore[no-untyped-def]
        async def unit(conn: asyncpg.Connection) -> None:
            await conn.execute("SELECT 1")
            ran.append(f"{key}/{tag}")

        return unit

    calls = [("c", "1"), ("a", "1"), ("b", "1"), ("a", "2"), ("c", "2"), ("a", "3")]
    await asyncio.gather(*(group.run(k, recording(k, t)) for k, t in calls))
    assert ran == ["a/1", "a/2", "a/3", "b/1", "c/1", "c/2"]


async def test_concurrent_agent_reports_share_transactions_and_are_each_accepted_once(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """Eight nodes report at once: every report is accepted and stored once, in fewer
    transactions than reports; the same reports again are recognized as duplicates."""
    services = build_services(pool, ServerConfig(state_dir=tmp_path / "state", collector_timeout=5.0))
    plane = services.agent_plane
    token = await plane.create_token(3600, 8)
    principals = []
    for i in range(8):
        enrolled = await plane.enroll(
            token.token,
            EnrollRequest(identity_key=f"gc-agent-{i}", identity_source="configured", hostname=f"h{i}"),
        )
        principals.append(await plane.authenticate(enrolled.credential))
    bodies = [report_body(f"gc-agent-{i}", 1, mem_avail=i) for i in range(8)]
    before = (plane.reports.batches, plane.reports.units)
    acks = await asyncio.gather(
        *(plane.accept_report(p, b, None) for p, b in zip(principals, bodies, strict=True))
    )
    assert [a.status for a in acks] == ["accepted"] * 8
    batches, units = plane.reports.batches - before[0], plane.reports.units - before[1]
    assert units == 8 and batches < 8, (batches, units)
    async with pool.acquire() as conn:
        stored = await conn.fetch(
            "SELECT stream_id, count(*) AS n FROM events WHERE event_type = 'NODE_TELEMETRY_OBSERVED' "
            "AND metadata->>'agent_sequence' = '1' GROUP BY stream_id"
        )
        sharing = await conn.fetchval(
            "SELECT max(n) FROM (SELECT count(DISTINCT stream_id) AS n FROM events "
            "WHERE event_type = 'NODE_TELEMETRY_OBSERVED' GROUP BY tx_id) t"
        )
    assert sorted(r["n"] for r in stored) == [1] * 8 and sharing > 1
    again = await asyncio.gather(
        *(plane.accept_report(p, b, None) for p, b in zip(principals, bodies, strict=True))
    )
    assert [a.status for a in again] == ["duplicate"] * 8
