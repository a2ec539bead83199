"""Replay benchmark: point-in-time reconstruction from a log of >= 1,000,000 events,
against the bare keyset scan + msgspec decode ceiling, in one run.

    python -m bench.replay                 # default: 10,000 nodes, ~1.08 M events (~4-5 min here)
    python -m bench.replay --quick         # under 2 minutes: 1,000 nodes, ~108,000 events

On a throwaway database (`mf_bench_<random>_replay`) of the server named by
MODELFORGE_BENCH_DATABASE_URL (default postgresql://postgres@127.0.0.1:5432/test), dropped at the
end (`--keep` keeps it):

1. The log, built fast (untimed): a fleet of N eight-GPU nodes (the fleet types of
   bench/fleet.py) reporting every 10 s, as the agents of bench/ingest.py do: each node's
   discovery (19 events, made by the product's `reconcile`), then `--reports` telemetry reports
   of one NODE_TELEMETRY_OBSERVED each (host + 8 GPUs); 5 % of the nodes also have incidents, again decided by
   `reconcile` against the node's folded state: a driver upgrade (a node and 8 accelerator
   HARDWARE_CHANGED), a GPU gone from a complete NVML scan (ACCELERATOR_MISSING) and back
   (ACCELERATOR_DISCOVERED, rediscovered). Plus one "hot" node with the history the retention
   policy keeps: 24 h of reports every 10 s (8,640 reports, ~78,000 events) before the fleet
   arrives. Payloads are the catalog's Structs encoded by msgspec (telemetry maps pre-encoded
   and spliced in as msgspec.Raw); metadata as the server writes it for an agent report; stream
   versions consecutive per stream; recorded_at increasing with the global position. The rows
   are COPYed into `events` (its indexes dropped during the load and recreated from their own
   definitions), then `streams` is filled and the database VACUUM ANALYZEd. Lifecycle events
   carry no hash chain (this bench does not verify chains); every payload is decoded again by
   the ceiling's scan, so an event the catalog rejects fails the run.
2. Timed, interleaved, best of `--repeat` (single nodes: median of `--node-repeat`):
   - fleet: `projections.pointintime.inventory_as_of(conn, as_of)` at the end of the log (every
     event) and at its middle, against the bare keyset scan + decode of the same rows: for the
     end, exactly bench/ledger.py's scan (`SCAN_SQL`, batches of 5,000); for the middle, the
     same scan with the as-of filter;
   - one node: `inventory_as_of(conn, as_of, node_id=...)` of a typical node (~100 events) and
     of the hot node (~78,000 events), against the same-rows scan.

Target: none of its own; each ratio is printed against 0.5, bench/ledger.py's target for rebuild
over the same bare scan, for reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import asyncpg

from bench import harness as h
from bench.ledger import SCAN_BATCH, SCAN_SQL
from bench.replay_log import LogBuilder, build_log
from ledger.reading import EVENT_COLUMNS

REFERENCE_RATIO = 0.5

# inventory_as_of's own SELECT (projections/pointintime.py), without the fold.
AS_OF_SQL = (
    "SELECT " + EVENT_COLUMNS + " FROM events "
    "WHERE (stream_id, stream_version) > ($1, $2) AND recorded_at <= $3 {node} "
    "ORDER BY stream_id, stream_version LIMIT $4"
)


# --- the timed work --------------------------------------------------------------------------------


@dataclass
class Case:
    """One reconstruction (or its ceiling), measured `len(runs)` times."""

    name: str
    runs: list[h.Sample] = field(default_factory=list)

    def add(self, events: int, usage: h.Usage) -> None:
        self.runs.append(h.Sample(self.name, ops=1, units=events, usage=usage))

    def pick(self, median: bool) -> h.Sample:
        """The run reported: the fastest, or the median one."""
        ordered = sorted(self.runs, key=lambda r: r.usage.seconds)
        return ordered[len(ordered) // 2] if median else ordered[0]

    def cpu_us(self) -> tuple[float, float | None]:
        """(client, PostgreSQL) CPU us per event over all runs. /proc counts in 10 ms ticks: only a
        total over many runs resolves a short query; under 0.1 s of PostgreSQL CPU, None."""
        total = h.Sample(self.name)
        for r in self.runs:
            total.merge(r, r.usage)
        n, db = max(1, total.units), total.usage.db_cpu
        return 1e6 * total.usage.client_cpu / n, None if db is None or db < 0.1 else 1e6 * db / n

    def cost(self) -> float | None:
        client, db = self.cpu_us()
        return None if db is None else client + db


async def scan(conn: asyncpg.Connection, as_of: datetime | None, node_id: str | None) -> int:
    """The ceiling: keyset scan + the log's decode of each event (jsonb or compact body), no
    fold. Without as_of or node, exactly bench/ledger.py's bare scan."""
    from ledger.reading import event_from_row

    n = 0
    last: tuple[str, int] = ("", 0)
    filtered = as_of is not None or node_id is not None
    sql = AS_OF_SQL.format(node="AND stream_id = $5" if node_id else "") if filtered else SCAN_SQL
    until = as_of or datetime.max.replace(tzinfo=UTC)
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        while True:
            if not filtered:
                rows = await conn.fetch(sql, last[0], last[1], SCAN_BATCH)
            elif node_id is None:
                rows = await conn.fetch(sql, last[0], last[1], until, SCAN_BATCH)
            else:
                rows = await conn.fetch(sql, last[0], last[1], until, SCAN_BATCH, node_id)
            if not rows:
                break
            for row in rows:
                event_from_row(row)
            n += len(rows)
            last = (rows[-1]["stream_id"], rows[-1]["stream_version"])
    return n


async def warm_cache(conn: asyncpg.Connection) -> None:
    """Untimed: the heap and the (stream_id, stream_version) index into the OS cache, as a server
    that has been reading its log has them (a sequential read, then an index-only scan)."""
    await conn.execute("SELECT count(*) FROM events")
    await conn.execute("SELECT count(*) FROM events WHERE (stream_id, stream_version) > ('', 0)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__)
    p.add_argument("--nodes", type=int, default=10_000, help="fleet nodes of 8 GPUs (default 10,000)")
    p.add_argument("--reports", type=int, default=9, help="telemetry reports per fleet node (default 9)")
    p.add_argument(
        "--hot-hours",
        type=float,
        default=24.0,
        help="history of the hot node, reports every 10 s (default 24)",
    )
    p.add_argument(
        "--repeat", type=int, default=1, help="fleet reconstructions per point, best kept (default 1)"
    )
    p.add_argument("--node-repeat", type=int, default=9, help="single-node repetitions, median (default 9)")
    p.add_argument("--no-mid", dest="mid", action="store_false", help="skip the fleet as of the middle")
    p.add_argument(
        "--reuse",
        metavar="DATABASE",
        help="time a log kept by an earlier `--keep` run (same --nodes/--reports/--hot-hours) instead of building one",
    )
    return h.parse_sized(p, argv, {"nodes": 1000, "hot_hours": 2.4, "node_repeat": 5})


async def open_log(args: argparse.Namespace, pool: asyncpg.Pool) -> tuple[LogBuilder, dict[str, float]]:
    """Build the log (or adopt a kept one); returns the builder (node ids, times) and build phases."""
    from ledger.schema import migrate

    builder = LogBuilder(args.nodes, args.reports, hot_history=timedelta(hours=args.hot_hours))
    if args.reuse:
        async with pool.acquire() as conn:
            versions = dict(await conn.fetch("SELECT stream_id, version FROM streams"))
            builder.events = await conn.fetchval("SELECT count(*) FROM events")
            builder.last_at = await conn.fetchval("SELECT max(recorded_at) FROM events")
        assert len(versions) == len(builder.all_nodes), "--nodes differs from the kept log's"
        for n in builder.all_nodes:
            n.version = versions[n.node_id]
        return builder, {}
    async with pool.acquire() as conn:
        await migrate(conn)
    return builder, await build_log(pool, builder)


async def describe_log(pool: asyncpg.Pool, builder: LogBuilder, phases: dict[str, float]) -> None:
    async with pool.acquire() as conn:
        total = await conn.fetchval("SELECT count(*) FROM events")
        lifecycle = await conn.fetchval("SELECT count(*) FROM events WHERE event_class = 'lifecycle'")
        heap = await conn.fetchval(
            f"SELECT pg_size_pretty(sum(pg_relation_size(relid))) FROM ({h.LOG_PARTITIONS}) leaves"
        )
        size = await conn.fetchval(
            f"SELECT pg_size_pretty(sum(pg_total_relation_size(relid))) FROM ({h.LOG_PARTITIONS}) leaves"
        )
    assert total == builder.events, (total, builder.events)
    built = (
        f"built in {sum(phases.values()):.0f} s (untimed: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items())
        + ")"
        if phases
        else "reused"
    )
    print(
        f"log: {total:,} events ({lifecycle:,} lifecycle) in {len(builder.all_nodes):,} streams; heap {heap}, "
        f"{size} with indexes; {built}"
    )


async def run(args: argparse.Namespace) -> int:
    from ledger.db import create_pool

    report = h.Report("replay")
    await h.describe_environment(report, "replay")
    async with log_database(args) as db:
        pool = await create_pool(db.dsn, min_size=1, max_size=2)
        try:
            return await timed_run(args, db, pool, report)
        finally:
            await pool.close()


async def timed_run(args: argparse.Namespace, db: h.Database, pool: asyncpg.Pool, report: h.Report) -> int:
    from projections.pointintime import inventory_as_of

    builder, phases = await open_log(args, pool)
    await describe_log(pool, builder, phases)
    end, mid, hot = builder.end_of_log(), builder.middle(), builder.hot
    typical = builder.nodes[len(builder.nodes) // 2 + 1]  # index % 20 != 0: no incidents
    incident = builder.nodes[len(builder.nodes) // 2]  # index % 20 == 0 (an even --nodes)
    points = [("end", end)] + ([("mid", mid)] if args.mid else [])
    meter = await h.Meter.open([db.name])
    pairs: list[tuple[Case, Case, bool]] = []  # (reconstruction, its ceiling, median of runs?)
    try:
        async with pool.acquire() as conn:
            await warm_cache(conn)
            for point, at in points:
                label = "the end of the log" if point == "end" else "the middle of the fleet's history"
                ceiling = "bare keyset scan + decode" if point == "end" else "the same rows, scan + decode"
                case, base = Case(f"fleet, as of {label}"), Case(f"  ceiling: {ceiling}")
                folded = await conn.fetchval("SELECT count(*) FROM events WHERE recorded_at <= $1", at)
                for _ in range(max(1, args.repeat)):
                    n, usage = await meter.measure(scan(conn, None if point == "end" else at, None))
                    assert n == folded, (n, folded)
                    base.add(n, usage)
                    result, usage = await meter.measure(inventory_as_of(conn, at))
                    case.add(folded, usage)
                print(f"fleet as of {label}: {len(result.nodes):,} nodes reconstructed, folded to position "
                      f"{result.position:,}")  # fmt: skip
                pairs.append((case, base, False))
            for label, node, at in (
                (f"one node (~{args.reports * 9 + 19} events), as of the end", typical, end),
                ("one node with incidents, as of the end", incident, end),
                (f"the hot node ({hot.version:,} events), as of the end", hot, end),
                ("the hot node, as of the middle", hot, mid),
            ):
                case, base = Case(label), Case("  ceiling: the same rows, scan + decode")
                for _ in range(args.node_repeat):
                    n, usage = await meter.measure(scan(conn, at, node.node_id))
                    base.add(n, usage)
                    result, usage = await meter.measure(inventory_as_of(conn, at, node_id=node.node_id))
                    assert len(result.nodes) == 1 and result.nodes[0].node_id == node.node_id
                    case.add(n, usage)
                pairs.append((case, base, True))
    finally:
        await meter.close()

    lines = []
    for case, base, median in pairs:
        for c in (case, base):
            run = c.pick(median)
            client, db_us = c.cpu_us()
            lines.append([c.name, run.units, 1e3 * run.usage.seconds, run.unit_rate, client, db_us])
            report.row(name=c.name.strip(), events=run.units, ms=1e3 * run.usage.seconds,
                       runs_s=[r.usage.seconds for r in c.runs], client_cpu_us_per_event=client,
                       postgres_cpu_us_per_event=db_us)  # fmt: skip
        r = case.pick(median).unit_rate / base.pick(median).unit_rate
        cost_a, cost_b = case.cost(), base.cost()
        report.ratio(
            h.Ratio(
                f"{case.name} / ceiling", r, REFERENCE_RATIO, cost_b / cost_a if cost_a and cost_b else None
            )
        )
    h.table(["reconstruction", "events", "ms", "events/s", "client us", "PG us"], lines, first_width=56)
    print(f"  (fleet: best of {max(1, args.repeat)}; single nodes: median of {args.node_repeat}; CPU per event over\n"
          f"   all runs. No target of its own: the verdict is against {REFERENCE_RATIO}, bench/ledger.py's rebuild\n"
          "   target over the same scan, for reference)")  # fmt: skip
    report.finish(args.json)
    return 0


@contextlib.asynccontextmanager
async def log_database(args: argparse.Namespace) -> AsyncIterator[h.Database]:
    """A throwaway database, or the one an earlier `--keep` run left (`--reuse`)."""
    if args.reuse:
        yield h.Database(args.reuse, h.dsn_for_database(h.server_dsn(), args.reuse), h.server_dsn())
        print(f"kept database: {args.reuse} (time it again: --reuse {args.reuse})")
    else:
        async with h.throwaway_database("replay", keep=args.keep) as db:
            yield db
            if args.keep:
                print(f"time it again: --reuse {db.name}")


def main(argv: Sequence[str] | None = None) -> int:
    return h.main(run, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
