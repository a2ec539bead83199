"""The storage of the rows every agent report rewrites (schema.sql, "Storage of the rows every
agent report rewrites"; docs/performance.md): their pages keep room for the
rows' next versions, so a report updates them in place (HOT updates: no index entry, no row moved),
and a node's folded state stays in its row instead of two TOAST chunks rewritten per report. What
an operator would notice without it: more WAL per report and read-model tables and indexes that
grow with every report until they are vacuumed."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime, timedelta

import asyncpg

from bench.fleet import node_key
from bench.ledger_workload import Node, discovery_events, report_events
from domain.node import node_id_for
from ledger.db import create_pool
from ledger.store import EventStore
from projections.inventory import ALL_PROJECTIONS
from projections.rebuild import rebuild

REWRITTEN = (
    "projection_state",
    "hw_accelerator_telemetry",
    "hw_host_telemetry",
    "hw_node_storage",
    "hw_inventory_runs",
    "hw_nodes",
    "agent_stream_positions",
)
EXPECTED = {t: ["fillfactor=50"] for t in REWRITTEN} | {
    "projection_state": ["fillfactor=50", "toast_tuple_target=8160"]
}
NODES = 4
REPORTS = 15


async def _settings(conn: asyncpg.Connection) -> dict[str, list[str] | None]:
    rows = await conn.fetch(
        "SELECT relname, reloptions FROM pg_class WHERE relname = ANY($1::text[]) AND relkind = 'r'",
        list(REWRITTEN),
    )
    return {r["relname"]: r["reloptions"] for r in rows}


async def _report(store: EventStore, nodes: list[Node], rounds: int) -> None:
    rng = random.Random(20261201)
    for n in nodes:
        n.discovered_version = (await store.append(n.node_id, 0, discovery_events(n, rng))).stream_version
    version = {n.node_id: n.discovered_version for n in nodes}
    at = datetime.now(UTC)
    for _ in range(rounds):
        for n in nodes:
            at += timedelta(seconds=1)
            result = await store.append(n.node_id, version[n.node_id], report_events(n, rng, at))
            version[n.node_id] = result.stream_version


async def test_the_rewritten_tables_keep_room_on_their_pages_and_a_rebuild_keeps_it(
    pool: asyncpg.Pool,
) -> None:
    store = EventStore(pool, ALL_PROJECTIONS)
    await _report(store, [Node(i, node_id_for(node_key(i)), 0) for i in range(2)], 2)
    async with pool.acquire() as conn:
        assert await _settings(conn) == EXPECTED
    await rebuild(pool, ALL_PROJECTIONS)
    async with pool.acquire() as conn:
        # The swap put new tables in place of the old ones: they carry the settings too.
        assert await _settings(conn) == EXPECTED


async def test_reports_update_telemetry_in_place_and_the_state_in_its_row(database_dsn: str) -> None:
    pool = await create_pool(database_dsn, min_size=1, max_size=1)
    try:
        store = EventStore(pool, ALL_PROJECTIONS)
        await _report(store, [Node(i, node_id_for(node_key(i)), 0) for i in range(NODES)], REPORTS)
    finally:
        await pool.close()
    conn = await asyncpg.connect(database_dsn)
    try:
        # The writing backend flushes its table statistics as it exits, which can be just after
        # the pool's close returns: wait for all of them.
        expected = NODES * REPORTS
        updated = hot = 0
        for _ in range(100):
            await conn.execute("SELECT pg_stat_clear_snapshot()")
            row = await conn.fetchrow(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'hw_host_telemetry'"
            )
            assert row is not None
            updated, hot = row["n_tup_upd"], row["n_tup_hot_upd"]
            if updated >= expected:
                break
            await asyncio.sleep(0.1)
        assert updated >= expected, f"{updated} host telemetry updates counted, {expected} made"
        # With the default fillfactor (100) about half of these updates move their row to another
        # page, each with a new index entry and a lock record; with room left on the page, all of
        # them stay when the cluster is otherwise idle. A transaction holding an xid anywhere in the
        # cluster (another database's too) holds back this backend's snapshot xmin, so the page
        # cannot be pruned while it runs and a few updates move: 3 in 4 staying still tells the
        # two settings apart.
        assert hot * 4 >= updated * 3, f"{updated - hot} of {updated} telemetry updates moved their row"
        # Every GPU is in its node's latest snapshot: no GPU has a telemetry row to rewrite.
        gpu_rows = await conn.fetchval(
            "SELECT n_tup_ins + n_tup_upd FROM pg_stat_user_tables WHERE relname = 'hw_accelerator_telemetry'"
        )
        assert gpu_rows == 0, f"{gpu_rows} GPU telemetry rows written"
        toast = await conn.fetchval(
            "SELECT pg_relation_size(reltoastrelid) FROM pg_class WHERE oid = 'projection_state'::regclass"
        )
        assert toast == 0, f"the folded states took {toast} bytes of TOAST pages"
    finally:
        await conn.close()
