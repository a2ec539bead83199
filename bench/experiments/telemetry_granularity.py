"""Experiment: what a steady agent report costs the log itself (`mf_append`, no projections) when
its telemetry is 9 events (today: 1 HOST_TELEMETRY_OBSERVED + 8 ACCELERATOR_TELEMETRY_OBSERVED,
each row with its own copy of the report's metadata) or ONE event carrying the same payloads, and
when reports are appended one transaction each (today) or 8 reports (8 streams) per transaction.

    python -m bench.experiments.telemetry_granularity [--reports 2000]

Same bytes of telemetry in every variant; `mf_append` is called directly (a one-event report uses
a type the catalog does not have yet, `REPORT_TELEMETRY_OBSERVED`, which mf_append does not
check); 8 tasks over a pool of 4, interleaved rounds, one database. Prints the CPU per report of
this process (encoding, round trips) and of the PostgreSQL backends, and the WAL per report.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
import uuid
from datetime import UTC, datetime

import msgspec

from bench._common import bench_database_name, create_database, drop_database, node_key, server_dsn
from bench.ledger import POOL, TASKS, Measurement, Node, ServerMeter, report_events
from ledger.db import create_pool, migrate
from ledger.events import SCHEMA_VERSION
from ledger.node import node_id_for

APPEND = "SELECT * FROM mf_append($1, $2, $3, $4, $5, $6, $7, $8, $9)"


def encoded_report(node: Node, rng: random.Random) -> tuple[list[str], list[bytes], bytes]:
    """(types, payloads, metadata) of one steady report: the 9 telemetry events of bench.ledger's
    workload (its flapping status event dropped)."""
    events = [e for e in report_events(node, rng, datetime.now(UTC)) if e.event_class == "observation"]
    return (
        [e.event_type for e in events],
        [msgspec.json.encode(e.payload) for e in events],
        msgspec.json.encode(events[0].metadata),
    )


async def append(
    conn: object, stream: str, types: list[str], data: list[bytes], meta: bytes, one: bool
) -> None:
    if one:
        types = ["REPORT_TELEMETRY_OBSERVED"]
        data = [b'{"event_type":"REPORT_TELEMETRY_OBSERVED","events":[' + b",".join(data) + b"]}"]
    n = len(types)
    await conn.fetch(  # type: ignore[attr-defined]
        APPEND,
        stream,
        None,
        [uuid.uuid4() for _ in range(n)],
        types,
        ["observation"] * n,
        [SCHEMA_VERSION] * n,
        [msgspec.Raw(d) for d in data],
        [msgspec.Raw(meta)] * n,
        False,
    )


async def run(reports: int, rounds: int) -> int:
    server = server_dsn()
    name = bench_database_name("gran")
    dsn = await create_database(server, name)
    try:
        pool = await create_pool(dsn, min_size=POOL, max_size=POOL)
        async with pool.acquire() as conn:
            await migrate(conn)
        rng = random.Random(5)
        nodes = [Node(i, node_id_for(node_key(i)), 0) for i in range(256)]
        work = [(n.node_id, *encoded_report(n, rng)) for n in nodes for _ in range(max(1, reports // 256))]
        variants = {
            "9 events/report, 1 report/transaction (today)": (False, 1),
            "1 event/report,  1 report/transaction": (True, 1),
            "9 events/report, 8 reports/transaction": (False, 8),
            "1 event/report,  8 reports/transaction": (True, 8),
        }
        ms = {k: Measurement(k) for k in variants}
        # Warm-up and plans: a first pass, then ANALYZE (the steady state autovacuum gives).
        for one, _ in variants.values():
            async with pool.acquire() as conn, conn.transaction():
                for stream, types, data, meta in work[:64]:
                    await append(conn, stream, types, data, meta, one)
        async with pool.acquire() as conn:
            await conn.execute("ANALYZE")
        meter = await ServerMeter.open(server, [name])
        try:
            for r in range(rounds):
                for key, (one, per_tx) in variants.items():
                    part = work[r * len(work) // rounds : (r + 1) * len(work) // rounds]
                    tasks = [part[t::TASKS] for t in range(TASKS)]

                    async def worker(items: list, one: bool = one, per_tx: int = per_tx) -> None:
                        for i in range(0, len(items), per_tx):
                            async with pool.acquire() as conn, conn.transaction():
                                for stream, types, data, meta in items[i : i + per_tx]:
                                    await append(conn, stream, types, data, meta, one)

                    before = await meter.snapshot()
                    t0, c0 = time.perf_counter(), time.process_time()
                    await asyncio.gather(*(worker(t) for t in tasks))
                    ms[key].add(len(part), time.perf_counter() - t0, time.process_time() - c0)
                    ms[key].add_server(before, await meter.snapshot())
        finally:
            await meter.close()
            await pool.close()
        print(f"mf_append alone, {len(work):,} steady reports per variant, {TASKS} tasks, pool of {POOL}")
        print(
            f"  {'variant':<48} {'reports/s':>9}  per report: {'client us':>9} {'server us':>9} {'WAL B':>7}"
        )
        for m in ms.values():
            n = max(1, m.events)
            srv = "n/a" if m.server_cpu_seconds is None else f"{1e6 * m.server_cpu_seconds / n:.0f}"
            print(
                f"  {m.name:<48} {m.rate:>9,.0f}  {'':12}{1e6 * m.cpu_seconds / n:>9.0f} {srv:>9} "
                f"{m.wal_bytes / n:>7,.0f}"
            )
        return 0
    finally:
        await drop_database(server, name)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reports", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args()
    raise SystemExit(asyncio.run(run(a.reports, a.rounds)))
