"""The projection's one write statement updates a stream's known rows by their keys: read by
index whatever the size of the table, not joined against the whole of it (a node's report must
not cost more in a larger fleet)."""

from __future__ import annotations

import asyncpg

from projections.framework import _changes_sql
from projections.inventory import HOST_TELEMETRY, NODE_STORAGE


async def test_an_update_of_a_streams_rows_reads_them_by_index_in_a_large_table(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO hw_node_storage SELECT 'n' || g, m, '1', '2' FROM generate_series(1, 5000) g, "
            "(VALUES ('/'), ('/data')) v(m)"
        )
        await conn.execute(
            "INSERT INTO hw_host_telemetry SELECT 'n' || g, '{}', NULL, now(), NULL, g "
            "FROM generate_series(1, 5000) g"
        )
        await conn.execute("ANALYZE hw_node_storage; ANALYZE hw_host_telemetry")
        sql = _changes_sql(
            (("update", "hw_node_storage", NODE_STORAGE), ("update", "hw_host_telemetry", HOST_TELEMETRY)),
            "projection_state",
        )
        storage = [{"node_id": "n5", "mount": "/", "used_bytes": 3, "total_bytes": 4}]
        host = [{"node_id": "n5", "metrics": {}, "received_at": "2026-12-03T00:00:00Z", "position": 9}]
        args = ("inventory", ["n5"], [2], [9], [b"\x00"], [True], storage, ["n5"], host, ["n5"])
        plan = "\n".join(r[0] for r in await conn.fetch("EXPLAIN " + sql, *args))
        assert "Seq Scan" not in plan, plan
        # and it does what it says: both rows changed, the checkpoint was not there to update
        async with conn.transaction():
            assert await conn.fetchval(sql, *args) == 2
            assert (
                await conn.fetchval(
                    "SELECT used_bytes FROM hw_node_storage WHERE node_id = 'n5' AND mount = '/'"
                )
                == 3
            )
