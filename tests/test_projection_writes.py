"""The projection's one write statement updates and deletes a stream's known rows by their keys:
read by index whatever the size of the table, not joined against the whole of it (a node's report
must not cost more in a larger fleet), in the plan of its first runs and in the generic plan a
prepared statement settles on; and it tells the rows it found from rows it had to insert."""

from __future__ import annotations

import asyncpg

from projections.framework import _changes_sql
from projections.inventory import HOST_TELEMETRY, NODE_STORAGE


async def _fleet(conn: asyncpg.Connection) -> None:
    """5,000 nodes' storage and host telemetry rows, analyzed."""
    await conn.execute(
        "INSERT INTO hw_node_storage SELECT 'n' || g, m, '1', '2' FROM generate_series(1, 5000) g, "
        "(VALUES ('/'), ('/data')) v(m)"
    )
    await conn.execute(
        "INSERT INTO hw_host_telemetry SELECT 'n' || g, '{}', NULL, now(), NULL, g FROM generate_series(1, 5000) g"
    )
    await conn.execute("ANALYZE hw_node_storage; ANALYZE hw_host_telemetry")


async def _plans(conn: asyncpg.Connection, sql: str, args: tuple[object, ...]) -> list[str]:
    """The statement's plan with these arguments, then its generic plan (what a prepared statement
    switches to after five runs when it costs no more)."""
    custom = "\n".join(r[0] for r in await conn.fetch("EXPLAIN " + sql, *args))
    # EXPLAIN EXECUTE takes no parameters: the arguments go in as literals of the statement's types.
    literals = []
    for param, arg in zip((await conn.prepare(sql)).get_parameters(), args, strict=True):
        name = await conn.fetchval("SELECT format_type($1, NULL)", param.oid)
        literals.append(await conn.fetchval(f"SELECT quote_literal($1::{name}::text) || '::{name}'", arg))
    await conn.execute("SET plan_cache_mode = force_generic_plan")
    try:
        await conn.execute("PREPARE generic AS " + sql)
        generic = "\n".join(r[0] for r in await conn.fetch(f"EXPLAIN EXECUTE generic({', '.join(literals)})"))
    finally:
        await conn.execute("DEALLOCATE ALL; RESET plan_cache_mode")
    assert "$1" in generic, generic  # planned without the arguments' values
    return [custom, generic]


async def test_an_update_of_a_streams_rows_reads_them_by_index_in_a_large_table(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await _fleet(conn)
        sql = _changes_sql(
            (("update", "hw_node_storage", NODE_STORAGE), ("update", "hw_host_telemetry", HOST_TELEMETRY)),
            "projection_state",
        )
        storage = [{"node_id": "n5", "mount": "/", "used_bytes": 3, "total_bytes": 4}]
        host = [{"node_id": "n5", "metrics": {}, "received_at": "2026-12-03T00:00:00Z", "position": 9}]
        args = ("inventory", ["n5"], [2], [9], [b"\x00"], [True], storage, host)
        for plan in await _plans(conn, sql, args):
            assert "Seq Scan" not in plan and "Hash Join" not in plan, plan
        # and it does what it says: both rows changed, the checkpoint was not there to update
        tx = conn.transaction()
        await tx.start()
        try:
            assert await conn.fetchval(sql, *args) == 2
            assert (
                await conn.fetchval(
                    "SELECT used_bytes FROM hw_node_storage WHERE node_id = 'n5' AND mount = '/'"
                )
                == 3
            )
            # Now the checkpoint is there, and one mount is not: found, and not found.
            gone = [{"node_id": "n5", "mount": "/scratch", "used_bytes": 1, "total_bytes": 2}]
            again = ("inventory", ["n5"], [3], [10], [b"\x00"], [True], storage + gone, host)
            assert await conn.fetchval(sql, *again) == 3
        finally:
            await tx.rollback()


async def test_a_delete_of_a_streams_rows_reads_them_by_index_in_a_large_table(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await _fleet(conn)
        sql = _changes_sql(
            (("delete", "hw_node_storage", NODE_STORAGE), ("delete", "hw_host_telemetry", HOST_TELEMETRY)),
            "projection_state",
        )
        storage = [{"node_id": "n5", "mount": "/data"}]
        host = [{"node_id": "n5"}]
        args = ("inventory", ["n5"], [2], [9], [b"\x00"], [True], storage, ["n5"], host, ["n5"])
        for plan in await _plans(conn, sql, args):
            assert "Seq Scan" not in plan, plan
        # and it does what it says: the two rows named went, the node's other mount stayed
        async with conn.transaction():
            await conn.fetchval(sql, *args)
            assert await conn.fetch("SELECT mount FROM hw_node_storage WHERE node_id = 'n5'") == [("/",)]
            assert await conn.fetchval("SELECT count(*) FROM hw_host_telemetry WHERE node_id = 'n5'") == 0
            assert await conn.fetchval("SELECT count(*) FROM hw_node_storage") == 9_999


async def test_the_ledgers_appends_read_their_streams_and_checkpoints_by_index_in_a_large_fleet(
    pool: asyncpg.Pool,
) -> None:
    """The ledger's functions join the arrays they are given (unnest) against `streams` and
    `projection_state`: every such join reads a stream's rows by index, in the plans PL/pgSQL
    caches first and in the generic ones it may settle on."""
    async with pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO streams (stream_id, version, lifecycle_version, updated_at) "
            "SELECT 'n' || g, 3, 1, now() FROM generate_series(1, 5000) g; "
            "INSERT INTO projection_state (projection, stream_id, stream_version, position, state) "
            "SELECT 'inventory', 'n' || g, 3, g, '\\x00' FROM generate_series(1, 5000) g; "
            "ANALYZE streams; ANALYZE projection_state"
        )
        plans: list[str] = []

        def log(_c: object, m: asyncpg.PostgresLogMessage) -> None:
            plans.append(m.message)

        conn.add_log_listener(log)
        for mode in ("force_custom_plan", "force_generic_plan"):
            await conn.execute(
                f"SET plan_cache_mode = {mode}; DISCARD PLANS; LOAD 'auto_explain'; "
                "SET auto_explain.log_min_duration = 0; SET auto_explain.log_nested_statements = on; "
                "SET client_min_messages = log"
            )
            written = conn.transaction()  # rolled back, so the second mode appends the same
            await written.start()
            try:
                await conn.fetch(
                    "SELECT * FROM mf_open_streams($1::text[], 'inventory', $2::bigint[], $3::bigint[], "
                    "'-infinity')",
                    ["n5", "n6"],
                    [3, 3],
                    [5, 6],
                )
                stored = await conn.fetch(
                    "SELECT * FROM mf_append_kept($1::text[], '{3}', '{1}', ARRAY[gen_random_uuid()], '{X}', "
                    "'{lifecycle}', '{1}', '{\"{}\"}', '{\"{}\"}', '{NULL}', '{NULL}', '{NULL}', 'inventory', "
                    "'{3}', '{5}', coalesce((SELECT rebuilt_at FROM projection_checkpoints "
                    "WHERE projection = 'inventory'), '-infinity'))",
                    ["n5"],
                )
                assert [r["out_stream_version"] for r in stored] == [4]
            finally:
                await written.rollback()
            await conn.execute("RESET client_min_messages; RESET plan_cache_mode")
        conn.remove_log_listener(log)
        joins = [p for p in plans if "unnest(" in p]
        assert sum("Index Scan using streams_pkey" in p for p in joins) >= 6, joins
        assert sum("Index Scan using projection_state_pkey" in p for p in joins) >= 4, joins
        for p in joins:
            assert "Seq Scan on streams" not in p and "Seq Scan on projection_state" not in p, p


async def test_a_row_the_folded_state_had_and_the_table_lacks_refuses_the_append(make_api) -> None:  # type: ignore[no-untyped-def]
    """An upsert would write a missing row back without a word: the read model would no longer be
    the fold of its log and nobody would know. The append is refused and nothing of it is kept."""
    from collectors.facts import Known
    from ledger.events import NodeTelemetryObserved
    from ledger.store import EventStore
    from projections.inventory import ALL_PROJECTIONS
    from tests.builders import new

    api = make_api()
    node_id = (await api.refresh())["node_id"]
    store = EventStore(api.pool, ALL_PROJECTIONS)
    async with api.pool.acquire() as conn:
        version = await conn.fetchval("SELECT version FROM streams WHERE stream_id = $1", node_id)
        assert await conn.fetchval("DELETE FROM hw_host_telemetry WHERE node_id = $1 RETURNING 1", node_id)
    telemetry = {"memory_available_bytes": Known(1234), "memory_total_bytes": Known(4096)}
    snapshot = NodeTelemetryObserved(telemetry=telemetry, storage=[], accelerators=[])
    try:
        await store.append(node_id, version, [new(snapshot)])
    except RuntimeError as refused:
        assert "rebuild" in str(refused)
    else:
        raise AssertionError("the append wrote over a row the read model had lost")
    async with api.pool.acquire() as conn:
        assert await conn.fetchval("SELECT version FROM streams WHERE stream_id = $1", node_id) == version
        assert await conn.fetchval("SELECT count(*) FROM hw_host_telemetry WHERE node_id = $1", node_id) == 0
