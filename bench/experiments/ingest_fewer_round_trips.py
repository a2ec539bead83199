"""Experiment: the ingest path (POST /agent/reports) with fewer round trips per report, against the
product, two server processes on ONE database, interleaved windows, same simulated agents.

    python -m bench.experiments.ingest_fewer_round_trips [--nodes 1000] [--rounds 3] [--duration 8]

A steady report costs 12 round trips today: BEGIN, mf_lock_stream (accept_report), the credential
and sequence check, mf_lock_stream AGAIN (reconcile_observation -> _reconcile_locked), load_state,
mf_append, three executemany (hw_host_telemetry, hw_accelerator_telemetry, hw_node_storage), the
projection_state upsert, the stream-position upsert, COMMIT. The variant server patches, in its
own process only (the product is untouched):

1. the second `lock_stream` of the same stream in the same transaction returns what the first
   one returned (the product fix: `accept_report` hands its StreamInfo to `reconcile_observation`);
2. `_reconcile_locked` takes the state the inline projection folded instead of folding the same
   events a second time (the product fix: `Projection.apply`/`EventStore.append` return it);
3. the inventory projection writes every changed row of every table and the new state in ONE
   statement (data-modifying CTEs over `jsonb_populate_recordset`), instead of one executemany
   per table plus the state upsert (the product fix: `Projection.write_changes`).

12 round trips become 8. A single server process is CPU-bound on this machine, so round trips
(each a send syscall and a wake-up of a backend) are most of its cost: see docs/performance.md.
At the end, `rebuild --verify` compares the live read models (written by both servers) with a
rebuild from the log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import random
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

from bench import ingest
from bench._common import bench_database_name, create_database, drop_database, server_dsn

_FOLDED: contextvars.ContextVar[Any] = contextvars.ContextVar("bench_folded", default=None)


def one_statement_writer(projection: Any) -> Any:
    """A `write_changes` for `projection` that writes every changed row of every table and the new
    state in ONE statement (data-modifying CTEs over `jsonb_populate_recordset`); deletions (rare)
    and rebuild's shadow tables take the product's path."""
    import msgspec

    from projections.framework import STATE_TABLE, _delete_sql

    specs = {t.name: t for t in projection.tables}
    sql_cache: dict[tuple[str, ...], str] = {}
    original_write = projection.write_changes

    def statement(tables: tuple[str, ...]) -> str:
        sql = sql_cache.get(tables)
        if sql is None:
            ctes = []
            for k, name in enumerate(tables, start=1):
                spec = specs[name]
                cols = ", ".join(spec.columns)
                updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in spec.columns if c not in spec.key)
                conflict = f"DO UPDATE SET {updates}" if updates else "DO NOTHING"
                ctes.append(
                    f"t{k} AS (INSERT INTO {name} ({cols}) SELECT {cols} FROM "
                    f"jsonb_populate_recordset(NULL::{name}, ${k}) ON CONFLICT ({', '.join(spec.key)}) {conflict})"
                )
            n = len(tables)
            state = (
                f"INSERT INTO {STATE_TABLE} (projection, stream_id, stream_version, position, state) "
                f"VALUES (${n + 1}, ${n + 2}, ${n + 3}, ${n + 4}, ${n + 5}) ON CONFLICT (projection, stream_id) "
                "DO UPDATE SET stream_version = EXCLUDED.stream_version, position = EXCLUDED.position, "
                "state = EXCLUDED.state"
            )
            sql = ("WITH " + ", ".join(ctes) + " " if ctes else "") + state
            sql_cache[tables] = sql
        return sql

    async def write_changes(conn: Any, stream_id: str, before: Any, after: Any, *, suffix: str = "") -> None:
        if suffix:  # rebuild's shadows: the product's path
            await original_write(conn, stream_id, before, after, suffix=suffix)
            return
        old_rows, new_rows = projection.rows(before), projection.rows(after)
        tables, params = [], []
        for spec in projection.tables:
            old = {spec.key_of(r): r for r in old_rows.get(spec.name, ())}
            new = {spec.key_of(r): r for r in new_rows.get(spec.name, ())}
            changed = [r for k, r in new.items() if old.get(k) != r]
            gone = [k for k in old if k not in new]
            if gone:  # rare: the product's statement
                await conn.executemany(_delete_sql(spec.name, spec), gone)
            if changed:
                tables.append(spec.name)
                rows = [dict(zip(spec.columns, r, strict=True)) for r in changed]
                params.append(msgspec.Raw(msgspec.json.encode(rows)))
        version, position = projection.checkpoint_of(after)
        await conn.execute(
            statement(tuple(tables)),
            *params,
            projection.name,
            stream_id,
            version,
            position,
            msgspec.Raw(msgspec.json.encode(after)),
        )

    return write_changes


def apply_patches() -> None:
    from api.services.errors import NodeIsDecommissioned as NodeTombstoned
    from api.services.inventory import HardwareInventoryService
    from ledger.events import NewEvent
    from ledger.reconcile import reconcile
    from ledger.store import EventStore
    from projections.inventory import INVENTORY

    # 1. One lock per stream per transaction: a memo on the connection, tied to its transaction
    #    object, consumed by the second call and dropped by any append.
    memo: dict[int, tuple[Any, str, Any]] = {}
    lock_stream, append = EventStore.lock_stream, EventStore._append

    def _raw(conn: Any) -> Any:
        return getattr(conn, "_con", conn)

    async def memo_lock_stream(self: Any, conn: Any, stream_id: str) -> Any:
        raw = _raw(conn)
        hit = memo.pop(id(raw), None)
        if hit is not None and hit[0] is raw._top_xact and hit[1] == stream_id:
            return hit[2]
        info = await lock_stream(self, conn, stream_id)
        if raw._top_xact is not None:
            memo[id(raw)] = (raw._top_xact, stream_id, info)
        return info

    async def memo_append(self: Any, conn: Any, *a: Any, **kw: Any) -> Any:
        memo.pop(id(_raw(conn)), None)
        return await append(self, conn, *a, **kw)

    EventStore.lock_stream = memo_lock_stream  # type: ignore[method-assign]
    EventStore._append = memo_append  # type: ignore[method-assign]

    # 2. The projection's fold is the service's fold.
    async def apply(self: Any, conn: Any, stream_id: str, events: Any, prior: Any = None) -> None:
        if not self.handles(stream_id):
            return
        before = prior if prior is not None else await self.load_state(conn, stream_id)
        after = self.fold_all(before, events)
        _FOLDED.set(after)
        await self.write_changes(conn, stream_id, before, after)

    INVENTORY.apply = apply.__get__(INVENTORY)  # type: ignore[method-assign]

    async def _reconcile_locked(
        self: Any, conn: Any, node_id: str, identity: Any, observation: Any, metadata: Any
    ) -> Any:
        info = await self.store.lock_stream(conn, node_id)
        if info.tombstoned_at is not None:
            raise NodeTombstoned(node_id)
        state = await INVENTORY.load_state(conn, node_id)
        payloads = reconcile(observation, state, identity)
        events = [NewEvent(payload=p, metadata=metadata) for p in payloads]
        _FOLDED.set(None)
        result = await self.store.append(
            node_id, info.version, events, conn=conn, locked=True, prior_states={INVENTORY.name: state}
        )
        folded = _FOLDED.get()
        return result.events, folded if folded is not None else INVENTORY.fold_all(state, result.events)

    HardwareInventoryService._reconcile_locked = _reconcile_locked  # type: ignore[method-assign]

    # 3. All of a stream's changed rows and its state in one statement.
    INVENTORY.write_changes = one_statement_writer(INVENTORY)  # type: ignore[method-assign]


async def run(args: argparse.Namespace) -> int:
    from api.services.agent_plane import EnrollmentService
    from api.services.inventory import HardwareInventoryService
    from ledger.db import create_pool, migrate
    from ledger.logs import configure_logging
    from ledger.store import EventStore
    from projections.inventory import ALL_PROJECTIONS
    from projections.rebuild import rebuild

    server_url = server_dsn()
    db = bench_database_name("ingestx")
    dsn = await create_database(server_url, db)
    workdir = Path(tempfile.mkdtemp(prefix="mf-bench-ingestx-"))
    log = open(workdir / "inprocess.log", "w", encoding="utf-8")  # noqa: ASYNC230
    configure_logging(level="INFO", json=True, stream=log)
    servers: list[ingest.Server] = []
    pool = None
    monitor = None
    try:
        pool = await create_pool(dsn, min_size=2, max_size=ingest.POOL_MAX)
        async with pool.acquire() as conn:
            await migrate(conn)
        service = EnrollmentService(HardwareInventoryService(EventStore(pool, ALL_PROJECTIONS)))
        credentials = await ingest.enroll_all(service, args.nodes, tokens=8)
        rng = random.Random(20261130)
        agents = [ingest.build_agent(i, cred, 3, rng) for i, cred in credentials]
        product = await ingest.start_server(dsn, workdir, name="product")
        servers.append(product)
        variant = await ingest.start_server(
            dsn, workdir, module="bench.experiments.ingest_fewer_round_trips", name="variant"
        )
        servers.append(variant)
        _, disc = await ingest.discover_all(agents, product.port, args.connections)
        assert not disc.errors, disc.error_samples
        async with pool.acquire() as conn:
            await conn.execute("ANALYZE")
        for s in servers:  # warm-up
            await ingest.http_closed_loop(agents, s.port, args.connections, 2.0)
        monitor = await asyncpg.connect(server_url)
        tiers = {
            "product": ingest.Tier("product server"),
            "variant": ingest.Tier("variant server (8 round trips)"),
        }
        for _ in range(args.rounds):
            for name, s in (("product", product), ("variant", variant)):
                meter = ingest.Meter(monitor, db, s)
                tiers[name].windows.append(
                    await meter.measure(
                        ingest.http_closed_loop(agents, s.port, args.connections, args.duration)
                    )
                )
        print(f"ingest experiment, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; {args.nodes} nodes, "
              f"{args.connections} connections, {args.rounds} x {args.duration:.0f} s each, interleaved")  # fmt: skip
        print(
            f"\n  {'server':<40} {'reports/s':>8} {'events/s':>9} {'p50 ms':>7} {'p99 ms':>7} "
            f"{'errors':>6}   CPU ms/report: {'client':>7} {'server':>7} {'postgres':>8}"
        )
        for t in tiers.values():
            print(t.line())
            for w in t.windows:
                for e in w.error_samples:
                    print(f"    error: {e}")
        p, v = tiers["product"], tiers["variant"]
        pc = (p.cpu_ms("server_cpu") or 0) + (p.cpu_ms("db_cpu") or 0)
        vc = (v.cpu_ms("server_cpu") or 0) + (v.cpu_ms("db_cpu") or 0)
        print(
            f"variant / product: {v.rate / p.rate:.2f}x reports/s; CPU-cost ratio {pc / vc if vc else 0:.2f}"
        )
        t0 = time.perf_counter()
        report = await rebuild(pool, ALL_PROJECTIONS, verify=True)
        print(
            f"live read models (both servers) == rebuild from the log: {report.differences == []} "
            f"({time.perf_counter() - t0:.0f} s)"
        )
        return (
            0
            if report.differences == [] and not (p.windows and any(w.errors for w in p.windows + v.windows))
            else 1
        )
    finally:
        if monitor is not None:
            await monitor.close()
        for s in servers:
            s.stop()
        if pool is not None:
            await pool.close()
        log.close()
        await drop_database(server_url, db)
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "_serve":
        apply_patches()
        return ingest.serve_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=8.0)
    return asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
