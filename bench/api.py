"""HTTP API benchmark: read throughput and latency of `modelforge-hw serve` with
10,000 nodes x 8 GPUs, against a trivial route's ceiling, with `wrk` as the load generator.

    python -m bench.api                 # 10,000 nodes, 2 rounds x 10 s per endpoint
    python -m bench.api --quick         # under 2 minutes: 10,000 nodes, 2 rounds x 3 s
    (wrk: apt-get update && apt-get install -y wrk)

1. Fill (untimed) the read models of a throwaway database: every node a realistic eight-GPU server
   observed once and reconciled by the product's `reconcile`; `--fill fold` (default) folds the
   events with the inventory projection's own `fold`/`rows` (what `rebuild` does) and COPYs the
   rows into the live tables and the events into the log (a GPU's telemetry row points at the
   event holding its sample);
   `--fill append` goes through `EventStore.append` instead (slower). Then VACUUM ANALYZE.
2. Serve: the product as an operator starts it (`modelforge-hw serve`), with stale and offline
   after an hour and two (the fill's nodes report once: with the default 60 s their liveness
   would change during the rounds, and every rendering with it), and the ceiling, a trivial Litestar
   app (`GET /ping`) under uvicorn with the same settings, each in its own process.
3. Walk every page of `GET /api/v1/hardware/accelerators?limit=100` by cursor (each accelerator
   exactly once), then `wrk` (1 thread, `--connections` keep-alive connections, closed loop) on
   the ceiling, the accelerator pages (round robin over the walked cursors) and
   `GET /api/v1/hardware/nodes/{id}` (every node, shuffled), interleaved in rounds.
4. One `GET /metrics` of the whole fleet, with a probe of `GET /api/v1/health/live` every 20 ms
   meanwhile: the scrape's time, size and server CPU, and the longest the probe waited.

Targets: accelerator pages and node by id each >= 0.5 of the ceiling's requests/s,
p99 < 50 ms.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # `python bench/api.py`: this file would shadow the `api` package; use the repository root.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import asyncio
import random
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec

from bench import harness as h
from bench.fleet import node_key, node_observation
from bench.servers import (
    OPERATOR_TOKEN,
    HttpConnection,
    Process,
    bearer,
    free_port,
    spawn,
    start_product_server,
    workdir,
)
from bench.wrk import require_wrk, run_wrk

TARGET_RATIO, TARGET_P99_MS = 0.5, 50.0
STEADY_LIVENESS = {"MODELFORGE_STALE_AFTER": "3600", "MODELFORGE_OFFLINE_AFTER": "7200"}


def node_events(i: int, rng: random.Random, now: datetime) -> tuple[str, list[Any]]:
    """Node `i`'s first report as the ledger stores it: discovery plus telemetry, by `reconcile`."""
    from collectors.identity import NodeIdentity
    from domain.node import NodeState, node_id_for
    from domain.reconcile import reconcile
    from ledger.events import EventMetadata, NewEvent

    node_id = node_id_for(node_key(i))
    payloads = reconcile(
        node_observation(i, rng), NodeState(node_id=node_id), NodeIdentity(node_key(i), "configured")
    )
    at = now - timedelta(seconds=rng.uniform(0, 30))
    meta = EventMetadata(
        received_at=at, source="agent", observed_at=at, agent_stream="telemetry", agent_sequence=1
    )
    return node_id, [NewEvent(payload=p, metadata=meta) for p in payloads]


async def fill_by_fold(pool: Any, nodes: int, rng: random.Random) -> int:
    """Fold each node's events with the inventory projection and COPY its rows into the live
    tables (what `rebuild` does into shadows); returns the events folded."""
    from ledger.compact import gpu_set
    from ledger.events import SCHEMA_VERSION, NodeTelemetryObserved, RecordedEvent
    from ledger.gpu_sets import GpuSets
    from ledger.stored_form import stored_form
    from projections.framework import STATE_TABLE
    from projections.inventory import INVENTORY

    specs = {t.name: t for t in INVENTORY.tables}
    rows: dict[str, list[tuple[Any, ...]]] = {name: [] for name in specs}
    # The events too, stored as the log stores them: a GPU's telemetry row points at the event
    # that holds its sample, which the reads take from there (api/services/reads/samples.py).
    log: list[tuple[Any, ...]] = []
    states: list[tuple[Any, ...]] = []
    streams: list[tuple[Any, ...]] = []
    position = total = 0
    now = datetime.now(UTC)
    sets = GpuSets()

    async def flush(conn: Any) -> None:
        for table, batch in rows.items():
            if batch:
                await conn.copy_records_to_table(table, records=batch, columns=list(specs[table].columns))
                batch.clear()
        for table, batch, columns in (
            ("events", log, list(EVENT_COLUMNS)),
            (STATE_TABLE, states, ["projection", "stream_id", "stream_version", "position", "state"]),
            ("streams", streams, ["stream_id", "version", "lifecycle_version"]),
        ):
            if batch:
                await conn.copy_records_to_table(table, records=batch, columns=columns)
                batch.clear()

    async with pool.acquire() as conn, conn.transaction():
        for i in range(nodes):
            node_id, new = node_events(i, rng, now)
            # The GPU sets the snapshots name, stored as the server stores them (formats 3 and 4).
            usable = await sets.usable(
                conn, [gpu_set(e.payload) for e in new if isinstance(e.payload, NodeTelemetryObserved)]
            )
            recorded = []
            for version, e in enumerate(new, start=1):
                position += 1
                recorded.append(
                    RecordedEvent(
                        global_position=position, stream_id=node_id, stream_version=version, event_id=e.event_id,
                        event_type=e.event_type, event_class=e.event_class, schema_version=SCHEMA_VERSION,
                        payload=e.payload, metadata=e.metadata, recorded_at=e.metadata.received_at,
                    )
                )  # fmt: skip
                stored = stored_form(e, node_id, usable)
                log.append(
                    (
                        position, e.event_id, node_id, version, e.event_type, e.event_class, SCHEMA_VERSION,
                        None if stored.data is None else msgspec.Raw(stored.data),
                        None if stored.metadata_json is None else msgspec.Raw(stored.metadata_json),
                        stored.body, stored.sampled,
                        e.metadata.received_at, e.metadata.received_at,
                    )
                )  # fmt: skip
            state = INVENTORY.fold_all(INVENTORY.initial(node_id), recorded)
            for table, table_rows in INVENTORY.rows(state).items():
                rows[table].extend(table_rows)
            version, pos = INVENTORY.checkpoint_of(state)
            states.append((INVENTORY.name, node_id, version, pos, INVENTORY.encode_state(state)))
            lifecycle = sum(e.event_class == "lifecycle" for e in new)
            streams.append((node_id, len(recorded), lifecycle))
            total += len(recorded)
            if len(states) >= 500:
                await flush(conn)
        await flush(conn)
        # COPY wrote the positions itself: later appends must not take them again.
        await conn.execute("SELECT setval(pg_get_serial_sequence('events', 'global_position'), $1)", position)
    return total


EVENT_COLUMNS = (
    "global_position", "event_id", "stream_id", "stream_version", "event_type", "event_class",
    "schema_version", "data", "metadata", "body", "sampled", "recorded_at", "received_at",
)  # fmt: skip


async def fill_by_append(pool: Any, nodes: int, rng: random.Random, tasks: int = 8) -> int:
    from ledger.store import EventStore
    from projections.inventory import ALL_PROJECTIONS

    store, now, total = EventStore(pool, ALL_PROJECTIONS), datetime.now(UTC), 0

    async def worker(t: int) -> None:
        nonlocal total
        for i in range(t, nodes, tasks):
            node_id, events = node_events(i, rng, now)
            await store.append(node_id, 0, events)
            total += len(events)

    await asyncio.gather(*(worker(t) for t in range(tasks)))
    return total


def serve_ceiling(port: int) -> int:
    """`python -m bench.api _ceiling PORT`: the trivial route, under uvicorn as `serve` runs the app."""
    import uvicorn
    from litestar import Litestar, get

    @get("/ping")
    async def ping() -> dict[str, str]:
        return {"status": "ok"}

    app = Litestar(route_handlers=[ping], debug=False)
    uvicorn.run(app, host="127.0.0.1", port=port, log_config=None, access_log=False, lifespan="on")
    return 0


async def walk_pages(port: int, limit: int) -> tuple[list[str], int, list[float]]:
    """Follow next_cursor from the first page to the last; every accelerator must come once."""
    conn = await HttpConnection.open(port)
    path = f"/api/v1/hardware/accelerators?limit={limit}"
    paths: list[str] = []
    seen: set[str] = set()
    latencies: list[float] = []
    try:
        while path:
            t0 = time.perf_counter()
            status, body = await conn.request(b"GET", path.encode(), bearer(OPERATOR_TOKEN))
            latencies.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"GET {path}: {status} {body[:300]!r}")
            page = msgspec.json.decode(body)
            ids = [a["id"] for a in page["items"]]
            if seen.intersection(ids):
                raise RuntimeError(f"paging repeated accelerators at {path}")
            seen.update(ids)
            paths.append(path)
            cursor = page.get("next_cursor")
            path = f"/api/v1/hardware/accelerators?limit={limit}&cursor={cursor}" if cursor else ""
    finally:
        conn.close()
    return paths, len(seen), latencies


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__)
    p.add_argument("--nodes", type=int, default=10_000, help="nodes of 8 GPUs (default 10,000)")
    p.add_argument("--fill", choices=("fold", "append"), default="fold", help="how to fill (default fold)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per endpoint per round (default 10)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--connections", type=int, default=8, help="wrk's keep-alive connections (default 8)")
    p.add_argument("--limit", type=int, default=100, help="accelerator page size (default 100)")
    return h.parse_sized(p, argv, {"rounds": 2, "duration": 3.0})


async def scrape_metrics(report: h.Report, server: Process, meter: h.Meter) -> None:
    """One `GET /metrics` of the whole fleet (what Prometheus asks every scrape interval) while a
    probe asks `GET /api/v1/health/live` every 20 ms on another connection: the scrape's time,
    size and server CPU, and how long the probe waited meanwhile (the server has one event loop:
    what the scrape holds up, agent reports wait for too)."""
    conn, probe_conn = await HttpConnection.open(server.port), await HttpConnection.open(server.port)
    waits: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            t = time.perf_counter()
            status, _ = await probe_conn.request(b"GET", b"/api/v1/health/live")
            assert status == 200
            waits.append(time.perf_counter() - t)
            await asyncio.sleep(0.02)

    try:
        task = asyncio.create_task(probe())
        meter.server_pids = [server.pid]
        (status, size, lines, first), usage = await meter.measure(
            conn.request_counted(b"GET", b"/metrics", bearer(OPERATOR_TOKEN))
        )
        done.set()
        await task
    finally:
        conn.close()
        probe_conn.close()
    assert status == 200, first
    figures = {
        "seconds": usage.seconds,
        "megabytes": size / 1e6,
        "lines": lines,
        "server_cpu_s": usage.server_cpu,
        "probe_p99_ms": 1e3 * h.percentile(waits, 99),
        "probe_max_ms": 1e3 * max(waits),
    }
    report.row(name="GET /metrics (one scrape)", **figures)
    print(f"GET /metrics, one scrape of the fleet: {figures['seconds']:.1f} s, {figures['megabytes']:.0f} MB, "
          f"{figures['lines']:,} lines, server CPU {figures['server_cpu_s'] or 0:.1f} s; GET /health/live every "
          f"20 ms meanwhile waited p99 {figures['probe_p99_ms']:.0f} ms, max {figures['probe_max_ms']:.0f} ms")  # fmt: skip


async def run(args: argparse.Namespace) -> int:
    from ledger.db import create_pool
    from ledger.schema import migrate
    from projections.inventory import ALL_PROJECTIONS
    from projections.rebuild import rebuild_outdated

    require_wrk()
    report = h.Report("api")
    await h.describe_environment(report, "API")
    async with h.throwaway_database("api", keep=args.keep) as db, workdir("api", keep=args.keep) as work:
        processes: list[Process] = []
        meter: h.Meter | None = None
        try:
            pool = await create_pool(db.dsn, min_size=1, max_size=8)
            try:
                async with pool.acquire() as conn:
                    await migrate(conn)
                # As `serve` prepares a database: the read models' shapes recorded (empty here), so
                # the server does not rebuild them from the log.
                await rebuild_outdated(pool, ALL_PROJECTIONS)
                t0 = time.perf_counter()
                fill = fill_by_fold if args.fill == "fold" else fill_by_append
                events = await fill(pool, args.nodes, random.Random(20261130))
                async with pool.acquire() as conn:
                    await conn.execute("VACUUM ANALYZE")
                    node_ids = [r["node_id"] for r in await conn.fetch("SELECT node_id FROM hw_nodes")]
                    accelerators = await conn.fetchval("SELECT count(*) FROM hw_accelerators")
            finally:
                await pool.close()
            print(f"fill ({args.fill}): {len(node_ids):,} nodes, {accelerators:,} accelerators from "
                  f"{events:,} events in {time.perf_counter() - t0:.0f} s (untimed)")  # fmt: skip

            # The fill is one report per node, received over the fill's last 30 s and never again:
            # with the default 60 s, every node turned stale during the measured rounds, and each
            # such change renders that node, and every page, anew. A fleet that reports stays
            # online; so does this one, for the run.
            real = await start_product_server(
                db.dsn, work, "server", log_level="WARNING", settings=STEADY_LIVENESS
            )
            processes.append(real)
            port = free_port()
            argv = [sys.executable, "-m", "bench.api", "_ceiling", str(port)]
            ceiling = await spawn("ceiling", argv, port, "/ping", work, {})
            processes.append(ceiling)

            # Correctness before speed: the guard, one node, every accelerator exactly once by cursor.
            random.Random(1).shuffle(node_ids)
            conn = await HttpConnection.open(real.port)
            try:
                status, _ = await conn.request(b"GET", b"/api/v1/hardware/accelerators?limit=1")
                assert status == 401, "the benchmark must go through the operator guard"
                status, body = await conn.request(
                    b"GET", f"/api/v1/hardware/nodes/{node_ids[0]}".encode(), bearer(OPERATOR_TOKEN)
                )
                assert status == 200 and msgspec.json.decode(body)["id"] == node_ids[0], body[:300]
            finally:
                conn.close()
            t0 = time.perf_counter()
            pages, seen, walk = await walk_pages(real.port, args.limit)
            assert seen == accelerators, f"paging saw {seen} accelerators of {accelerators}"
            print(f"cursor walk: {len(pages)} pages, all {seen:,} accelerators exactly once in "
                  f"{time.perf_counter() - t0:.1f} s by one client (page p50 {1e3 * h.percentile(walk, 50):.1f} ms, "
                  f"max {1e3 * max(walk):.1f} ms)")  # fmt: skip

            endpoints: list[tuple[h.Sample, Process, list[str], str]] = [
                (h.Sample("ceiling: GET /ping"), ceiling, ["/ping"], ""),
                (h.Sample(f"GET accelerators?limit={args.limit} (paged)"), real, pages, OPERATOR_TOKEN),
                (
                    h.Sample("GET nodes/{id}"),
                    real,
                    [f"/api/v1/hardware/nodes/{n}" for n in node_ids],
                    OPERATOR_TOKEN,
                ),
            ]
            print(f"load: wrk, {args.connections} connections, closed loop, {args.duration:.0f} s per endpoint "
                  f"x {args.rounds} round(s), interleaved")  # fmt: skip
            meter = await h.Meter.open([db.name])
            p99s: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                for sample, proc, paths, token in endpoints:
                    meter.server_pids = [proc.pid]
                    run_, usage = await meter.measure(
                        run_wrk(proc.base, paths, args.duration, args.connections, token, work)
                    )
                    usage.seconds, usage.client_cpu = run_.seconds, run_.generator_cpu
                    one = h.Sample(sample.name, ops=run_.requests, errors=run_.errors)
                    # wrk reports percentiles, not every latency: keep its p50/p99 per round.
                    p99s.setdefault(sample.name, []).append(run_.p99_ms)
                    one.latencies = [run_.p50_ms / 1e3]
                    sample.merge(one, usage)

            def p99(s: h.Sample) -> float:
                return max(p99s[s.name])  # the worst round's

            def p50(s: h.Sample) -> float:
                return 1e3 * h.percentile(s.latencies, 50)  # the median round's

            h.table(
                ["endpoint", "req/s", "p50 ms", "p99 ms", "errors", "server ms", "PG ms", "wrk ms"],
                [[s.name, s.rate, p50(s), p99(s), s.errors, s.per_op("server_cpu"), s.per_op("db_cpu"),
                  s.per_op("client_cpu")] for s, *_ in endpoints],
            )  # fmt: skip
            print("  (per request: CPU of the server process, of the database's PostgreSQL backends, of wrk)")
            base = endpoints[0][0]
            for s, *_ in endpoints:
                report.row(**{**s.as_row(), "p50_ms": p50(s), "p99_ms": p99(s)})
            for s, *_ in endpoints[1:]:
                report.ratio(
                    h.Ratio(
                        f"{s.name} / ceiling (req/s)", s.rate / base.rate, TARGET_RATIO, h.cost_ratio(s, base)
                    )
                )
                report.ratio(h.Ratio(f"{s.name} p99 ms", p99(s), TARGET_P99_MS, at_least=False))
            if (base.usage.client_cpu or 0) > 0.5 * (base.usage.server_cpu or 0):
                report.note(
                    "WARNING: wrk used more than half the ceiling server's CPU: the ceiling is capped by the load generator"
                )
            await scrape_metrics(report, real, meter)
            report.finish(args.json)
            return 1 if any(s.errors for s, *_ in endpoints) else 0
        finally:
            if meter is not None:
                await meter.close()
            for proc in processes:
                proc.stop()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_ceiling"]:
        return serve_ceiling(int(argv[1]))
    return h.main(run, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
