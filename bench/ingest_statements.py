"""SQL statements, round trips and transactions per telemetry report, per inventory report, per
refresh and per ceiling append, counted on the wire (bench/statements.py) for bench.ingest."""

from __future__ import annotations

from pathlib import Path

from bench import harness as h
from bench.agents import Agent, Load, read_versions
from bench.servers import OPERATOR_TOKEN, HttpConnection, bearer, start_product_server
from bench.statements import StatementCounter


async def count_http(db: h.Database, work: Path, agents: list[Agent], n: int, tree: Path) -> dict[str, float]:
    """Statements per report and per refresh, counted on the wire: a separate server process (from
    `tree`) whose pool goes through the harness's counting proxy; its timings are not reported."""
    out: dict[str, float] = {}
    op = bearer(OPERATOR_TOKEN)
    async with StatementCounter(db.dsn) as counter:
        server = await start_product_server(counter.dsn, work, "counted", retention=False, tree=tree)
        conn = await HttpConnection.open(server.port)
        try:
            # Each kind of report counted apart: an agent sends an inventory report every
            # INVENTORY_EVERY reports, and a window of whatever comes next would mix the kinds in
            # proportions that depend on where the agents' counters stand. Warm-up: prepared
            # statements, the credential cache of every agent counted below (a fresh server looks
            # each credential up once; a steady one does not), and both streams' kept copies, the
            # telemetry stream last: a baseline from before 071e723 opens a node (seven statements)
            # for a report after one on its other stream, and its telemetry count stays steady.
            few = max(5, n // 20)
            for k in range(few):
                await agents[k % len(agents)].send(conn, "inventory")
            for k in range(min(n, len(agents))):
                await agents[k].send(conn, "telemetry")
            status, resp = await conn.request(b"POST", b"/api/v1/hardware/refresh", op)
            assert status == 200, resp[:300]
            kinds = (("report", n), ("inventory_report", few), ("refresh", few))
            for what, times in kinds:
                before = counter.counts.copy()
                for k in range(times):
                    if what == "report":
                        await agents[k % len(agents)].send(conn, "telemetry")
                    elif what == "inventory_report":
                        await agents[k % len(agents)].send(conn, "inventory")
                    else:
                        status, resp = await conn.request(b"POST", b"/api/v1/hardware/refresh", op)
                        assert status == 200, resp[:300]
                d = counter.counts - before
                out[f"{what}_executions"] = d.executions / times
                out[f"{what}_round_trips"] = d.round_trips / times
                out[f"{what}_transactions"] = d.transactions / times
        finally:
            conn.close()
            server.stop()
    return out


async def count_append(db: h.Database, agents: list[Agent]) -> dict[str, float]:
    """Statements per ceiling append (this checkout's EventStore), counted on the wire."""
    from ledger.db import create_pool
    from ledger.store import EventStore
    from projections.inventory import ALL_PROJECTIONS

    async with StatementCounter(db.dsn) as counter:
        pool = await create_pool(counter.dsn, min_size=1, max_size=4)
        try:
            store = EventStore(pool, ALL_PROJECTIONS)
            await read_versions(pool, agents)
            await Load(agents).ceiling(store, 4, 0.5)
            before = counter.counts.copy()
            s = await Load(agents).ceiling(store, 4, 2.0)
            d = counter.counts - before
        finally:
            await pool.close()
    return {
        "append_executions": d.executions / s.ops,
        "append_round_trips": d.round_trips / s.ops,
        "append_transactions": d.transactions / s.ops,
    }
