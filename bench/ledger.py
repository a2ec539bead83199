"""Ledger benchmark (issue 2): append, peer and rebuild throughput on one PostgreSQL, in one run.

    python -m bench.ledger                 # default size (40,000 timed events per system)
    python -m bench.ledger --quick         # a smoke run (~20 s)
    python -m bench.ledger --events 300000 --rounds 3

Every run creates its own throwaway databases (`mf_bench_<random>_*`) on the server named by
MODELFORGE_BENCH_DATABASE_URL (default postgresql://postgres@127.0.0.1:5432/test) and drops them
at the end. Nothing is timed against an absolute threshold: each figure is compared with a
baseline measured in the same run, on the same server.

(a) append: agent-style reports of 10 events per transaction (1 HOST_TELEMETRY_OBSERVED,
    8 ACCELERATOR_TELEMETRY_OBSERVED, 1 lifecycle INVENTORY_STATUS_CHANGED: a node whose NVML scan
    flaps between complete and incomplete), from 8 asyncio tasks over a 4-connection pool, through
    `EventStore(pool, ALL_PROJECTIONS).append` with the inline inventory projection. Each task owns
    `--nodes`/8 nodes (default 256 nodes in all), each first discovered through the product's
    `reconcile` + `append` (untimed), so the projection folds onto real state. The ceiling: the
    same rows (same columns, same jsonb bytes, 10 rows per transaction, 8 tasks, 4 connections)
    through a bare asyncpg `executemany` INSERT into a table made `LIKE events INCLUDING ALL`.
(b) peer: the same reports through the `eventsourcing` library's PostgreSQL persistence
    (psycopg 3, synchronous), 8 threads over a pool of 4: its `PostgresApplicationRecorder`
    (10 stored events per `insert_events`, the same JSON bytes as `state`) and its `Application`
    API (an aggregate per node, 10 events per `save`).
(c) rebuild: `projections.rebuild.rebuild` over the log left by (a), against a bare keyset scan of
    the same rows with the same SELECT, decoding data/metadata with the catalog's msgspec
    decoders.

Systems run interleaved in `--rounds` slices of the workload, so drift on a noisy machine hits
all of them alike.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # `python bench/ledger.py`: this file would shadow the `ledger` package; use the repo root.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import asyncio
import cProfile
import io
import pstats
import random
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import unquote, urlsplit

import asyncpg
import msgspec

from bench._common import (
    bench_database_name,
    cpu_of,
    create_database,
    drop_database,
    machine_description,
    model_of,
    node_key,
    node_observation,
    server_description,
    server_dsn,
    verdict,
)
from collectors.identity import NodeIdentity
from ledger.db import create_pool, migrate
from ledger.events import (
    SCHEMA_VERSION,
    AcceleratorTelemetryObserved,
    EventMetadata,
    EventPayload,
    HostTelemetryObserved,
    InventoryStatusChanged,
    NewEvent,
    decode_metadata,
    decode_payload,
)
from ledger.node import NodeState, accelerator_id_for, node_id_for
from ledger.reconcile import reconcile
from ledger.store import EventStore
from projections.inventory import ALL_PROJECTIONS
from projections.rebuild import rebuild

TASKS = 8
POOL = 4
EVENTS_PER_REPORT = 10

# The SELECT of projections/rebuild.py's bulk phase, verbatim.
SCAN_SQL = (
    "SELECT global_position, stream_id, stream_version, event_id, event_type, "
    "event_class, schema_version, data::text AS data_json, metadata::text AS metadata_json, "
    "recorded_at FROM events WHERE (stream_id, stream_version) > ($1, $2) "
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


# --- the workload ---------------------------------------------------------------------------------


@dataclass
class Node:
    index: int
    node_id: str
    discovered_version: int
    degraded: bool = False
    sequence: int = 0


@dataclass
class Report:
    node_id: str
    events: list[NewEvent]


@dataclass
class Workload:
    nodes: list[Node]
    # reports[task] = that task's reports, in order; a task only ever writes its own nodes.
    reports: list[list[Report]] = field(default_factory=list)

    @property
    def events(self) -> int:
        return sum(len(r.events) for rs in self.reports for r in rs)


LOST_GPU_REASON = "NVML scan incomplete: nvmlDeviceGetHandleByIndex(5): GPU is lost; last good GPU state kept"


def discovery_events(node: Node, rng: random.Random) -> list[NewEvent]:
    obs = node_observation(node.index, rng)
    payloads = reconcile(
        obs, NodeState(node_id=node.node_id), NodeIdentity(node_key(node.index), "configured")
    )
    meta = EventMetadata(received_at=datetime.now(UTC), source="agent", observed_at=datetime.now(UTC))
    return [NewEvent(payload=p, metadata=meta) for p in payloads]


def report_events(node: Node, rng: random.Random, received_at: datetime) -> list[NewEvent]:
    """One agent report of an eight-GPU node: telemetry plus the flapping inventory status."""
    obs = node_observation(node.index, rng)
    node.sequence += 1
    node.degraded = not node.degraded
    meta = EventMetadata(
        received_at=received_at,
        source="agent",
        observed_at=received_at - timedelta(milliseconds=rng.randint(5, 400)),
        agent_stream=f"agent-{node.node_id}",
        agent_sequence=node.sequence,
    )
    payloads: list[EventPayload] = [
        HostTelemetryObserved(telemetry=dict(obs.host.telemetry), storage=list(obs.host.storage))
    ]
    payloads.extend(
        AcceleratorTelemetryObserved(
            accelerator_id=accelerator_id_for(node.node_id, gpu.uuid), uuid=gpu.uuid, telemetry=gpu.telemetry
        )
        for gpu in obs.nvml.accelerators
    )
    if node.degraded:
        payloads.append(
            InventoryStatusChanged(
                status="degraded",
                reasons=[LOST_GPU_REASON],
                nvml_status="incomplete",
                accelerator_capability="present",
            )
        )
    else:
        payloads.append(
            InventoryStatusChanged(
                status="ok", reasons=[], nvml_status="complete", accelerator_capability="present"
            )
        )
    assert len(payloads) == EVENTS_PER_REPORT, model_of(node.index).name
    return [NewEvent(payload=p, metadata=meta) for p in payloads]


def build_reports(
    nodes: list[Node], per_task: int, rng: random.Random, start: datetime
) -> list[list[Report]]:
    owned = [[n for n in nodes if n.index % TASKS == t] for t in range(TASKS)]
    out: list[list[Report]] = []
    at = start
    for t in range(TASKS):
        reports = []
        for k in range(per_task):
            node = owned[t][k % len(owned[t])]
            at += timedelta(microseconds=997)
            reports.append(Report(node.node_id, report_events(node, rng, at)))
        out.append(reports)
    return out


def slices(reports: list[list[Report]], rounds: int) -> list[list[list[Report]]]:
    """Split every task's reports into `rounds` consecutive slices."""
    out = []
    for r in range(rounds):
        part = []
        for task in reports:
            n = len(task)
            part.append(task[r * n // rounds : (r + 1) * n // rounds])
        out.append(part)
    return out


# --- timing helpers --------------------------------------------------------------------------------


class ServerMeter:
    """CPU of the PostgreSQL backends serving the bench's databases (from /proc, when the server
    runs on this machine) and WAL written (server-wide: other clients of the server count too).
    It has a connection of its own, so no measured backend is left out."""

    def __init__(self, conn: asyncpg.Connection, databases: Sequence[str]) -> None:
        self.conn = conn
        self.databases = list(databases)

    @classmethod
    async def open(cls, server: str, databases: Sequence[str]) -> ServerMeter:
        return cls(await asyncpg.connect(server), databases)

    async def close(self) -> None:
        await self.conn.close()

    async def snapshot(self) -> tuple[float | None, int]:
        rows = await self.conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = ANY($1) AND pid <> pg_backend_pid()",
            self.databases,
        )
        lsn = await self.conn.fetchval("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint")
        return cpu_of([r["pid"] for r in rows]), int(lsn)


@dataclass
class Measurement:
    name: str
    events: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU (all threads): the Python client's share
    server_cpu_seconds: float | None = 0.0  # the PostgreSQL backends' CPU
    wal_bytes: int = 0

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0

    def add(self, events: int, seconds: float, cpu: float) -> None:
        self.events += events
        self.seconds += seconds
        self.cpu_seconds += cpu

    @property
    def cpu_per_event(self) -> float | None:
        """Client + server CPU seconds per event: what the work costs, whatever else ran."""
        if self.server_cpu_seconds is None or not self.events:
            return None
        return (self.cpu_seconds + self.server_cpu_seconds) / self.events

    def add_server(self, before: tuple[float | None, int], after: tuple[float | None, int]) -> None:
        if before[0] is None or after[0] is None or self.server_cpu_seconds is None:
            self.server_cpu_seconds = None
        else:
            # Backends that exited in between make this an underestimate, never an overestimate.
            self.server_cpu_seconds += max(0.0, after[0] - before[0])
        self.wal_bytes += after[1] - before[1]

    def line(self) -> str:
        n = max(1, self.events)
        server = "n/a" if self.server_cpu_seconds is None else f"{1e6 * self.server_cpu_seconds / n:.0f}"
        return (
            f"  {self.name:<46} {self.rate:>8,.0f} events/s  ({self.events:,} in {self.seconds:.2f} s; "
            f"us/event: client CPU {1e6 * self.cpu_seconds / n:.0f}, server CPU {server}; "
            f"WAL {self.wal_bytes / n:,.0f} B/event)"
        )


class Profiler:
    def __init__(self, enabled: bool) -> None:
        self.profile = cProfile.Profile() if enabled else None

    def __enter__(self) -> Profiler:
        if self.profile:
            self.profile.enable()
        return self

    def __exit__(self, *_: object) -> None:
        if self.profile:
            self.profile.disable()

    def report(self, title: str, lines: int = 30) -> None:
        if not self.profile:
            return
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(self.profile, stream=buf).sort_stats(key).print_stats(lines)
            print(f"\n--- cProfile of {title}, by {key} ---")
            print(buf.getvalue())


def count(parts: list[list[Report]]) -> int:
    return sum(len(r.events) for task in parts for r in task)


async def timed(
    meter: ServerMeter | None,
    m: Measurement,
    parts: list[list[Report]],
    worker: Callable[[list[Report]], Awaitable[None]],
) -> None:
    before = await meter.snapshot() if meter else None
    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker(task) for task in parts))
    m.add(count(parts), time.perf_counter() - t0, time.process_time() - c0)
    if meter and before:
        m.add_server(before, await meter.snapshot())


async def timed_threads(
    meter: ServerMeter, m: Measurement, parts: list[list[Report]], worker: Callable[[list[Report]], None]
) -> None:
    before = await meter.snapshot()
    m.add(count(parts), *_run_threads(parts, worker))
    m.add_server(before, await meter.snapshot())


# --- (a) the ledger and the ceiling ---------------------------------------------------------------


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


# --- diagnostics: where the ledger's statements spend their time --------------------------------------


class StatementStats:
    def __init__(self) -> None:
        self.by_sql: dict[str, list[float]] = {}  # label -> [calls, wall s, server CPU s]

    def record(self, sql: str, wall: float, cpu: float | None) -> None:
        label = " ".join(sql.split())
        label = label if len(label) <= 90 else label[:87] + "..."
        entry = self.by_sql.setdefault(label, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += wall
        entry[2] += cpu or 0.0

    def print(self, reports: int) -> None:
        total_cpu = sum(e[2] for e in self.by_sql.values()) or 1.0
        print(
            f"\n  {'statement':<90} {'calls/rep':>9} {'wall us/rep':>11} {'srv CPU us/rep':>14} {'share':>6}"
        )
        for label, (calls, wall, cpu) in sorted(self.by_sql.items(), key=lambda kv: -kv[1][2]):
            print(
                f"  {label:<90} {calls / reports:>9.2f} {1e6 * wall / reports:>11.0f} "
                f"{1e6 * cpu / reports:>14.0f} {100 * cpu / total_cpu:>5.1f}%"
            )


STATEMENTS = StatementStats()


def _backend_cpu(pid: int) -> float | None:
    return cpu_of([pid])


class TimedConnection(asyncpg.Connection):  # type: ignore[misc]
    """An asyncpg connection that charges each statement its wall time and its backend's CPU
    (/proc, sampled in clock ticks: unbiased over many statements, coarse for one)."""

    async def _timed(self, sql: str, call: Callable[[], Awaitable[Any]]) -> Any:
        pid = self.get_server_pid()
        c0, t0 = _backend_cpu(pid), time.perf_counter()
        try:
            return await call()
        finally:
            c1 = _backend_cpu(pid)
            STATEMENTS.record(sql, time.perf_counter() - t0, None if c0 is None or c1 is None else c1 - c0)

    async def execute(self, query: str, *args: Any, **kw: Any) -> Any:
        return await self._timed(query, lambda: super(TimedConnection, self).execute(query, *args, **kw))

    async def executemany(self, command: str, args: Any, **kw: Any) -> Any:
        return await self._timed(
            command, lambda: super(TimedConnection, self).executemany(command, args, **kw)
        )

    async def fetch(self, query: str, *args: Any, **kw: Any) -> Any:
        return await self._timed(query, lambda: super(TimedConnection, self).fetch(query, *args, **kw))

    async def fetchval(self, query: str, *args: Any, **kw: Any) -> Any:
        return await self._timed(query, lambda: super(TimedConnection, self).fetchval(query, *args, **kw))

    async def fetchrow(self, query: str, *args: Any, **kw: Any) -> Any:
        return await self._timed(query, lambda: super(TimedConnection, self).fetchrow(query, *args, **kw))


async def statement_profile(args: argparse.Namespace) -> int:
    """`--statements`: the ledger's appends alone, each SQL statement charged its time."""
    from ledger.db import init_connection

    server = server_dsn()
    name = bench_database_name("stmts")
    dsn = await create_database(server, name)
    try:
        # As ledger.db.create_pool makes it (no reset query on release), with timed connections.
        pool = await asyncpg.create_pool(
            dsn,
            min_size=POOL,
            max_size=POOL,
            init=init_connection,
            reset=_no_reset,
            connection_class=TimedConnection,
        )
        assert pool is not None
        try:
            async with pool.acquire() as conn:
                await migrate(conn)
            store = EventStore(pool, ALL_PROJECTIONS)
            rng = random.Random(7)
            nodes = [Node(i, node_id_for(node_key(i)), 0) for i in range(args.nodes)]
            for n in nodes:
                n.discovered_version = (
                    await store.append(n.node_id, 0, discovery_events(n, rng))
                ).stream_version
            async with pool.acquire() as conn:
                await conn.execute("ANALYZE")
            per_task = max(1, args.events // EVENTS_PER_REPORT // TASKS)
            work = build_reports(nodes, per_task, rng, datetime.now(UTC))
            ledger = LedgerSystem(store, nodes)
            STATEMENTS.by_sql.clear()
            m = Measurement("ledger: EventStore.append + inline projection (statements timed)")
            await timed(None, m, work, ledger.worker)
            print(m.line())
            STATEMENTS.print(per_task * TASKS)
        finally:
            await pool.close()
    finally:
        await drop_database(server, name)
    return 0


async def _no_reset(_conn: asyncpg.Connection) -> None:
    """ledger.db's pool releases connections without asyncpg's reset query; so does this one."""


def _time_rebuild_phases() -> dict[str, float]:
    """Wrap the rebuild module's phase functions with timers (diagnostic; product code unchanged)."""
    import projections.rebuild as rb

    totals: dict[str, float] = {}

    def wrap(name: str) -> None:
        fn = getattr(rb, name)

        async def timed_phase(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await fn(*a, **kw)
            finally:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - t0

        setattr(rb, name, timed_phase)

    for name in ("_create_shadows", "_bulk", "_catch_up", "compare", "_swap", "_drop_shadows"):
        if hasattr(rb, name):
            wrap(name)
    return totals


# --- (b) the peer: eventsourcing on PostgreSQL ------------------------------------------------------


def _pg_env(dsn: str) -> dict[str, str]:
    u = urlsplit(dsn)
    return {
        "POSTGRES_DBNAME": u.path.lstrip("/"),
        "POSTGRES_HOST": u.hostname or "127.0.0.1",
        "POSTGRES_PORT": str(u.port or 5432),
        "POSTGRES_USER": unquote(u.username or "postgres"),
        "POSTGRES_PASSWORD": unquote(u.password or ""),
    }


def _run_threads(parts: list[list[Report]], worker: Callable[[list[Report]], None]) -> tuple[float, float]:
    """Run one thread per task, started together; returns (wall seconds, process CPU seconds)."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(parts) + 1)

    def run(task: list[Report]) -> None:
        barrier.wait()
        try:
            worker(task)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(task,)) for task in parts]
    for t in threads:
        t.start()
    barrier.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if errors:
        raise errors[0]
    return wall, cpu


class PeerRecorder:
    """eventsourcing's PostgresApplicationRecorder: 10 StoredEvents per insert_events."""

    def __init__(self, dsn: str, nodes: list[Node]) -> None:
        from eventsourcing.postgres import PostgresApplicationRecorder, PostgresDatastore

        env = _pg_env(dsn)
        self.datastore = PostgresDatastore(
            dbname=env["POSTGRES_DBNAME"],
            host=env["POSTGRES_HOST"],
            port=env["POSTGRES_PORT"],
            user=env["POSTGRES_USER"],
            password=env["POSTGRES_PASSWORD"],
            pool_size=POOL,
            max_overflow=0,
        )
        self.recorder = PostgresApplicationRecorder(self.datastore, events_table_name="bench_stored_events")
        self.recorder.create_table()
        self.version = {n.node_id: 0 for n in nodes}
        self.ids = {n.node_id: uuid.UUID(n.node_id) for n in nodes}

    def worker(self, reports: list[Report]) -> None:
        from eventsourcing.persistence import StoredEvent

        encode = msgspec.json.encode
        for r in reports:
            v = self.version[r.node_id]
            oid = self.ids[r.node_id]
            stored = []
            for e in r.events:
                v += 1
                state = encode(
                    {"data": msgspec.Raw(encode(e.payload)), "metadata": msgspec.Raw(encode(e.metadata))}
                )
                stored.append(
                    StoredEvent(originator_id=oid, originator_version=v, topic=e.event_type, state=state)
                )
            self.recorder.insert_events(stored)
            self.version[r.node_id] = v

    def close(self) -> None:
        self.datastore.close()


class PeerApplication:
    """eventsourcing's Application API: an aggregate per node, 10 events per `save`."""

    def __init__(self, dsn: str, nodes: list[Node]) -> None:
        from eventsourcing.application import Application
        from eventsourcing.domain import Aggregate, event

        class NodeAggregate(Aggregate):
            @event("Reported")
            def report(self, event_type: str, data: dict[str, Any], metadata: dict[str, Any]) -> None:
                pass

        class Inventory(Application[uuid.UUID]):
            pass

        env = {
            "PERSISTENCE_MODULE": "eventsourcing.postgres",
            "POSTGRES_POOL_SIZE": str(POOL),
            "POSTGRES_MAX_OVERFLOW": "0",
            "CREATE_TABLE": "y",
            **_pg_env(dsn),
        }
        self.app = Inventory(env=env)
        self.aggregates: dict[str, Any] = {}
        for n in nodes:
            agg = NodeAggregate()
            self.app.save(agg)
            self.aggregates[n.node_id] = agg

    def worker(self, reports: list[Report]) -> None:
        to_builtins = msgspec.to_builtins
        for r in reports:
            agg = self.aggregates[r.node_id]
            for e in r.events:
                agg.report(e.event_type, to_builtins(e.payload), to_builtins(e.metadata))
            self.app.save(agg)

    def close(self) -> None:
        self.app.close()


# --- (c) rebuild and the bare scan ----------------------------------------------------------------


async def bare_scan(pool: asyncpg.Pool) -> tuple[int, float, float]:
    n = 0
    t0, c0 = time.perf_counter(), time.process_time()
    async with pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
        last: tuple[str, int] = ("", 0)
        while True:
            rows = await conn.fetch(SCAN_SQL, last[0], last[1], SCAN_BATCH)
            if not rows:
                break
            for row in rows:
                decode_payload(row["data_json"])
                decode_metadata(row["metadata_json"])
            n += len(rows)
            last = (rows[-1]["stream_id"], rows[-1]["stream_version"])
    return n, time.perf_counter() - t0, time.process_time() - c0


# --- the run ----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=40_000, help="timed events per system (default 40,000)")
    p.add_argument(
        "--nodes", type=int, default=256, help="node streams, split over the 8 tasks (default 256)"
    )
    p.add_argument("--rounds", type=int, default=4, help="interleaved slices per system (default 4)")
    p.add_argument("--rebuilds", type=int, default=2, help="rebuild/scan repetitions, best kept (default 2)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 10,000 events, 64 nodes, 1 round")
    p.add_argument(
        "--peer",
        choices=("both", "recorder", "application", "none"),
        default="both",
        help="which eventsourcing API(s) to measure (default both)",
    )
    p.add_argument(
        "--profile",
        choices=("append", "rebuild"),
        action="append",
        default=[],
        help="print a cProfile of that phase (the profiler slows it: figures are then not comparable)",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also time EventStore.append without projections (mf_append alone), in a third database",
    )
    p.add_argument(
        "--statements",
        action="store_true",
        help="diagnostic: only the ledger's appends, with each SQL statement's wall and server CPU",
    )
    p.add_argument("--keep", action="store_true", help="do not drop the databases (prints their names)")
    args = p.parse_args(argv)
    if args.quick:
        args.events, args.nodes, args.rounds, args.rebuilds = 10_000, 64, 1, 1
    args.nodes = max(TASKS, args.nodes - args.nodes % TASKS)
    return args


async def run(args: argparse.Namespace) -> int:
    server = server_dsn()
    ledger_db = bench_database_name("ledger")
    peer_db = ledger_db.replace("_ledger", "_peer")
    print(f"ModelForge ledger benchmark, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {machine_description()}; {await server_description(server)}")
    per_task = max(1, args.events // EVENTS_PER_REPORT // TASKS)
    print(
        f"workload: {per_task * TASKS * EVENTS_PER_REPORT:,} timed events per system = "
        f"{per_task * TASKS:,} reports x {EVENTS_PER_REPORT} events, {TASKS} writers, pool of {POOL}, "
        f"{args.nodes} node streams (8 GPUs each), {args.rounds} interleaved round(s)"
    )
    ledger_dsn = await create_database(server, ledger_db)
    peer_dsn = await create_database(server, peer_db) if args.peer != "none" else None
    bare_db = ledger_db.replace("_ledger", "_bare")
    bare_dsn = await create_database(server, bare_db) if args.breakdown else None
    pool: asyncpg.Pool | None = None
    bare_pool: asyncpg.Pool | None = None
    meter: ServerMeter | None = None
    peers: list[Any] = []
    try:
        pool = await create_pool(ledger_dsn, min_size=POOL, max_size=POOL)
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

        # Setup (untimed): discover every node through reconcile + append.
        rng = random.Random(20261130)
        nodes = [Node(i, node_id_for(node_key(i)), 0) for i in range(args.nodes)]
        t0 = time.perf_counter()

        async def discover(task: int) -> None:
            for n in nodes[task::TASKS]:
                result = await store.append(n.node_id, 0, discovery_events(n, rng))
                n.discovered_version = result.stream_version

        await asyncio.gather(*(discover(t) for t in range(TASKS)))
        setup_events = sum(n.discovered_version for n in nodes)
        print(
            f"setup: {len(nodes)} nodes discovered ({setup_events:,} events) "
            f"in {time.perf_counter() - t0:.1f} s (untimed)"
        )

        start = datetime.now(UTC)
        warm = build_reports(nodes, 4, rng, start)
        t0 = time.perf_counter()
        work = build_reports(nodes, per_task, rng, start + timedelta(seconds=1))
        print(f"generated the reports in {time.perf_counter() - t0:.1f} s (untimed)")

        ledger = LedgerSystem(store, nodes)
        bare: LedgerSystem | None = None
        m_bare = Measurement("  of which mf_append alone (no projections)")
        if bare_dsn:
            bare_pool = await create_pool(bare_dsn, min_size=POOL, max_size=POOL)
            async with bare_pool.acquire() as conn:
                await migrate(conn)
            bare = LedgerSystem(EventStore(bare_pool, ()), nodes)
            for n in nodes:
                await bare.store.append(n.node_id, 0, discovery_events(n, random.Random(n.index)))
            async with bare_pool.acquire() as conn:
                await conn.execute("ANALYZE")
        # Steady state: statistics as autovacuum would have them. Without this, statements planned
        # while the tables were empty keep a cached generic plan that scans (docs/performance.md).
        async with pool.acquire() as conn:
            await conn.execute("ANALYZE")
        ceiling = CeilingSystem(pool, nodes, with_received_at=with_received_at)
        m_ledger = Measurement("ledger: EventStore.append + inline projection")
        m_ceiling = Measurement("ceiling: asyncpg executemany INSERT")
        peer_systems: list[tuple[Any, Measurement]] = []
        if args.peer in ("both", "recorder"):
            peers.append(PeerRecorder(peer_dsn, nodes))  # type: ignore[arg-type]
            peer_systems.append((peers[-1], Measurement("peer: eventsourcing ApplicationRecorder")))
        if args.peer in ("both", "application"):
            peers.append(PeerApplication(peer_dsn, nodes))  # type: ignore[arg-type]
            peer_systems.append((peers[-1], Measurement("peer: eventsourcing Application.save")))

        # Warm-up (untimed): prepared statements, pools, caches.
        warm_m = Measurement("warm-up")
        await timed(None, warm_m, warm, ceiling.worker)
        await timed(None, warm_m, warm, ledger.worker)
        if bare:
            await timed(None, warm_m, warm, bare.worker)
        for peer, _ in peer_systems:
            _run_threads(warm, peer.worker)

        meter = await ServerMeter.open(server, [ledger_db, peer_db, bare_db])
        prof = Profiler("append" in args.profile)
        for part in slices(work, args.rounds):
            await timed(meter, m_ceiling, part, ceiling.worker)
            with prof:
                await timed(meter, m_ledger, part, ledger.worker)
            if bare:
                await timed(meter, m_bare, part, bare.worker)
            for peer, m in peer_systems:
                await timed_threads(meter, m, part, peer.worker)

        print("\n(a) append, 10 events per transaction")
        print(m_ceiling.line())
        print(m_ledger.line())
        if bare:
            print(m_bare.line())
        print("(b) peer, the same reports")
        for _, m in peer_systems:
            print(m.line())
        prof.report("the ledger's appends")

        # (c) rebuild vs bare scan + decode, over the log (a) left.
        async with pool.acquire() as conn:
            log_events = await conn.fetchval("SELECT count(*) FROM events")
            await conn.execute("VACUUM ANALYZE events")
        m_scan = Measurement("bare keyset scan + msgspec decode")
        m_rebuild = Measurement("rebuild (ALL_PROJECTIONS, into shadows + swap)")
        rprof = Profiler("rebuild" in args.profile)
        phases = _time_rebuild_phases() if "rebuild" in args.profile else None
        for _ in range(max(1, args.rebuilds)):
            before = await meter.snapshot()
            s = await bare_scan(pool)
            m = Measurement(m_scan.name)
            m.add(*s)
            m.add_server(before, await meter.snapshot())
            if m_scan.events == 0 or m.seconds < m_scan.seconds:
                m_scan = m
            before = await meter.snapshot()
            c0 = time.process_time()
            with rprof:
                report = await rebuild(pool, ALL_PROJECTIONS)
            m = Measurement(m_rebuild.name)
            m.add(report.events, report.seconds, time.process_time() - c0)
            m.add_server(before, await meter.snapshot())
            if m_rebuild.events == 0 or m.seconds < m_rebuild.seconds:
                m_rebuild = m
        print(
            f"(c) rebuild, over the log of (a): {log_events:,} events, {len(nodes)} streams "
            f"(best of {args.rebuilds})"
        )
        print(m_scan.line())
        print(m_rebuild.line())
        rprof.report("rebuild")
        if phases is not None:
            print("rebuild phases (wall s, summed over runs):")
            for phase, secs in phases.items():
                print(f"  {phase:<18} {secs:7.2f}")

        print("\nratios (same run, same server)")
        pairs: list[tuple[str, Measurement, Measurement, float, str]] = [
            ("append / ceiling", m_ledger, m_ceiling, 0.5, ">= 0.5")
        ]
        for _, m in peer_systems:
            label = "append / peer (" + ("recorder" if "Recorder" in m.name else "Application") + ")"
            pairs.append((label, m_ledger, m, 2.0, ">= 2"))
        pairs.append(("rebuild / bare scan", m_rebuild, m_scan, 0.5, ">= 0.5"))
        print(f"  {'':<30} {'events/s':>8}  {'target':<7} {'':<8} {'(CPU-cost ratio)':>16}")
        for label, mine, base, target, shown in pairs:
            ratio = mine.rate / base.rate
            a, b = mine.cpu_per_event, base.cpu_per_event
            cost = f"{b / a:.2f}" if a and b else "n/a"
            print(f"  {label:<30} {ratio:>8.2f}  {shown:<7} {verdict(ratio, target):<8} {cost:>16}")
        print(
            "  (CPU-cost ratio: the baseline's client+server CPU per event over ours, a cross-check that\n"
            "   other load on the machine moves less than wall-clock rates; the verdict uses events/s)"
        )
        if args.profile:
            print("\n(note: --profile was on; the profiled phase ran slower than it would unprofiled)")
        return 0
    finally:
        for peer in peers:
            try:
                peer.close()
            except Exception as exc:  # pragma: no cover - best-effort cleanup
                print(f"closing a peer failed: {exc}", file=sys.stderr)
        if meter is not None:
            await meter.close()
        for p in (pool, bare_pool):
            if p is not None:
                await p.close()
        if args.keep:
            print(f"kept databases: {ledger_db} {peer_db if peer_dsn else ''}")
        else:
            await drop_database(server, ledger_db)
            if peer_dsn:
                await drop_database(server, peer_db)
            if bare_dsn:
                await drop_database(server, bare_db)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return asyncio.run(statement_profile(args) if args.statements else run(args))


if __name__ == "__main__":
    raise SystemExit(main())
