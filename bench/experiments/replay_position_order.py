"""Experiment: a fleet-wide point-in-time reconstruction that reads the log in global order,
against the product's `projections.pointintime.inventory_as_of`, on bench/replay.py's log.

    python -m bench.experiments.replay_position_order [--quick] [--reuse DATABASE] [--keep]

The product reads the fleet's events in (stream_id, stream_version) order, through the unique
index on those columns: a stream's events are spread over the whole heap (every node reports
every 10 s), so each row costs a heap page of its own (random reads once the log outgrows
shared_buffers), and reading and folding alternate (fetch 5,000, fold them, fetch the next).
The variant:

1. reads `WHERE global_position > $last AND global_position <= $upper ORDER BY global_position`
   (the primary key, i.e. the heap's own order: sequential pages), with `$upper` the largest
   position recorded at or before the moment (one probe of `events_recorded_at_idx`), keeps one
   folded state per stream in a dict, and applies the same `recorded_at <= as_of` filter;
   within a stream, global positions follow stream versions (both are taken under the stream
   lock), so each stream still folds in version order;
2. asks for batch n+1 before folding batch n, so PostgreSQL produces rows while Python folds.

The result is checked equal (every NodeState, and the position) to the product's.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import datetime
from typing import Any

import asyncpg

from bench import replay
from bench._common import bench_database_name, create_database, drop_database, dsn_for_database, server_dsn

_COLUMNS = (
    "global_position, stream_id, stream_version, event_id, event_type, event_class, schema_version, "
    "data::text AS data_json, metadata::text AS metadata_json, recorded_at"
)
_BATCH = 2000


async def inventory_as_of_by_position(conn: asyncpg.Connection, as_of: datetime) -> Any:
    from ledger.store import event_from_row
    from projections.inventory import INVENTORY
    from projections.pointintime import InventoryAsOf

    states: dict[str, Any] = {}
    position = 0
    sql = (
        f"SELECT {_COLUMNS} FROM events WHERE global_position > $1 AND global_position <= $2 "
        "AND recorded_at <= $3 ORDER BY global_position LIMIT $4"
    )
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        upper = await conn.fetchval(
            "SELECT coalesce(max(global_position), 0) FROM events WHERE recorded_at <= $1", as_of
        )
        pending = asyncio.ensure_future(conn.fetch(sql, 0, upper, as_of, _BATCH))
        while True:
            rows = await pending
            if not rows:
                break
            # Ask for the next batch now: PostgreSQL reads it while this one is folded.
            pending = asyncio.ensure_future(
                conn.fetch(sql, rows[-1]["global_position"], upper, as_of, _BATCH)
            )
            await asyncio.sleep(0)
            for row in rows:
                event = event_from_row(row)
                sid = event.stream_id
                if not INVENTORY.handles(sid):
                    continue
                state = states.get(sid)
                states[sid] = INVENTORY.fold(state if state is not None else INVENTORY.initial(sid), event)
                if event.global_position > position:
                    position = event.global_position
    nodes = [states[k] for k in sorted(states) if states[k].discovered]
    return InventoryAsOf(as_of=as_of, position=position, nodes=nodes)


async def scan_by_position(conn: asyncpg.Connection, as_of: datetime) -> int:
    """The same rows in global order, decoded, not folded (this order's own ceiling)."""
    from ledger.events import decode_metadata, decode_payload

    n, last = 0, 0
    sql = (
        "SELECT global_position, stream_id, stream_version, event_id, event_type, event_class, "
        "schema_version, data::text AS data_json, metadata::text AS metadata_json, recorded_at FROM events "
        "WHERE global_position > $1 AND recorded_at <= $2 ORDER BY global_position LIMIT $3"
    )
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        while True:
            rows = await conn.fetch(sql, last, as_of, replay.SCAN_BATCH)
            if not rows:
                break
            for row in rows:
                decode_payload(row["data_json"])
                decode_metadata(row["metadata_json"])
            n += len(rows)
            last = rows[-1]["global_position"]
    return n


async def run(args: argparse.Namespace) -> int:
    from ledger.db import create_pool
    from projections.pointintime import inventory_as_of

    server = server_dsn()
    db = args.reuse or bench_database_name("replayx")
    dsn = dsn_for_database(server, db) if args.reuse else await create_database(server, db)
    pool = None
    try:
        pool = await create_pool(dsn, min_size=1, max_size=2)
        builder, phases = await replay.open_log(args, pool)
        await replay.describe_log(pool, builder, phases)
        points = [("end", builder.end_of_log()), ("mid", builder.middle())]
        t: dict[tuple[str, str], replay.Timing] = {}
        ok = True
        async with pool.acquire() as conn:
            await replay.warm_cache(conn)
            for point, at in points:
                folded = await conn.fetchval("SELECT count(*) FROM events WHERE recorded_at <= $1", at)
                for key, work in (
                    ("product: inventory_as_of", lambda at=at: inventory_as_of(conn, at)),
                    ("variant: global order, prefetch", lambda at=at: inventory_as_of_by_position(conn, at)),
                    ("ceiling: (stream, version) scan + decode", lambda at=at: replay.scan(conn, at, None)),
                    ("ceiling: global-order scan + decode", lambda at=at: scan_by_position(conn, at)),
                ):
                    timing = t.setdefault((point, key), replay.Timing(key))
                    for _ in range(max(1, args.repeat)):
                        result, *m = await replay.timed(conn, work())
                        timing.add(folded, *m)
                        if key.startswith("product"):
                            expected = result
                        elif key.startswith("variant"):
                            same = result.position == expected.position and result.nodes == expected.nodes
                            ok &= same
                            print(
                                f"  {point}: variant's {len(result.nodes):,} nodes == the product's: {same}"
                            )
        print(
            f"\n  {'as of':<6} {'':<42} {'events':>9} {'seconds':>8} {'events/s':>9}  "
            f"CPU us/event: {'client':>6} {'server':>6}"
        )
        for (point, key), timing in t.items():
            c, sv = timing.cpu_us()
            print(
                f"  {point:<6} {key:<42} {timing.events:>9,} {min(timing.seconds):>8.2f} "
                f"{timing.rate():>9,.0f}  {'':13} {c:>6.1f} {'n/a' if sv is None else f'{sv:.1f}':>6}"
            )
        for point, _ in points:
            p = t[(point, "product: inventory_as_of")].rate()
            v = t[(point, "variant: global order, prefetch")].rate()
            s = t[(point, "ceiling: (stream, version) scan + decode")].rate()
            print(
                f"  {point}: variant / product {v / p:.2f}x; product / ceiling {p / s:.2f}; variant / ceiling {v / s:.2f}"
            )
        return 0 if ok else 1
    finally:
        if pool is not None:
            await pool.close()
        if args.keep or args.reuse:
            print(f"kept database: {db}")
        else:
            await drop_database(server, db)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=10_000)
    p.add_argument("--reports", type=int, default=9)
    p.add_argument("--hot-hours", type=float, default=24.0)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="1,000 nodes, a 2.4 h hot node")
    p.add_argument("--reuse", metavar="DATABASE", help="a log kept by `python -m bench.replay --keep`")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.nodes, args.hot_hours = 1000, 2.4
    return asyncio.run(run(args))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
