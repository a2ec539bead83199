"""Telemetry history benchmark: one GPU's 24 h of retained samples, read through the real HTTP
server, against the same server's `GET accelerators/{id}` as the baseline.

    python -m bench.history             # 1,000 nodes x 8 GPUs, 200 requests per endpoint
    python -m bench.history --quick     # a smoke run: 100 nodes, 20 requests per endpoint

1. Fill (untimed) a throwaway database as bench.api does (`--fill fold`): every node observed once,
   its read models and events COPYed in. Then ONE node gets `--hours` (24) of
   NODE_TELEMETRY_OBSERVED every `--interval` (10) s, observed and received over the last 24 h,
   COPYed into the log's day segments (made ahead as the server makes them), so the history's
   index search and segment pruning meet a realistic log. Then VACUUM ANALYZE.
2. Serve the product as an operator starts it (`modelforge-hw serve`).
3. Sequential requests on one keep-alive connection, interleaved in rounds: the baseline
   `GET /api/v1/hardware/accelerators/{id}`, then
   `GET .../accelerators/{id}/telemetry?since=now-24h&until=now` with the default step and with
   `step=60`. Every history response must count every sample of the window.
4. The baseline GET on a second connection while the first reads the history back to back: what a
   chart being read costs every other request of the server (an agent's report waits on the same
   event loop).

Also measured around each round of each endpoint: the CPU the server process and the
database's PostgreSQL backends spent per request (`/proc`, as every benchmark here measures it),
which moves much less with the machine's other load than a latency does.

Targets: the 24 h history p99 < 100 ms (with the default step); the GET beside history reads
p99 < 100 ms, the agents' reports' own p99 target (bench.ingest).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec

from bench import harness as h
from bench.api import EVENT_COLUMNS, STEADY_LIVENESS, fill_by_fold
from bench.fleet import node_key, node_observation
from bench.servers import OPERATOR_TOKEN, HttpConnection, Process, bearer, start_product_server, workdir

TARGET_P99_MS = 100.0
# Distinct snapshots cycled through the day: values vary as a GPU's do, without reconciling every
# one of the day's samples.
VARIETY = 64


def snapshots(node: int, count: int, seed: int) -> list[Any]:
    """`count` NODE_TELEMETRY_OBSERVED payloads of node `node` as `reconcile` writes them."""
    from collectors.identity import NodeIdentity
    from domain.node import NodeState, node_id_for
    from domain.reconcile import reconcile
    from ledger.events import NodeTelemetryObserved

    node_id, rng = node_id_for(node_key(node)), random.Random(seed)
    out: list[Any] = []
    for _ in range(min(count, VARIETY)):
        payloads = reconcile(
            node_observation(node, rng),
            NodeState(node_id=node_id),
            NodeIdentity(node_key(node), "configured"),
        )
        out.extend(p for p in payloads if isinstance(p, NodeTelemetryObserved))
    return out


async def fill_history(pool: Any, node: int, hours: float, interval: float, now: datetime) -> tuple[str, int]:
    """Append node `node`'s snapshots every `interval` s over the `hours` before `now` to its
    stream, each in the day segment of its receive time; returns the node id and the count."""
    from domain.node import node_id_for
    from ledger.compact import gpu_set
    from ledger.events import SCHEMA_VERSION, EventMetadata, NewEvent
    from ledger.gpu_sets import GpuSets
    from ledger.stored_form import stored_form

    node_id = node_id_for(node_key(node))
    count = int(hours * 3600 / interval)
    payloads = snapshots(node, count, 20261203)
    start = now - timedelta(hours=hours)
    rng = random.Random(7)
    async with pool.acquire() as conn, conn.transaction():
        await conn.fetch(
            "SELECT mf_ensure_segments($1::date, $2::date)", start.date(), (now + timedelta(days=1)).date()
        )
        days = {r["day"] for r in await conn.fetch("SELECT day FROM event_segments")}
        position = await conn.fetchval("SELECT max(global_position) FROM events")
        version = await conn.fetchval("SELECT version FROM streams WHERE stream_id = $1", node_id)
        # The GPU sets the snapshots name, stored as the server stores them (formats 3 and 4).
        usable = await GpuSets().usable(conn, [gpu_set(p) for p in payloads])
        rows: list[tuple[Any, ...]] = []
        for k in range(count):
            # Observed mid-interval (inside the window however `now` is rounded), received up to
            # two seconds later, as an agent's report arrives.
            observed = start + timedelta(seconds=(k + 0.5) * interval)
            received = observed + timedelta(seconds=rng.uniform(0.05, 2.0))
            meta = EventMetadata(
                received_at=received,
                source="agent",
                observed_at=observed,
                agent_stream="telemetry",
                agent_sequence=2 + k,
            )
            e = NewEvent(payload=payloads[k % len(payloads)], metadata=meta)
            day = received.astimezone(UTC).date()
            assert day in days, f"no segment for {day}"  # made above, as the server makes them ahead
            stored = stored_form(e, node_id, usable)
            rows.append(
                (
                    position + 1 + k, e.event_id, node_id, version + 1 + k, e.event_type, e.event_class,
                    SCHEMA_VERSION, None if stored.data is None else msgspec.Raw(stored.data),
                    None if stored.metadata_json is None else msgspec.Raw(stored.metadata_json),
                    stored.body, stored.sampled, received, received, day,
                )
            )  # fmt: skip
        await conn.copy_records_to_table("events", records=rows, columns=[*EVENT_COLUMNS, "segment"])
        await conn.execute("UPDATE streams SET version = $2 WHERE stream_id = $1", node_id, version + count)
        await conn.execute(
            "SELECT setval(pg_get_serial_sequence('events', 'global_position'), $1)", position + count
        )
    return node_id, count


async def stored_hours(dsn: str, node_id: str, start: datetime, snapshots: int) -> int:
    """Wait for the server to store the node's closed hours (ledger/telemetry_hours.py: it does
    so in the background, the newest first, as after an upgrade); print how long that took and
    what the stored hours cost per snapshot beside the log's own rows. The hours stored."""
    import asyncpg

    from ledger.telemetry_hours import GRACE, HOUR, floor_hour

    t0 = time.perf_counter()
    conn = await asyncpg.connect(dsn)
    try:
        while True:
            closed = floor_hour(datetime.now(UTC) - GRACE) - floor_hour(start)
            wanted = int(closed / HOUR)
            got = await conn.fetchval(
                "SELECT count(*) FROM telemetry_hours WHERE node_id = $1 AND subject = ''", node_id
            )
            if got >= wanted or time.perf_counter() - t0 > 900:
                break
            await asyncio.sleep(0.5)
        rows = await conn.fetchrow(
            "SELECT pg_total_relation_size('telemetry_hours') AS hours_bytes, "
            "(SELECT coalesce(sum(observations), 0) FROM telemetry_hours WHERE subject = '') AS held"
        )
    finally:
        await conn.close()
    per = rows["hours_bytes"] / max(1, rows["held"])
    print(f"telemetry hours: {got} of {wanted} closed hours stored by the server in "
          f"{time.perf_counter() - t0:.0f} s; {rows['hours_bytes']:,} B in all, {per:,.0f} B per "
          f"snapshot they hold ({rows['held']:,} of {snapshots:,})")  # fmt: skip
    return int(got)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__)
    p.add_argument("--nodes", type=int, default=1_000, help="nodes of 8 GPUs (default 1,000)")
    p.add_argument("--hours", type=float, default=24.0, help="hours of one node's history (default 24)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between its samples (default 10)")
    p.add_argument("--requests", type=int, default=200, help="requests per endpoint (default 200)")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default 4)")
    p.add_argument(
        "--from-log",
        action="store_true",
        help="serve with telemetry hours off: every read decodes the log's snapshots",
    )
    return h.parse_sized(p, argv, {"nodes": 100, "requests": 20, "rounds": 2})


async def timed(conn: HttpConnection, path: str, n: int, sample: h.Sample) -> bytes:
    """`n` sequential GETs of `path`; their latencies into `sample`; the last body."""
    body = b""
    for _ in range(n):
        t0 = time.perf_counter()
        status, body = await conn.request(b"GET", path.encode(), bearer(OPERATOR_TOKEN))
        sample.latencies.append(time.perf_counter() - t0)
        sample.ops += 1
        if status != 200:
            sample.error(f"GET {path}: {status} {body[:200]!r}")
    return body


async def beside_history(port: int, base: str, history: str, n: int) -> h.Sample:
    """The trivial GET's latencies on a second connection while the first reads the history back
    to back: what a chart someone is looking at costs the server's other requests (an agent's
    report waits on the same event loop)."""
    other = await HttpConnection.open(port)
    reader = await HttpConnection.open(port)
    sample = h.Sample("baseline: GET accelerators/{id}, beside history reads")
    stop = False

    async def read() -> None:
        while not stop:
            status, body = await reader.request(b"GET", history.encode(), bearer(OPERATOR_TOKEN))
            if status != 200:
                sample.error(f"GET {history}: {status} {body[:200]!r}")

    task = asyncio.ensure_future(read())
    try:
        await asyncio.sleep(0.2)
        for _ in range(n):
            await timed(other, base, 1, sample)
            await asyncio.sleep(0.005)  # a request now and then, as reports come, not back to back
    finally:
        stop = True
        await task
        other.close()
        reader.close()
    return sample


def iso(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def run(args: argparse.Namespace) -> int:
    from ledger.db import create_pool
    from ledger.schema import migrate
    from projections.inventory import ALL_PROJECTIONS
    from projections.rebuild import rebuild_outdated

    report = h.Report("history")
    await h.describe_environment(report, "telemetry history")
    async with (
        h.throwaway_database("history", keep=args.keep) as db,
        workdir("history", keep=args.keep) as work,
    ):
        server: Process | None = None
        try:
            now = datetime.now(UTC).replace(microsecond=0)
            pool = await create_pool(db.dsn, min_size=1, max_size=4)
            try:
                async with pool.acquire() as conn:
                    await migrate(conn)
                await rebuild_outdated(pool, ALL_PROJECTIONS)
                t0 = time.perf_counter()
                events = await fill_by_fold(pool, args.nodes, random.Random(20261130))
                node_id, count = await fill_history(pool, 0, args.hours, args.interval, now)
                async with pool.acquire() as conn:
                    await conn.execute("VACUUM ANALYZE")
                    accelerator = await conn.fetchval(
                        "SELECT min(accelerator_id) FROM hw_accelerators WHERE node_id = $1", node_id
                    )
                    segments = await conn.fetchval("SELECT count(*) FROM event_segments")
            finally:
                await pool.close()
            print(f"fill: {args.nodes:,} nodes ({events:,} events), then {count:,} snapshots of one node over "
                  f"{args.hours:g} h, {segments} day segments, in {time.perf_counter() - t0:.0f} s (untimed)")  # fmt: skip

            hours = {"MODELFORGE_TELEMETRY_HOURS_INTERVAL": "0"} if args.from_log else {}
            server = await start_product_server(
                db.dsn, work, "server", log_level="WARNING", settings={**STEADY_LIVENESS, **hours}
            )
            if not args.from_log:
                await stored_hours(db.dsn, node_id, now - timedelta(hours=args.hours), count)
            base = f"/api/v1/hardware/accelerators/{accelerator}"
            window = f"since={iso(now - timedelta(hours=args.hours))}&until={iso(now)}"
            endpoints = [
                (h.Sample("baseline: GET accelerators/{id}"), base),
                (h.Sample(f"telemetry history {args.hours:g}h (default step)"), f"{base}/telemetry?{window}"),
                (
                    h.Sample(f"telemetry history {args.hours:g}h (step=60)"),
                    f"{base}/telemetry?{window}&step=60",
                ),
            ]
            meter = await h.Meter.open([db.name], [server.pid])
            conn = await HttpConnection.open(server.port)
            try:
                # Correctness before speed (and one warm-up each): every sample of the window counted.
                for sample, path in endpoints:
                    body = await timed(conn, path, 1, h.Sample("warm-up"))
                    if "telemetry" in path:
                        got = msgspec.json.decode(body)
                        # The node's first report (the fleet fill's) may fall in the window too.
                        assert count <= got["samples"] <= count + 1, (
                            f"{path}: {got['samples']} samples, not {count}"
                        )
                        sample.units = got["step_seconds"]
                        print(f"{sample.name}: {len(got['series'])} series x "
                              f"{len(got['series'][0]['points']) if got['series'] else 0} points, "
                              f"step {got['step_seconds']} s, {len(body) / 1e3:.0f} kB")  # fmt: skip
                per_round = max(1, args.requests // args.rounds)
                print(f"load: one client, sequential, {per_round} requests per endpoint x {args.rounds} "
                      f"round(s), interleaved")  # fmt: skip
                for _ in range(args.rounds):
                    for sample, path in endpoints:
                        _, usage = await meter.measure(timed(conn, path, per_round, sample))
                        sample.usage = sample.usage + usage
                beside = await beside_history(server.port, endpoints[0][1], endpoints[1][1], args.requests)
            finally:
                conn.close()
                await meter.close()

            h.table(
                ["endpoint", "requests", "req/s", "p50 ms", "p99 ms", "errors", "server ms", "PG ms"],
                [
                    [
                        s.name,
                        s.ops,
                        s.rate,
                        s.ms(50),
                        s.ms(99),
                        s.errors,
                        s.per_op("server_cpu"),
                        s.per_op("db_cpu"),
                    ]
                    for s, _ in endpoints
                ],
            )
            print("(CPU per request: server = the serve process, PG = the database's backends)")
            print(f"{beside.name}: p50 / p99 {beside.ms(50):.1f} / {beside.ms(99):.1f} ms "
                  f"({beside.ops} requests; alone: {endpoints[0][0].ms(50):.1f} / {endpoints[0][0].ms(99):.1f} ms)")  # fmt: skip
            baseline = endpoints[0][0]
            print()
            for s, _ in endpoints[1:]:
                print(f"{s.name} p50 / p99: {s.ms(50):.1f} / {s.ms(99):.1f} ms")
                print(f"{s.name} p99 / baseline p99: {s.ms(99) / baseline.ms(99):.1f}x")
                cpu, db = s.per_op("server_cpu"), s.per_op("db_cpu")
                if cpu is not None and db is not None:
                    print(f"{s.name} CPU per request: server {cpu:.1f} ms, PostgreSQL {db:.1f} ms")
            for s, _ in endpoints:
                report.row(**s.as_row())
            for s, _ in endpoints[1:]:
                report.ratio(h.Ratio(f"{s.name} p99 ms", s.ms(99), TARGET_P99_MS, at_least=False))
                report.ratio(h.Ratio(f"{s.name} p99 / baseline p99", s.ms(99) / baseline.ms(99), None))
                cpu = s.per_op("server_cpu")
                if cpu is not None:
                    report.ratio(h.Ratio(f"{s.name} server CPU ms per request", cpu, None))
            report.row(**beside.as_row())
            report.ratio(h.Ratio(f"{beside.name} p99 ms", beside.ms(99), TARGET_P99_MS, at_least=False))
            report.finish(args.json)
            for s, _ in endpoints:
                for e in s.error_samples:
                    print(f"error: {e}")
            for e in beside.error_samples:
                print(f"error: {e}")
            return 1 if beside.errors or any(s.errors for s, _ in endpoints) else 0
        finally:
            if server is not None:
                server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    return h.main(run, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
