"""Experiment: the ledger's append (bench/ledger.py's workload: `EventStore.append` of 10-event
reports, no prior state handed in) against a variant of the inline inventory projection, same
workload, same server, interleaved; then `rebuild --verify` on the variant's database.

    python -m bench.experiments.ledger_fewer_round_trips [--events 20000]

Since 51fa880 the ingest path hands the state it already folded to the projection (`prior`), but
`EventStore.append` called without it (bench/ledger.py, the CLI, enrollment) still loads it, and
every changed table is still one statement. The variant:

1. no `load_state` round trip when this process folded the stream last: a per-process cache of
   the folded state, used only when its stream version is the one just before the batch (a
   rolled-back append or another writer falls back to loading);
2. all changed read-model rows and the new state in ONE statement (data-modifying CTEs over
   `jsonb_populate_recordset`, bench.experiments.ingest_fewer_round_trips.one_statement_writer)
   instead of one `executemany` per table plus the state upsert.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import asyncpg

from bench._common import bench_database_name, create_database, drop_database, node_key, server_dsn
from bench.experiments.ingest_fewer_round_trips import one_statement_writer
from bench.ledger import (
    EVENTS_PER_REPORT,
    POOL,
    TASKS,
    LedgerSystem,
    Measurement,
    Node,
    ServerMeter,
    build_reports,
    discovery_events,
    timed,
)
from ledger.db import create_pool, migrate
from ledger.events import RecordedEvent
from ledger.node import node_id_for
from ledger.store import EventStore
from projections.inventory import ALL_PROJECTIONS, InventoryProjection
from projections.rebuild import rebuild


class OneStatementInventory(InventoryProjection):
    def __init__(self) -> None:
        self.cache: dict[str, Any] = {}
        self.write_changes = one_statement_writer(self)  # type: ignore[method-assign]

    async def apply(
        self, conn: asyncpg.Connection, stream_id: str, events: Sequence[RecordedEvent], prior: Any = None
    ) -> None:
        if not self.handles(stream_id):
            return
        hit = self.cache.get(stream_id)
        if prior is not None:
            before = prior
        elif hit is not None and hit.stream_version == events[0].stream_version - 1:
            before = hit
        else:
            before = await self.load_state(conn, stream_id)
        after = self.fold_all(before, events)
        await self.write_changes(conn, stream_id, before, after)
        self.cache[stream_id] = after


async def main(events: int, nodes_n: int, rounds: int) -> int:
    server = server_dsn()
    names = {k: bench_database_name(k) for k in ("current", "variant")}
    dsns = {k: await create_database(server, v) for k, v in names.items()}
    meter = await ServerMeter.open(server, list(names.values()))
    pools: dict[str, asyncpg.Pool] = {}
    try:
        systems, nodes = {}, {}
        for k in names:
            nodes[k] = [Node(i, node_id_for(node_key(i)), 0) for i in range(nodes_n)]
            pools[k] = await create_pool(dsns[k], min_size=POOL, max_size=POOL)
            async with pools[k].acquire() as conn:
                await migrate(conn)
            projections = (
                ALL_PROJECTIONS if k == "current" else (OneStatementInventory(), *ALL_PROJECTIONS[1:])
            )
            store = EventStore(pools[k], projections)
            for n in nodes[k]:
                result = await store.append(n.node_id, 0, discovery_events(n, random.Random(n.index)))
                n.discovered_version = result.stream_version
            async with pools[k].acquire() as conn:
                await conn.execute("ANALYZE")
            systems[k] = LedgerSystem(store, nodes[k])
        per_task = max(rounds, events // EVENTS_PER_REPORT // TASKS)
        ms = {k: Measurement(f"{k} inline projection") for k in names}
        for r in range(rounds):
            for k in names:
                work = build_reports(nodes[k], per_task // rounds, random.Random(r), datetime.now(UTC))
                await timed(meter, ms[k], work, systems[k].worker)
        for m in ms.values():
            print(m.line())
        print(f"variant / current: {ms['variant'].rate / ms['current'].rate:.2f}x events/s")
        report = await rebuild(pools["variant"], ALL_PROJECTIONS, verify=True)
        print("variant's live read models == rebuild from the log:", report.differences == [])
        return 0 if report.differences == [] else 1
    finally:
        await meter.close()
        for p in pools.values():
            await p.close()
        for v in names.values():
            await drop_database(server, v)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=20_000)
    p.add_argument("--nodes", type=int, default=256)
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args()
    raise SystemExit(asyncio.run(main(a.events, a.nodes, a.rounds)))
