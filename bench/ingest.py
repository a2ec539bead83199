"""Ingest benchmark: simulated agents reporting to `modelforge-hw serve` over
HTTP, next to the ledger-only append ceiling, in one run on one throwaway database.

    python -m bench.ingest              # 1,000 nodes, 2 rounds x 10 s per tier, open loop 60 s
    python -m bench.ingest --quick      # under 2 minutes: 500 nodes, 2 rounds x 3 s, open loop 15 s
    python -m bench.ingest --quick --baseline CHECKOUT   # under 3 minutes: both, same PostgreSQL
    python -m bench.ingest --replica    # the closed loop with a hot standby: remote_apply, on,
                                        # asynchronous and no replica, same run (bench/replica.py)

Agents (simulated, no NVML): nodes of 8 GPUs (bench/fleet.py), each enrolled over HTTP (an
enrollment token from the operator API, then `POST /agent/enroll`), then one `inventory` report
(discovery, untimed). Every report is the agent's wire format with a full typed observation and
fresh telemetry, the node's credential as bearer; every 30th report of a node goes on the
`inventory` stream, the others on `telemetry`, each with its own increasing sequence, and a node
never has two reports in flight. A steady report is one observation event (the node's telemetry snapshot).

Measured:
- http: closed loop, `--connections` (16) keep-alive connections, as fast as the server answers;
- ceiling: `EventStore.append` in this process of the same events per report (what `reconcile`
  makes of them), with expected versions, on the same database and streams;
- two servers: the closed loop split over two `serve` processes sharing the database;
- open loop: `--rate` (1,000/s) offered for `--open-seconds`, latency from each report's scheduled
  time; says whether the backlog of waiting reports grows;
- retention: `--retention-events` old snapshots (received over the UTC day before yesterday, on
  that day's segment) pruned by the product's `prune_observations` while the closed loop runs:
  its p99 meanwhile, and the events table's size (all partitions) and dead tuples before, filled
  and after the prune;
- statements: the SQL statements and round trips per report, per refresh (`POST
  /hardware/refresh` of the server's own host) and per ceiling append, counted on the wire by
  the harness's StatementCounter (a proxy between a separate server process and PostgreSQL), with
  the transactions they make;
- with `--webhooks`: the closed loop with 3 webhook subscriptions active (receivers in this
  process answering 200; `--webhook-classes` selects what they get, lifecycle events by default),
  interleaved round by round with the same loop without any, and the ratio of the two;
- steady window: `--steady-reports` (5,000) telemetry reports only, to one checkout's server at a
  time with nothing else of this run writing: `WAL per report` (that database's WAL records, read
  back with pg_walinspect, since the WAL position is the cluster's), then `storage per snapshot`
  (the growth of every partition of `events` with TOAST and indexes over the NODE_TELEMETRY_OBSERVED
  events appended) over reports of a few nodes, 128 each (two cycles of the indexes' page splits
  per node: bench/steady.py), and the whole day segment's bytes per event, as it stands and, for
  this checkout, once sealed (ledger/sealing.py: what every day costs after it is over), and for
  this checkout the log's bytes per snapshot with its telemetry hours' (the history reads' columns,
  ledger/telemetry_hours.py, stored for the storage window's nodes), printed with the closed loop's
  server and PostgreSQL CPU per report;
- with `--baseline CHECKOUT`: the http tier, the steady window and the statement counts of another
  checkout of the product (its own `serve`, database and agents), interleaved with this one's, and
  this checkout's figures over the baseline's.

Targets (fleet scale): >= 1,000 reports/s closed loop with p99 < 100 ms; the open loop at 1,000/s
keeps up without a growing backlog; <= 1 ms of server CPU and <= 1 ms of PostgreSQL CPU per report.
Targets (compact telemetry), this checkout over the baseline: WAL per report and storage per snapshot <= 0.35,
reports/s >= 0.95, p99 <= 1/0.95, server CPU per report <= 0.5, PostgreSQL CPU per report <= 0.6.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import asyncio
import contextlib
import time
from collections.abc import Sequence

from bench import harness as h
from bench.agents import Load, Target, ceiling_payloads, read_versions
from bench.group_commit import Batches
from bench.ingest_statements import count_append, count_http
from bench.retention import fill_old_telemetry, table_figures
from bench.servers import ROOT, Process, start_product_server, workdir
from bench.steady import (
    STEADY_REPORTS,
    STORAGE_REPORTS_PER_NODE,
    Steady,
    print_per_report,
    steady_window,
    this_over_baseline,
)
from bench.wal import WalInspector
from bench.webhooks import WEBHOOK_TARGET, webhook_rounds

POOL = 10  # the pool `serve` makes
TARGET_RATE, TARGET_P99_MS, TARGET_CPU_MS = 1000.0, 100.0, 1.0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__)
    p.add_argument("--nodes", type=int, default=1000, help="simulated agents of 8 GPUs (default 1,000)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per tier per round (default 10)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--connections", type=int, default=16, help="reports in flight, closed loop (default 16)")
    p.add_argument("--rate", type=float, default=TARGET_RATE, help="open-loop rate offered (default 1,000/s)")
    p.add_argument("--open-seconds", type=float, default=60.0, help="open-loop length (default 60 s)")
    p.add_argument("--variants", type=int, default=3, help="pre-built observations per node (default 3)")
    p.add_argument("--count", type=int, default=400, help="reports in the statement-counting window")
    p.add_argument(
        "--steady-reports", type=int, default=STEADY_REPORTS,
        help="telemetry reports per checkout in the steady window, where WAL and storage are measured "
        f"(default {STEADY_REPORTS:,}; 0 skips it)",
    )  # fmt: skip
    p.add_argument("--no-two-servers", dest="two_servers", action="store_false", help="skip two servers")
    p.add_argument("--no-open-loop", dest="open_loop", action="store_false", help="skip the open loop")
    p.add_argument("--no-count", dest="count_statements", action="store_false", help="skip the counting")
    p.add_argument(
        "--retention-events", type=int, default=400_000,
        help="old snapshots pruned while the closed loop runs (default 400,000: a day of ~46 nodes at 10 s; "
        "0 skips the retention tier)",
    )  # fmt: skip
    p.add_argument(
        "--baseline", metavar="CHECKOUT", type=Path,
        help="another checkout of the product (e.g. a worktree of main) to compare with in the same run: its "
        "`serve` gets its own database and agents, and its http tier and statement counts are interleaved "
        "with this checkout's",
    )  # fmt: skip
    p.add_argument(
        "--webhooks", action="store_true",
        help="also measure the closed loop with 3 webhook subscriptions active, against the same loop without",
    )  # fmt: skip
    p.add_argument(
        "--webhook-classes", default="lifecycle",
        help="the event classes the 3 subscriptions select, comma-separated (default lifecycle; "
        "lifecycle,observation delivers every report's telemetry too)",
    )  # fmt: skip
    p.add_argument(
        "--replica", action="store_true",
        help="instead: the closed loop against PostgreSQL 15 clusters of this machine without a standby and "
        "with one (synchronous_commit remote_apply, on, asynchronous), same run (bench/replica.py)",
    )  # fmt: skip
    quick = {"nodes": 500, "rounds": 2, "duration": 3.0, "open_seconds": 15.0, "count": 200}
    args = h.parse_sized(p, argv, quick)
    if args.quick:
        args.steady_reports = min(args.steady_reports, 2000)
        args.retention_events = min(args.retention_events, 100_000)
    return args


async def run(args: argparse.Namespace) -> int:
    from ledger.db import create_pool
    from ledger.store import EventStore
    from projections.inventory import ALL_PROJECTIONS

    report = h.Report("ingest")
    await h.describe_environment(report, "ingest")
    async with contextlib.AsyncExitStack() as stack:
        work = await stack.enter_async_context(workdir("ingest", keep=args.keep))
        db = await stack.enter_async_context(h.throwaway_database("ingest", keep=args.keep))
        processes: list[Process] = []
        stack.callback(lambda: [p.stop() for p in processes])
        t0 = time.perf_counter()
        this = await Target.prepare("server", ROOT, db, work, args)
        processes.append(this.server)
        baseline: Target | None = None
        if args.baseline:
            bdb = await stack.enter_async_context(h.throwaway_database("baseline", keep=args.keep))
            baseline = await Target.prepare("baseline", args.baseline.resolve(), bdb, work, args)
            processes.append(baseline.server)
        agents, load = this.agents, Load(this.agents)
        pool = await create_pool(db.dsn, min_size=2, max_size=POOL)
        stack.push_async_callback(pool.close)
        await ceiling_payloads(pool, agents)
        store = EventStore(pool, ALL_PROJECTIONS)
        print(f"setup: {len(agents):,} nodes enrolled and discovered over HTTP per checkout in "
              f"{time.perf_counter() - t0:.0f} s (untimed)")  # fmt: skip

        meter = await h.Meter.open([db.name], [this.server.pid])
        stack.push_async_callback(meter.close)
        bmeter: h.Meter | None = None
        if baseline is not None:
            bmeter = await h.Meter.open([baseline.db.name], [baseline.server.pid])
            stack.push_async_callback(bmeter.close)
        c = args.connections
        http = h.Sample(f"http: POST /agent/reports, {c} in flight")
        ceiling = h.Sample("ceiling: EventStore.append in-process")
        base = h.Sample(f"baseline http ({args.baseline}), {c} in flight")
        batches = Batches(this.server.port)
        bbatches = Batches(baseline.server.port) if baseline is not None else None
        for _ in range(args.rounds):
            s, u = await batches.around(
                meter.measure(load.http(http.name, [this.server.port], c, args.duration))
            )
            http.merge(s, u)
            if baseline is not None and bmeter is not None and bbatches is not None:
                s, u = await bbatches.around(
                    bmeter.measure(Load(baseline.agents).http("", [baseline.server.port], c, args.duration))
                )
                base.merge(s, u)
        # The steady windows, one checkout at a time, before anything else of this run writes:
        # the WAL position is the cluster's, so each window has only that server's reports.
        steady: Steady | None = None
        bsteady: Steady | None = None
        wal_note = ""
        if args.steady_reports > 0:
            wdb = await stack.enter_async_context(h.throwaway_database("wal", keep=args.keep))
            wal = await WalInspector.open(wdb.dsn)
            stack.push_async_callback(wal.close)
            steady = await steady_window(this, args.steady_reports, c, wal, seal=True)
            if baseline is not None:
                bsteady = await steady_window(baseline, args.steady_reports, c, wal)
            wal_note = wal.why_not or (
                "the bytes of the window's WAL records of that checkout's database (the relations they change,\n"
                "the commits of its transactions), read back with pg_walinspect; other databases' are left out"
            )
        # The ceiling after the http rounds, not between them: it appends to this checkout's
        # database and streams, which the baseline's never see, and interleaved it put this
        # checkout's http rounds 5-20 % behind an identical baseline's (docs/performance.md). Its
        # warm-up too: it writes this checkout's streams, so before the http rounds it left this
        # server's kept states outdated and put its rounds 7 % behind an identical baseline's.
        await read_versions(pool, agents)
        await load.ceiling(store, args.connections, 1.0)
        for _ in range(args.rounds):
            await read_versions(pool, agents)
            s, u = await meter.measure(load.ceiling(store, c, args.duration))
            ceiling.merge(s, u)
        samples = [http, ceiling] + ([base] if baseline is not None else [])

        hooked: tuple[h.Sample, h.Sample, int] | None = None
        if args.webhooks:
            hooked = await webhook_rounds(this.server.port, load, meter, args)
            samples += [hooked[0], hooked[1]]

        two: h.Sample | None = None
        if args.two_servers:
            second = await start_product_server(db.dsn, work, "server2")
            processes.append(second)
            meter.server_pids = [this.server.pid, second.pid]
            await load.http("warm-up", [second.port], 4, 1.0)
            two = h.Sample(f"http: two servers on one database, {c} in flight")
            for _ in range(args.rounds):
                s, u = await meter.measure(
                    load.http(two.name, [this.server.port, second.port], c, args.duration)
                )
                two.merge(s, u)
            samples.append(two)
            second.stop()
            meter.server_pids = [this.server.pid]

        opened: h.OpenLoop | None = None
        if args.open_loop:
            opened, u = await meter.measure(load.open(this.server.port, args.rate, args.open_seconds, 64))
            u.seconds = opened.sample.usage.seconds
            opened.sample.usage = u
            samples.append(opened.sample)

        pruning: h.Sample | None = None
        if args.retention_events > 0:
            from ledger.retention import prune_observations

            before = await table_figures(pool)
            day = await fill_old_telemetry(pool, args.retention_events)
            filled = await table_figures(pool)
            pruning = h.Sample(f"http while pruning {args.retention_events:,} old snapshots, {c} in flight")
            started = time.perf_counter()
            prune = asyncio.create_task(prune_observations(pool))
            while not prune.done():
                s, u = await meter.measure(
                    load.http(pruning.name, [this.server.port], c, min(args.duration, 3.0))
                )
                pruning.merge(s, u)
            pruned = prune.result()
            took = time.perf_counter() - started
            after_prune = await table_figures(pool)
            samples.append(pruning)
            mib = 1024 * 1024
            report.note(
                f"retention: {pruned.deleted:,} snapshots pruned ({', '.join(d.isoformat() for d in pruned.segments_dropped)}"
                f" dropped whole, {pruned.kept_past_day} kept past their day; the simulated day {day.isoformat()}) in "
                f"{took:.1f} s while the closed loop ran (p99 {pruning.ms(99):.0f} ms, against {http.ms(99):.0f} ms "
                f"without); events table, every partition with TOAST and indexes: {before[0] / mib:,.0f} MiB before "
                f"the fill, {filled[0] / mib:,.0f} MiB filled, {after_prune[0] / mib:,.0f} MiB after the prune "
                f"({after_prune[1]:,} dead tuples; no VACUUM)"
            )

        h.table(
            ["tier", "reports/s", "events/s", "p50 ms", "p99 ms", "errors", "server ms", "PG ms", "client ms", "WAL KB"],
            [[s.name, s.rate, s.unit_rate, s.ms(50), s.ms(99), s.errors, s.per_op("server_cpu"),
              s.per_op("db_cpu"), s.per_op("client_cpu"), s.per_op("wal_bytes", 1 / 1024)] for s in samples],
            first_width=52,
        )  # fmt: skip
        print("  (CPU per report: server = the serve process(es), PG = the database's backends, client = this\n"
              "   process: the load generator, or the ceiling's append itself; WAL: how far the server's WAL\n"
              "   position moved per report, whoever wrote it: the steady window below counts only its database's)")  # fmt: skip
        for s in samples:
            report.row(**s.as_row())
            for e in s.error_samples:
                print(f"  error ({s.name}): {e}")
        if steady is not None:
            windows = [("this checkout", steady)] + ([("baseline", bsteady)] if bsteady is not None else [])
            lines = []
            for who, w in windows:
                report.row(**w.as_row(who))
                others = w.wal.others
                per = max(1, w.reports)
                lines.append(
                    f"  {who}: {w.reports:,} reports ({w.errors} errors), {w.snapshots:,} snapshots appended, "
                    f"events +{w.log_bytes / 1024:,.0f} KiB;\n    the cluster's WAL position moved {w.wal.total / per:,.0f} B per report"
                    + ("" if others is None else f" ({others / max(1, w.wal.total):.0%} of it other databases' records or none's)")
                    + ("" if w.wal.database_fpi is None else f"; full-page images {w.wal.database_fpi / per:,.0f} B of the report's WAL")
                )  # fmt: skip
            report.note(
                "steady window: telemetry reports only, one checkout's server at a time, nothing else of this run\n"
                "writing meanwhile (the WAL position is the cluster's, and this PostgreSQL may be shared).\n"
                f"WAL per report: {wal_note}.\n"
                "storage per snapshot: the growth of every partition of `events` (table, TOAST, indexes) over the\n"
                f"NODE_TELEMETRY_OBSERVED events of a second window, {STORAGE_REPORTS_PER_NODE} reports from each of a few nodes (two\n"
                "cycles of the page splits of the indexes keyed by stream, whatever their phase).\n"
                "storage per event of the day segment: its bytes (table, TOAST, indexes) over its events, as it\n"
                "stands, and for this checkout once sealed as a day that is over is (ledger/sealing.py).\n" + "\n".join(lines)
            )  # fmt: skip
        print_per_report("this checkout", steady, http)
        if baseline is not None:
            print_per_report(f"baseline ({args.baseline})", bsteady, base)
        report.note(
            f"group commit during the closed loop: {batches.size:.1f} reports per transaction"
            + (f" (baseline: {bbatches.size:.1f})" if bbatches is not None else "")
        )
        if opened is not None:
            state = "grows (overloaded: stopped early)" if opened.overloaded else (
                "grows" if opened.backlog_grows else "does not grow")  # fmt: skip
            report.note(
                f"open loop at {opened.offered:,.0f}/s offered for {opened.offered_seconds:.0f} s: "
                f"{opened.sample.rate:,.0f} answered/s, {opened.abandoned:,} never sent, backlog {state} (waiting each second: "
                f"{', '.join(map(str, opened.backlog[:20]))}{'...' if len(opened.backlog) > 20 else ''})"
            )

        if args.count_statements:
            counted = {"this checkout": {**await count_http(db, work, agents, args.count, ROOT),
                                         **await count_append(db, agents)}}  # fmt: skip
            if baseline is not None:
                counted["baseline"] = await count_http(
                    baseline.db, work, baseline.agents, args.count, baseline.tree
                )
            lines = []
            for who, figures in counted.items():
                report.row(name=f"statements ({who})", **figures)
                for k, what in (
                    ("report", "telemetry report"),
                    ("inventory_report", "inventory report"),
                    ("refresh", "refresh"),
                    ("append", "ceiling append"),
                ):
                    if f"{k}_executions" in figures:
                        lines.append(
                            f"  {who:<14} per {what:<16} {figures[k + '_executions']:5.1f} / "
                            f"{figures[k + '_round_trips']:5.1f} / {figures[k + '_transactions']:4.1f}"
                        )
            report.note(
                "SQL counted on the wire (statements executed / round trips / transactions; an executemany of\n"
                "n rows is n executions in one round trip; a refresh is POST /hardware/refresh of the server's host):\n"
                + "\n".join(lines)
            )

        report.ratio(
            h.Ratio("http / ceiling (reports/s)", http.rate / ceiling.rate, None, h.cost_ratio(http, ceiling))
        )
        if baseline is not None and steady is not None and bsteady is not None:
            this_over_baseline(report, steady, bsteady, http, base)
        elif baseline is not None:
            report.ratio(
                h.Ratio(
                    "this checkout / baseline (http reports/s)",
                    http.rate / base.rate,
                    0.95,
                    h.cost_ratio(http, base),
                )
            )
        if two is not None:
            report.ratio(h.Ratio("two servers / one server (reports/s)", two.rate / http.rate, None))
        if hooked is not None:
            without, with_hooks, delivered = hooked
            report.note(f"webhooks: {delivered:,} deliveries received by the 3 receivers during their rounds")
            report.ratio(
                h.Ratio(
                    "3 webhook subscriptions / none (http reports/s)",
                    with_hooks.rate / without.rate if without.rate else 0.0,
                    WEBHOOK_TARGET,
                    h.cost_ratio(with_hooks, without),
                )
            )
        report.ratio(h.Ratio("http reports/s (closed loop)", http.rate, TARGET_RATE))
        report.ratio(h.Ratio("http p99 ms (closed loop)", http.ms(99), TARGET_P99_MS, at_least=False))
        if pruning is not None:
            report.ratio(
                h.Ratio(
                    "http p99 ms while pruning (closed loop)", pruning.ms(99), TARGET_P99_MS, at_least=False
                )
            )
        for attr, label in (("server_cpu", "server"), ("db_cpu", "PostgreSQL")):
            v = http.per_op(attr)
            if v is not None:
                report.ratio(h.Ratio(f"{label} CPU ms per report", v, TARGET_CPU_MS, at_least=False))
        if opened is not None:
            report.ratio(
                h.Ratio(
                    f"open loop at {opened.offered:,.0f}/s keeps up (1 = yes)", float(opened.keeps_up), 1.0
                )
            )
        report.finish(args.json)
        return 1 if any(s.errors for s in samples if s is not (opened and opened.sample)) else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replica:
        from bench.replica import run_replica

        return h.main(run_replica, args)
    return h.main(run, args)


if __name__ == "__main__":
    raise SystemExit(main())
