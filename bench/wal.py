"""The WAL one database wrote in a window, told from the cluster's: the WAL position is
cluster-wide, so on a shared PostgreSQL whatever else runs writes into the same window.
pg_walinspect (contrib, PostgreSQL 15+) reads the window's records back; a record names the
relations it changes (`rel tablespace/database/relfilenode`), and a commit record belongs to the
database its transaction wrote to."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import asyncpg

WAL_OF_DATABASE = r"""
WITH r AS (
    SELECT xid::text AS xid_text, record_length,
           fpi_length, substring(block_ref FROM 'rel \d+/(\d+)/') AS db
    FROM pg_get_wal_records_info($1::text::pg_lsn, $2::text::pg_lsn)
), mine AS (SELECT DISTINCT xid_text FROM r WHERE db = $3 AND xid_text <> '0')
SELECT coalesce(sum(record_length) FILTER (
           WHERE db = $3 OR (db IS NULL AND xid_text IN (SELECT xid_text FROM mine))), 0)::bigint AS database,
       coalesce(sum(fpi_length) FILTER (WHERE db = $3), 0)::bigint AS database_fpi,
       coalesce(sum(record_length), 0)::bigint AS records
FROM r
"""


@dataclass
class WalShare:
    """The WAL a window wrote: `total`, how far the cluster's WAL position moved (page headers
    included); `records`, the bytes of all its records; `database`, those of the measured
    database's records (None: pg_walinspect could not read the window back), `database_fpi` the
    full-page images among them (the first change of a page after a checkpoint)."""

    total: int
    records: int | None = None
    database: int | None = None
    database_fpi: int | None = None

    @property
    def others(self) -> int | None:
        """Bytes of records of other databases (and of none: checkpoints, running transactions)."""
        return None if self.records is None or self.database is None else self.records - self.database


class WalInspector:
    """WAL readings around a window, with the share of one database's records when the server has
    pg_walinspect (created in `dsn`'s database, a throwaway one: it needs a superuser)."""

    def __init__(self, conn: asyncpg.Connection, why_not: str | None) -> None:
        self.conn = conn
        self.why_not = why_not  # None: the records can be read back

    @classmethod
    async def open(cls, dsn: str) -> WalInspector:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        except asyncpg.PostgresError as exc:
            return cls(conn, f"pg_walinspect unavailable ({exc}): the WAL is the cluster's")
        return cls(conn, None)

    async def close(self) -> None:
        await self.conn.close()

    async def checkpoint(self) -> None:
        """A checkpoint now, so that none falls into the next window by chance (the first change of
        each page after one is logged whole); a role that may not checkpoint leaves it to chance."""
        try:
            await self.conn.execute("CHECKPOINT")
        except asyncpg.PostgresError:
            pass

    async def position(self) -> str:
        return str(await self.conn.fetchval("SELECT pg_current_wal_lsn()::text"))

    async def share(self, start: str, end: str, database: str) -> WalShare:
        total = int(
            await self.conn.fetchval(
                "SELECT pg_wal_lsn_diff($2::text::pg_lsn, $1::text::pg_lsn)::bigint", start, end
            )
        )
        if self.why_not is not None or total <= 0:
            return WalShare(total)
        # Records can be read only up to the flushed position (the walwriter's next round).
        deadline = time.monotonic() + 5
        while not await self.conn.fetchval("SELECT pg_current_wal_flush_lsn() >= $1::text::pg_lsn", end):
            if time.monotonic() > deadline:
                return WalShare(total)
            await asyncio.sleep(0.05)
        oid = await self.conn.fetchval("SELECT oid::text FROM pg_database WHERE datname = $1", database)
        try:
            row = await self.conn.fetchrow(WAL_OF_DATABASE, start, end, oid)
        except asyncpg.PostgresError as exc:  # e.g. the window's segments already recycled
            self.why_not = f"the window's WAL could not be read back ({exc})"
            return WalShare(total)
        return WalShare(total, int(row["records"]), int(row["database"]), int(row["database_fpi"]))
