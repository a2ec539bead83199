"""bench.ingest's steady window: telemetry reports only, one checkout's server at a time with
nothing else of the run writing, and what they cost in WAL (that database's records, bench/wal.py)
and in the log's bytes; the figures per report and their ratios this checkout / baseline."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from bench import harness as h
from bench.agents import Target
from bench.servers import HttpConnection
from bench.wal import WalInspector, WalShare

STEADY_REPORTS = 5000  # the steady window's reports per checkout (--quick: 2,000)
SNAPSHOTS = "SELECT count(*) FROM events WHERE event_type = 'NODE_TELEMETRY_OBSERVED'"


@dataclass
class Steady:
    """A window of steady telemetry reports of one checkout, nothing else of this run writing
    meanwhile: what they cost in WAL and in the log's bytes."""

    reports: int  # accepted
    errors: int
    snapshots: int  # NODE_TELEMETRY_OBSERVED events appended in the window
    log_bytes: int  # growth of `events`: every partition with its TOAST and indexes
    wal: WalShare
    # The whole day segment the window wrote to, bytes per event in it: as it stands (its day
    # still open), and once sealed (ledger/sealing.py; None for a checkout that cannot seal).
    day_open: float | None = None
    day_sealed: float | None = None
    # The telemetry hours (ledger/telemetry_hours.py) of the storage window's nodes, bytes per
    # snapshot they hold (None for a checkout without them).
    hours: float | None = None

    @property
    def wal_per_report(self) -> float | None:
        """The database's own WAL records per report; the cluster's WAL when they cannot be read."""
        wal = self.wal.database if self.wal.database is not None else self.wal.total
        return wal / self.reports if self.reports else None

    @property
    def storage_per_snapshot(self) -> float | None:
        return self.log_bytes / self.snapshots if self.snapshots else None

    def as_row(self, who: str) -> dict[str, Any]:
        return {
            "name": f"steady telemetry window ({who})",
            "reports": self.reports,
            "errors": self.errors,
            "snapshots": self.snapshots,
            "log_bytes": self.log_bytes,
            "wal_bytes_per_report": self.wal_per_report,
            "storage_bytes_per_snapshot": self.storage_per_snapshot,
            "wal_cluster_bytes": self.wal.total,
            "wal_records_bytes": self.wal.records,
            "wal_database_bytes": self.wal.database,
            "wal_database_fpi_bytes": self.wal.database_fpi,
            "day_segment_bytes_per_event": self.day_open,
            "sealed_day_segment_bytes_per_event": self.day_sealed,
            "telemetry_hours_bytes_per_snapshot": self.hours,
        }

    @property
    def storage_with_hours(self) -> float | None:
        """The log's bytes per snapshot and its telemetry hours'."""
        storage = self.storage_per_snapshot
        return None if storage is None or self.hours is None else storage + self.hours


async def log_figures(dsn: str) -> tuple[int, int]:
    """(bytes of `events`: every partition with its TOAST and indexes, telemetry snapshots in it)."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        size = await conn.fetchval(
            f"SELECT sum(pg_total_relation_size(relid)) FROM ({h.LOG_PARTITIONS}) leaves"
        )
        return int(size), int(await conn.fetchval(SNAPSHOTS))
    finally:
        await conn.close()


# The day segment holding the most events (today's: the run's), its rows and its day.
_DAY_SEGMENT = (
    "SELECT tableoid::regclass::text AS partition, segment AS day, count(*) AS n FROM events "
    "WHERE segment <> 'infinity' GROUP BY 1, 2 ORDER BY 3 DESC LIMIT 1"
)


async def day_figures(dsn: str, *, seal: bool) -> tuple[float | None, float | None]:
    """Bytes per event of the day segment the run wrote to (table, TOAST, indexes), as it stands
    and, with `seal`, once sealed by the product's own `seal_segment`."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(_DAY_SEGMENT)
        if row is None:
            return None, None
        size = "SELECT pg_total_relation_size($1::regclass)"
        day_open = await conn.fetchval(size, row["partition"]) / row["n"]
        if not seal:
            return day_open, None
        from ledger.sealing import seal_segment

        await seal_segment(conn, row["day"], row["partition"])
        return day_open, await conn.fetchval(size, row["partition"]) / row["n"]
    finally:
        await conn.close()


async def hours_figures(dsn: str, node_ids: list[str]) -> float:
    """The nodes' telemetry hours, stored by the product's own `store_hour` for every hour their
    snapshots were received in (the open one too: what its closing will store): the growth of the
    table (with its TOAST and index) per snapshot they hold, as the log's storage is measured (an
    empty table's pages, its index's metapage and root, are no snapshot's)."""
    import asyncpg

    from collectors.observations import ACCELERATOR_METRICS, HOST_METRICS
    from ledger.db import create_pool
    from ledger.telemetry_hours import floor_hour, store_hour

    pool = await create_pool(dsn, min_size=1, max_size=2)
    try:
        before = await pool.fetchval("SELECT pg_total_relation_size('telemetry_hours')")
        hours = await pool.fetch(
            "SELECT DISTINCT stream_id, date_trunc('hour', received_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' "
            "AS hour_start FROM events WHERE event_type = 'NODE_TELEMETRY_OBSERVED' AND stream_id = ANY($1)",
            node_ids,
        )
        for r in hours:
            await store_hour(
                pool, r["stream_id"], floor_hour(r["hour_start"]), ACCELERATOR_METRICS, HOST_METRICS
            )
        row = await pool.fetchrow(
            "SELECT pg_total_relation_size('telemetry_hours') - $2 AS size, (SELECT sum(observations) "
            "FROM telemetry_hours WHERE subject = '' AND node_id = ANY($1)) AS held",
            node_ids,
            before,
        )
    except asyncpg.UndefinedTableError:
        return float("nan")
    finally:
        await pool.close()
    return float(row["size"] / row["held"]) if row["held"] else float("nan")


async def _send(target: Target, agents: list[Any], reports: int, connections: int) -> tuple[int, int]:
    """`reports` telemetry reports of `agents`, closed loop on `connections` connections, a node
    never with two in flight: (accepted, errors)."""
    conns = [await HttpConnection.open(target.server.port) for _ in range(connections)]
    groups = [agents[c::connections] for c in range(connections)]
    per = -(-reports // connections)
    accepted, errors = 0, 0

    async def worker(c: int) -> None:
        nonlocal accepted, errors
        for k in range(per):
            try:
                await groups[c][k % len(groups[c])].send(conns[c], "telemetry")
            except Exception as exc:
                errors += 1
                if errors <= 3:
                    print(f"  error (steady window, {target.label}): {exc!r}"[:300])
            else:
                accepted += 1

    try:
        await asyncio.gather(*(worker(c) for c in range(connections)))
    finally:
        for conn in conns:
            conn.close()
    return accepted, errors


# Reports per node in the storage window. A node's entries in the log's indexes keyed by stream
# sit together, and its newest one goes at their end: that leaf page fills (about 110 entries)
# and splits in half, so an index grows by a page per ~55 of a node's reports. Every node of the
# fleet reported as often before the window, so their pages split in step: a window of a few
# reports per node measures all of them just before (or just after) a wave of splits, and the
# figure swung by a third from run to run. Two whole cycles per node measure their average.
STORAGE_REPORTS_PER_NODE = 128


async def steady_window(
    target: Target, reports: int, connections: int, wal: WalInspector, *, seal: bool = False
) -> Steady:
    """`reports` telemetry reports (no inventory report among them) to `target`'s server alone,
    closed loop, every node in turn: the WAL per report. Then, for the log's bytes per snapshot,
    as many reports of only as many nodes as get STORAGE_REPORTS_PER_NODE each (at least one per
    connection); and the whole day segment's bytes per event, sealed too with `seal` (its appends
    afterwards, the ceiling's, go into a sealed day). The other checkout's server idles meanwhile."""
    # A checkpoint, then one report per node: the pages the window changes are logged whole once,
    # here, rather than in whichever checkout's window a timed checkpoint happens to precede.
    await wal.checkpoint()
    await _send(target, target.agents, len(target.agents), connections)
    start = await wal.position()
    accepted, errors = await _send(target, target.agents, reports, connections)
    end = await wal.position()
    share = await wal.share(start, end, target.db.name)
    nodes = max(connections, reports // STORAGE_REPORTS_PER_NODE)
    size0, snapshots0 = await log_figures(target.db.dsn)
    _stored, failed = await _send(
        target, target.agents[:nodes], nodes * STORAGE_REPORTS_PER_NODE, connections
    )
    size1, snapshots1 = await log_figures(target.db.dsn)
    day_open, day_sealed = await day_figures(target.db.dsn, seal=seal)
    hours = await hours_figures(target.db.dsn, [a.node_id for a in target.agents[:nodes]]) if seal else None
    return Steady(
        accepted, errors + failed, snapshots1 - snapshots0, size1 - size0, share, day_open, day_sealed, hours
    )


def print_per_report(who: str, steady: Steady | None, http: h.Sample) -> None:
    """The compact-telemetry figures, on lines of their own: WAL and storage from the steady
    window, CPU from the closed loop (its rounds interleaved with the other checkout's)."""
    wal = steady.wal_per_report if steady is not None else None
    storage = steady.storage_per_snapshot if steady is not None else None
    server, db = http.per_op("server_cpu"), http.per_op("db_cpu")
    print(f"{who}:")
    print(f"  WAL per report: {'n/a' if wal is None else f'{wal:,.0f}'} B")
    print(f"  storage per snapshot: {'n/a' if storage is None else f'{storage:,.0f}'} B")
    if steady is not None and steady.day_open is not None:
        sealed = "" if steady.day_sealed is None else f", sealed {steady.day_sealed:,.0f} B"
        print(f"  storage per event of the day segment: {steady.day_open:,.0f} B as it stands{sealed}")
    if steady is not None and steady.storage_with_hours is not None:
        print(f"  storage per snapshot with its telemetry hour: {steady.storage_with_hours:,.0f} B "
              f"(the hours {steady.hours:,.0f} B)")  # fmt: skip
    print(f"  server CPU per report: {'n/a' if server is None else f'{server:.3f}'} ms")
    print(f"  PostgreSQL CPU per report: {'n/a' if db is None else f'{db:.3f}'} ms")


def this_over_baseline(
    report: h.Report, steady: Steady, bsteady: Steady, http: h.Sample, base: h.Sample
) -> None:
    """The compact-telemetry targets: this checkout's figures over the baseline's, same run, same PostgreSQL."""

    def over(a: float | None, b: float | None) -> float:
        return a / b if a is not None and b else float("nan")

    report.ratio(h.Ratio("WAL per steady report, this / baseline", over(steady.wal_per_report, bsteady.wal_per_report), 0.35, at_least=False))  # fmt: skip
    report.ratio(h.Ratio("storage per snapshot, this / baseline", over(steady.storage_per_snapshot, bsteady.storage_per_snapshot), 0.35, at_least=False))  # fmt: skip
    report.ratio(h.Ratio("storage per snapshot with telemetry hours, this / baseline", over(steady.storage_with_hours, bsteady.storage_per_snapshot), 0.35, at_least=False))  # fmt: skip
    report.ratio(h.Ratio("storage per event of a sealed day, this / baseline's day", over(steady.day_sealed, bsteady.day_open), 0.35, at_least=False))  # fmt: skip
    report.ratio(h.Ratio("this checkout / baseline (http reports/s)", over(http.rate, base.rate), 0.95, h.cost_ratio(http, base)))  # fmt: skip
    report.ratio(h.Ratio("p99, this / baseline (closed loop)", over(http.ms(99), base.ms(99)), 1 / 0.95, at_least=False))  # fmt: skip
    for attr, label, target in (("server_cpu", "server", 0.5), ("db_cpu", "PostgreSQL", 0.6)):
        v = over(http.per_op(attr), base.per_op(attr))
        report.ratio(h.Ratio(f"{label} CPU per report, this / baseline", v, target, at_least=False))
