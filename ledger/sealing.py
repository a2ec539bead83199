"""Sealing the log's day segments once their day is over (docs/storage.md, "A sealed day").

While its day lasts, a day segment takes every node's snapshots at once, and its three indexes
keyed by stream take each node's newest entry at the end of that node's entries: a full leaf page
splits in half and its left half never fills again, so those indexes stay about 60 % full. Once
the day is over nothing more is appended to it (an append's segment is the day it was received),
and its indexes are rebuilt packed: each index set to `fillfactor = 100` and built again with
REINDEX CONCURRENTLY, which locks out neither reads nor appends. About 65 bytes less per
snapshot; the heap is packed already (appends only).

A segment is sealed one hour after its day ended (a transaction that took its received time just
before midnight has committed by then), by the retention pass (its last step, under its lock: a
segment is never rebuilt while retention detaches it), one pass at a time over the database.
A rebuild cut short leaves an invalid copy of its index (named `..._ccnew`), which the next pass
drops before it seals the segment again; `event_segments.sealed_at` is set once every index is
rebuilt.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import asyncpg
import structlog

from ledger.segments import quote_table

log = structlog.get_logger(__name__)

# How long after its day a segment is sealed: an append in flight at midnight has committed.
GRACE = timedelta(hours=1)
# How long a rebuild waits for the transactions using the segment (REINDEX CONCURRENTLY waits for
# them twice). Its lock (SHARE UPDATE EXCLUSIVE) queues no append or read behind it, so it may
# wait longer than the retention pass's DDL does; a transaction open longer fails this pass, and
# the next one seals the segment.
LOCK_TIMEOUT = "5min"

_DUE = "SELECT day, partition FROM event_segments WHERE sealed_at IS NULL AND day < $1::date ORDER BY day"
# The partition's indexes: valid ones to rebuild, and what an interrupted rebuild left behind.
_INDEXES = (
    "SELECT c.relname, i.indisvalid, c.relname ~ '_cc(new|old)[0-9]*$' AS leftover "
    "FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
    "WHERE i.indrelid = $1::regclass ORDER BY c.relname"
)
_SIZE = "SELECT pg_total_relation_size($1::regclass)"


def sealing_due(now: datetime) -> date:
    """The first day whose segment is not due for sealing at `now`: every day before it ended at
    least GRACE ago."""
    return (now - GRACE).astimezone(UTC).date()


async def seal_due(pool: asyncpg.Pool, *, now: datetime | None = None) -> list[date]:
    """Seal every day segment whose day ended at least GRACE ago and is not sealed yet; the days
    sealed, oldest first. The retention pass runs it, under its lock (ledger/retention.py): a
    segment is never rebuilt while a pass retires it."""
    cutoff = sealing_due(now or datetime.now(UTC))
    sealed: list[date] = []
    async with pool.acquire() as conn:
        for row in await conn.fetch(_DUE, cutoff):
            await seal_segment(conn, row["day"], row["partition"])
            sealed.append(row["day"])
    return sealed


async def seal_segment(conn: asyncpg.Connection, day: date, partition: str) -> None:
    """Rebuild the day segment `partition`'s indexes packed and record it sealed. Runs outside a
    transaction block (REINDEX CONCURRENTLY); each step is safe to repeat."""
    before = await conn.fetchval(_SIZE, quote_table(partition))
    await conn.execute("SELECT set_config('lock_timeout', $1, false)", LOCK_TIMEOUT)
    try:
        for index in await conn.fetch(_INDEXES, quote_table(partition)):
            name = quote_table(index["relname"])
            if index["leftover"] and not index["indisvalid"]:
                await conn.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
            elif index["indisvalid"]:
                await conn.execute(f"ALTER INDEX {name} SET (fillfactor = 100)")
                await conn.execute(f"REINDEX INDEX CONCURRENTLY {name}")
    finally:
        await conn.execute("RESET lock_timeout")
    await conn.execute("UPDATE event_segments SET sealed_at = now() WHERE day = $1", day)
    after = await conn.fetchval(_SIZE, quote_table(partition))
    log.info("segments.sealed", day=day.isoformat(), bytes_before=before, bytes_after=after)
