"""The log's day segments: one partition of `events` per UTC day of received observations.

Retention retires a segment whole once its day is older than the cutoff: it lifts the day from
`event_segments` (so no append can land on it any more), moves the observations the policy keeps
(each node's and each GPU's newest sample) into the permanent segment with their positions and
transaction ids unchanged, then detaches the partition CONCURRENTLY and drops it. Dropping a
partition writes no dead rows: the space goes back to the file system at once, with no VACUUM.
Detaching CONCURRENTLY locks `events` only against other DDL, so appends and reads never wait.
"""

from __future__ import annotations

from datetime import date, timedelta

import asyncpg
import msgspec
import structlog

log = structlog.get_logger(__name__)

# Segments exist this many days ahead of today: the server's retention pass (every few minutes)
# and every `migrate` create them, so an append never finds its day missing unless no pass ran
# for days, and then it still succeeds, in the permanent segment.
DAYS_AHEAD = 3
# DDL waits at most this long for a lock, then gives up until the next pass: a long-running
# reader holding `events` must never queue the appends behind a waiting DDL statement.
LOCK_TIMEOUT = "2s"


def quote_table(name: str) -> str:
    """`name` as a quoted identifier, as PostgreSQL's quote_ident writes it. A statement cannot
    take a table name as a parameter, so the few that work on one day segment's table (detached
    from `events`, it is reachable by its name only) carry the name in their text, quoted."""
    return '"' + name.replace('"', '""') + '"'


class Segment(msgspec.Struct, frozen=True):
    day: date
    partition: str


async def ensure_segments(conn: asyncpg.Connection, today: date, *, ahead: int = DAYS_AHEAD) -> list[date]:
    """Create the segments of `today` through `ahead` days after it that do not exist yet."""
    async with conn.transaction():
        await conn.execute("SELECT set_config('lock_timeout', $1, true)", LOCK_TIMEOUT)
        rows = await conn.fetch(
            "SELECT mf_ensure_segments($1, $2) AS day", today, today + timedelta(days=ahead)
        )
    created = [r["day"] for r in rows]
    if created:
        log.info("segments.created", days=[d.isoformat() for d in created])
    return created


async def segments(conn: asyncpg.Connection) -> list[Segment]:
    rows = await conn.fetch("SELECT day, partition FROM event_segments ORDER BY day")
    return [Segment(day=r["day"], partition=r["partition"]) for r in rows]


_FINISH_DETACH = "ALTER TABLE events DETACH PARTITION {table} FINALIZE"


async def finish_interrupted_detaches(conn: asyncpg.Connection) -> None:
    """A DETACH ... CONCURRENTLY cut short (the server killed mid-way) leaves its partition
    'detach pending'; finish it, so that retention finds it detached and completes its retirement."""
    rows = await conn.fetch(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = 'events'::regclass AND i.inhdetachpending"
    )
    for r in rows:
        await conn.execute(_FINISH_DETACH.format(table=quote_table(r["relname"])))
        log.info("segments.detach_finished", partition=r["relname"])
