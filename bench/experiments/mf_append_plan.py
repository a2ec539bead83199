"""Experiment: the cost of `mf_append` as the log grows, on a connection that first called it while
the log was small (a server's pool right after `migrate` on a new database), then after
`DISCARD PLANS`; and the same on a connection with `plan_cache_mode = force_custom_plan`.

    python -m bench.experiments.mf_append_plan

PL/pgSQL caches each statement's plan per connection, and after five calls keeps a generic plan
when it is not dearer than the custom ones. 51fa880 rewrote the duplicate check as
`SELECT count(*) FROM unnest(p_event_ids) i WHERE EXISTS (SELECT 1 FROM events e WHERE
e.event_id = i.id)`, but its generic plan on a small `events` is still a hash join over a
sequential scan of the whole log (`EXPLAIN EXECUTE` of it prepared with
`plan_cache_mode = force_generic_plan` on an empty `events` shows it), so each append's cost
still grows with the log until something invalidates the plan (an ANALYZE of `events`, which
autovacuum does after ~10 % growth; DISCARD PLANS; a new connection). With custom plans the cost
stays flat (each call then pays its planning).
"""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime

import msgspec

from bench._common import bench_database_name, cpu_of, create_database, drop_database, node_key, server_dsn
from bench.ledger import Node, build_reports
from ledger.db import create_pool, migrate
from ledger.events import SCHEMA_VERSION, validate_metadata, validate_payload
from ledger.node import node_id_for

GENERIC_PLAN_SQL = (
    "SELECT count(*) FROM unnest($1::uuid[]) AS i(id) WHERE EXISTS "
    "(SELECT 1 FROM events e WHERE e.event_id = i.id)"
)


async def series(custom: bool) -> None:
    server = server_dsn()
    name = bench_database_name("plan")
    dsn = await create_database(server, name)
    try:
        pool = await create_pool(dsn, min_size=1, max_size=1)
        async with pool.acquire() as conn:
            await migrate(conn)
            pid = conn.get_server_pid()
            if custom:
                await conn.execute("SET plan_cache_mode = force_custom_plan")
            else:
                await conn.execute("SET plan_cache_mode = force_generic_plan")
                await conn.execute(f"PREPARE dup(uuid[]) AS {GENERIC_PLAN_SQL}")
                plan = [r[0] for r in await conn.fetch("EXPLAIN EXECUTE dup(ARRAY[gen_random_uuid()])")]
                await conn.execute("DEALLOCATE dup")
                await conn.execute("RESET plan_cache_mode")
                print("  generic plan of the duplicate check on the empty log:")
                print("\n".join(f"    {line}" for line in plan))
        rng = random.Random(1)
        nodes = [Node(i, node_id_for(node_key(i)), 0) for i in range(64)]

        async def batch(label: str) -> None:
            calls = []
            for task in build_reports(nodes, 50, rng, datetime.now(UTC)):
                for r in task:
                    enc = [(validate_payload(e.payload), validate_metadata(e.metadata)) for e in r.events]
                    calls.append((r.node_id, r.events, enc))
            async with pool.acquire() as conn:
                c0 = cpu_of([pid]) or 0.0
                for stream, events, enc in calls:
                    async with conn.transaction():
                        await conn.fetch(
                            "SELECT * FROM mf_append($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                            stream,
                            None,
                            [e.event_id for e in events],
                            [e.event_type for e in events],
                            [e.event_class for e in events],
                            [SCHEMA_VERSION] * len(events),
                            [msgspec.Raw(d) for d, _ in enc],
                            [msgspec.Raw(m) for _, m in enc],
                            False,
                        )
                cpu = (cpu_of([pid]) or 0.0) - c0
                total = await conn.fetchval("SELECT count(*) FROM events")
            n = sum(len(c[1]) for c in calls)
            print(f"  {label:<26} log now {total:>6} events; server CPU {1e6 * cpu / n:5.0f} us/event")

        for i in range(4):
            await batch(f"batch {i + 1}")
        async with pool.acquire() as conn:
            await conn.execute("DISCARD PLANS")
            if custom:
                await conn.execute("SET plan_cache_mode = force_custom_plan")
        print("  -- DISCARD PLANS")
        for i in range(2):
            await batch(f"batch {i + 1} after DISCARD")
        await pool.close()
    finally:
        await drop_database(server, name)


async def main() -> int:
    print("cached plans (the product as a server runs it):")
    await series(custom=False)
    print("plan_cache_mode = force_custom_plan on the connection:")
    await series(custom=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
