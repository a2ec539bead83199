"""Ledger benchmark: append, peer and rebuild throughput on one PostgreSQL, in one run.

    python -m bench.ledger                 # default size (40,000 timed events per system)
    python -m bench.ledger --quick         # under 2 minutes: 10,000 events per system, 2 rounds
    python -m bench.ledger --events 300000 --rounds 3

Every run creates its own throwaway databases (`mf_bench_<random>_*`) on the server named by
MODELFORGE_BENCH_DATABASE_URL (default postgresql://postgres@127.0.0.1:5432/test) and drops them
at the end. Nothing is timed against an absolute threshold: each figure is compared with a
baseline measured in the same run, on the same server.

(a) append: agent-style reports of 2 events per transaction (1 NODE_TELEMETRY_OBSERVED with the
    host's and 8 GPUs' telemetry, 1 lifecycle INVENTORY_STATUS_CHANGED: a node whose NVML scan
    flaps between complete and incomplete), from 8 asyncio tasks over a 4-connection pool, through
    `EventStore(pool, ALL_PROJECTIONS).append` with the inline inventory projection. Each task owns
    `--nodes`/8 nodes (default 256 nodes in all), each first discovered through the product's
    `reconcile` + `append` (untimed), so the projection folds onto real state. The ceiling: the
    same rows (same columns, same jsonb bytes, 2 rows per transaction, 8 tasks, 4 connections)
    through a bare asyncpg `executemany` INSERT into a table made `LIKE events INCLUDING ALL`.
(b) peer: the same reports through the `eventsourcing` library's PostgreSQL persistence
    (psycopg 3, synchronous), 8 threads over a pool of 4: its `PostgresApplicationRecorder`
    (10 stored events per `insert_events`, the same JSON bytes as `state`) and its `Application`
    API (an aggregate per node, 2 events per `save`).
(c) rebuild: `projections.rebuild.rebuild` over the log left by (a), against a bare keyset scan of
    the same rows with the same SELECT, decoding data/metadata with the catalog's msgspec
    decoders.

(d) statements: the SQL statements, round trips and transactions of one append, counted on the
    wire (bench/harness.py's StatementCounter).

The process runs with the server's garbage-collector settings (`runtime.process`), applied once
the workload is built. Systems run interleaved in `--rounds` slices of the workload, so drift on a noisy machine hits
all of them alike. Targets: append >= 0.5 of the ceiling and >= 2x the peer; rebuild
>= 0.5 of the bare scan.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import msgspec

from bench import harness as h
from bench.fleet import node_key
from bench.ledger_peer import PeerApplication, PeerRecorder, run_threads
from bench.ledger_workload import (
    EVENTS_PER_REPORT,
    POOL,
    TASKS,
    Node,
    Report,
    build_reports,
    discovery_events,
    slices,
)
from bench.statements import StatementCounter, Statements
from domain.node import node_id_for
from ledger.db import create_pool
from ledger.events import SCHEMA_VERSION
from ledger.reading import EVENT_COLUMNS, event_from_row
from ledger.schema import migrate
from ledger.store import EventStore
from projections.inventory import ALL_PROJECTIONS
from projections.rebuild import rebuild
from runtime.process import settle_garbage_collector

# The SELECT of projections/rebuild.py's bulk phase, verbatim.
SCAN_SQL = (
    "SELECT " + EVENT_COLUMNS + " FROM events WHERE (stream_id, stream_version) > ($1, $2) "
    "ORDER BY stream_id, stream_version LIMIT $3"
)
SCAN_BATCH = 5000

CEILING_TABLE = "bench_ceiling_events"
# The columns mf_append fills; `received_at` (metadata.received_at) where the schema has it.
CEILING_COLUMNS = (
    "event_id",
    "stream_id",
    "stream_version",
    "event_type",
    "event_class",
    "schema_version",
    "data",
    "metadata",
)


def ceiling_sql(with_received_at: bool) -> str:
    cols = CEILING_COLUMNS + (("received_at",) if with_received_at else ())
    params = ", ".join(f"${i}" for i in range(1, len(cols) + 1))
    return f"INSERT INTO {CEILING_TABLE} ({', '.join(cols)}) VALUES ({params})"


# --- the systems ----------------------------------------------------------------------------------


def count(parts: list[list[Report]]) -> tuple[int, int]:
    return sum(len(t) for t in parts), sum(len(r.events) for t in parts for r in t)


async def timed(
    meter: h.Meter, s: h.Sample, parts: list[list[Report]], worker: Callable[[list[Report]], Awaitable[None]]
) -> None:
    async def work() -> None:
        await asyncio.gather(*(worker(task) for task in parts))

    _, usage = await meter.measure(work())
    reports, events = count(parts)
    s.merge(h.Sample(s.name, ops=reports, units=events), usage)


async def timed_threads(
    meter: h.Meter, s: h.Sample, parts: list[list[Report]], worker: Callable[[list[Report]], None]
) -> None:
    _, usage = await meter.measure(asyncio.to_thread(run_threads, parts, worker))
    reports, events = count(parts)
    s.merge(h.Sample(s.name, ops=reports, units=events), usage)


class LedgerSystem:
    def __init__(self, store: EventStore, nodes: list[Node]) -> None:
        self.store = store
        self.version = {n.node_id: n.discovered_version for n in nodes}

    async def worker(self, reports: list[Report]) -> None:
        for r in reports:
            result = await self.store.append(r.node_id, self.version[r.node_id], r.events)
            self.version[r.node_id] = result.stream_version


class CeilingSystem:
    def __init__(self, pool: asyncpg.Pool, nodes: list[Node], *, with_received_at: bool) -> None:
        self.pool = pool
        self.version = {n.node_id: n.discovered_version for n in nodes}
        self.sql = ceiling_sql(with_received_at)
        self.with_received_at = with_received_at

    async def worker(self, reports: list[Report]) -> None:
        encode = msgspec.json.encode
        for r in reports:
            v = self.version[r.node_id]
            rows = []
            for e in r.events:
                v += 1
                row: tuple[Any, ...] = (
                    e.event_id,
                    r.node_id,
                    v,
                    e.event_type,
                    e.event_class,
                    SCHEMA_VERSION,
                    msgspec.Raw(encode(e.payload)),
                    msgspec.Raw(encode(e.metadata)),
                )
                rows.append((*row, e.metadata.received_at) if self.with_received_at else row)
            async with self.pool.acquire() as conn, conn.transaction():
                await conn.executemany(self.sql, rows)
            self.version[r.node_id] = v


async def bare_scan(pool: asyncpg.Pool) -> int:
    """The rebuild's SELECT over the whole log and the catalog's decoders, no fold."""
    n = 0
    async with pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
        last: tuple[str, int] = ("", 0)
        while rows := await conn.fetch(SCAN_SQL, last[0], last[1], SCAN_BATCH):
            for row in rows:
                event_from_row(row)
            n += len(rows)
            last = (rows[-1]["stream_id"], rows[-1]["stream_version"])
    return n


async def count_statements(dsn: str, nodes: list[Node]) -> tuple[Statements, Statements]:
    """Statements of one append, counted on the wire (its own pool through the counting proxy):
    onto a state the store does not hold yet (its first append to the stream), and onto the
    state it kept from its previous append (every later one)."""
    async with StatementCounter(dsn) as counter:
        pool = await create_pool(counter.dsn, min_size=1, max_size=POOL)
        try:
            async with pool.acquire() as conn:
                rows = await conn.fetch("SELECT stream_id, version FROM streams")
            system = LedgerSystem(EventStore(pool, ALL_PROJECTIONS), nodes)
            system.version.update({r["stream_id"]: r["version"] for r in rows})
            rng = random.Random(5)
            await system.worker(build_reports(nodes, 1, rng, datetime.now(UTC))[0])  # prepared statements
            out = []
            # Each task's reports are of distinct nodes: the first pass opens them, the second keeps.
            for _pass in range(2):
                reports = build_reports(nodes, 5, rng, datetime.now(UTC))
                before = counter.counts.copy()
                for task in reports:
                    await system.worker(task[1:])
                d = counter.counts - before
                n = sum(len(task[1:]) for task in reports)
                out.append(
                    Statements(round(d.executions / n), round(d.round_trips / n), round(d.transactions / n))
                )
            return out[0], out[1]
        finally:
            await pool.close()


# --- the run ----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__)
    p.add_argument("--events", type=int, default=40_000, help="timed events per system (default 40,000)")
    p.add_argument(
        "--nodes", type=int, default=256, help="node streams, split over the 8 tasks (default 256)"
    )
    p.add_argument("--rounds", type=int, default=4, help="interleaved slices per system (default 4)")
    p.add_argument("--rebuilds", type=int, default=2, help="rebuild/scan repetitions, best kept (default 2)")
    p.add_argument(
        "--peer", choices=("both", "recorder", "application", "none"), default="both",
        help="which eventsourcing API(s) to measure (default both; `pip install -e '.[bench]'`)",
    )  # fmt: skip
    p.add_argument("--breakdown", action="store_true", help="also EventStore.append without projections")
    args = h.parse_sized(p, argv, {"events": 10_000, "nodes": 64, "rounds": 2, "rebuilds": 1})
    args.nodes = max(TASKS, args.nodes - args.nodes % TASKS)
    return args


async def run(args: argparse.Namespace) -> int:
    report = h.Report("ledger")
    await h.describe_environment(report, "ledger")
    per_task = max(1, args.events // EVENTS_PER_REPORT // TASKS)
    print(
        f"workload: {per_task * TASKS * EVENTS_PER_REPORT:,} timed events per system = {per_task * TASKS:,} "
        f"reports x {EVENTS_PER_REPORT} events, {TASKS} writers, pool of {POOL}, {args.nodes} node streams, "
        f"{args.rounds} interleaved round(s)"
    )
    async with (
        h.throwaway_database("ledger", keep=args.keep) as db,
        h.throwaway_database("peer", keep=args.keep) as peer_db,
        h.throwaway_database("bare", keep=args.keep) as bare_db,
    ):
        pools: list[asyncpg.Pool] = []
        peers: list[Any] = []
        meter: h.Meter | None = None
        try:
            pool = await create_pool(db.dsn, min_size=POOL, max_size=POOL)
            pools.append(pool)
            async with pool.acquire() as conn:
                await migrate(conn)
                await conn.execute(f"CREATE TABLE {CEILING_TABLE} (LIKE events INCLUDING ALL)")
                with_received_at = bool(
                    await conn.fetchval(
                        "SELECT count(*) FROM information_schema.columns "
                        "WHERE table_name = 'events' AND column_name = 'received_at'"
                    )
                )
            store = EventStore(pool, ALL_PROJECTIONS)
            rng = random.Random(20261130)
            nodes = [Node(i, node_id_for(node_key(i)), 0) for i in range(args.nodes)]
            t0 = time.perf_counter()

            async def discover(task: int) -> None:
                for n in nodes[task::TASKS]:
                    n.discovered_version = (
                        await store.append(n.node_id, 0, discovery_events(n, rng))
                    ).stream_version

            await asyncio.gather(*(discover(t) for t in range(TASKS)))
            start = datetime.now(UTC)
            warm = build_reports(nodes, 4, rng, start)
            work = build_reports(nodes, per_task, rng, start + timedelta(seconds=1))
            print(
                f"setup: {len(nodes)} nodes discovered, reports generated in {time.perf_counter() - t0:.1f} s (untimed)"
            )

            # The process runs the ledger as `serve` does: what is set up now (the timed reports
            # above all) out of the collector's sight, its thresholds raised. With Python's
            # defaults the collector walks those reports again and again, charging the system
            # that allocates most (the ledger's folds and decodes) for the size of the workload.
            settle_garbage_collector()
            ledger = LedgerSystem(store, nodes)
            systems: list[tuple[h.Sample, Any, bool]] = [
                (h.Sample("ceiling: asyncpg executemany INSERT"), CeilingSystem(pool, nodes, with_received_at=with_received_at), False),
                (h.Sample("ledger: EventStore.append + inline projection"), ledger, False),
            ]  # fmt: skip
            if args.breakdown:
                bare_pool = await create_pool(bare_db.dsn, min_size=POOL, max_size=POOL)
                pools.append(bare_pool)
                async with bare_pool.acquire() as conn:
                    await migrate(conn)
                bare = LedgerSystem(EventStore(bare_pool, ()), nodes)
                for n in nodes:
                    await bare.store.append(n.node_id, 0, discovery_events(n, random.Random(n.index)))
                async with bare_pool.acquire() as conn:
                    await conn.execute("ANALYZE")
                systems.append((h.Sample("  of which mf_append alone (no projections)"), bare, False))
            if args.peer in ("both", "recorder"):
                peers.append(PeerRecorder(peer_db.dsn, nodes))
                systems.append((h.Sample("peer: eventsourcing ApplicationRecorder"), peers[-1], True))
            if args.peer in ("both", "application"):
                peers.append(PeerApplication(peer_db.dsn, nodes))
                systems.append((h.Sample("peer: eventsourcing Application.save"), peers[-1], True))
            # Statistics as autovacuum would have them: statements planned on empty tables keep a
            # generic plan that scans (docs/performance.md).
            async with pool.acquire() as conn:
                await conn.execute("ANALYZE")

            meter = await h.Meter.open([db.name, peer_db.name, bare_db.name])
            for _, system, threaded in systems:  # warm-up: prepared statements, pools, caches
                await (timed_threads if threaded else timed)(meter, h.Sample("warm-up"), warm, system.worker)
            for part in slices(work, args.rounds):
                for s, system, threaded in systems:
                    await (timed_threads if threaded else timed)(meter, s, part, system.worker)

            async with pool.acquire() as conn:
                log_events = await conn.fetchval("SELECT count(*) FROM events")
                await conn.execute("VACUUM ANALYZE events")
            scan, rebuilt = (
                h.Sample("bare keyset scan + msgspec decode"),
                h.Sample("rebuild (all projections)"),
            )
            for _ in range(max(1, args.rebuilds)):
                n, usage = await meter.measure(bare_scan(pool))
                if not scan.ops or usage.seconds < scan.usage.seconds:
                    scan = h.Sample(scan.name, ops=n, units=n, usage=usage)
                result, usage = await meter.measure(rebuild(pool, ALL_PROJECTIONS))
                if not rebuilt.ops or usage.seconds < rebuilt.usage.seconds:
                    rebuilt = h.Sample(rebuilt.name, ops=result.events, units=result.events, usage=usage)
            opening, kept = await count_statements(db.dsn, nodes)
            transactions, appends = store.appends_committed

            rows = [s for s, *_ in systems] + [scan, rebuilt]
            h.table(
                ["system", "events/s", "client us", "PG us", "WAL B"],
                [[s.name, s.unit_rate, 1e6 * s.usage.client_cpu / max(1, s.units),
                  None if s.usage.db_cpu is None else 1e6 * s.usage.db_cpu / max(1, s.units),
                  s.usage.wal_bytes / max(1, s.units) if s not in (scan, rebuilt) else None] for s in rows],
                first_width=48,
            )  # fmt: skip
            print(
                f"  (per event; rebuild and scan: best of {args.rebuilds} over the {log_events:,} events (a) left)"
            )
            for s in rows:
                report.row(**s.as_row())
            for label, statements in (("opening the stream", opening), ("on the kept state", kept)):
                report.row(name=f"statements per append {label}", **vars(statements))
                report.note(
                    f"one append of {EVENTS_PER_REPORT} events {label}: {statements.executions} statements "
                    f"executed in {statements.round_trips} round trips, {statements.transactions} "
                    "transaction(s) (counted on the wire)"
                )
            report.note(
                f"ledger appends (warm-up and timed): {appends:,} in {transactions:,} transactions "
                f"(group commit: {appends / max(1, transactions):.1f} appends per transaction); folded states "
                f"kept by the store and used: {store.states.hits:,}, sent by PostgreSQL: {store.states.misses:,}; "
                f"appends in one round trip on kept states: {store.states.kept_appends:,} transactions "
                f"({store.states.stale:,} found another checkpoint and opened their streams)"
            )
            ceiling_s, ledger_s = systems[0][0], systems[1][0]

            def ratio(label: str, a: h.Sample, b: h.Sample, target: float) -> None:
                report.ratio(h.Ratio(label, a.unit_rate / b.unit_rate, target, h.cost_ratio(a, b)))

            ratio("append / ceiling (events/s)", ledger_s, ceiling_s, 0.5)
            for s, _, threaded in systems:
                if threaded:
                    ratio(f"append / {s.name.split(': ', 1)[1]}", ledger_s, s, 2.0)
            ratio("rebuild / bare scan (events/s)", rebuilt, scan, 0.5)
            report.finish(args.json)
            return 0
        finally:
            for peer in peers:
                peer.close()
            if meter is not None:
                await meter.close()
            for p in pools:
                await p.close()


def main(argv: Sequence[str] | None = None) -> int:
    return h.main(run, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
