"""Bounded telemetry: prune observation events by policy; lifecycle events are never pruned.

Policy: keep every observation received within `keep` of `now`, and always the newest observation
per node and kind (host telemetry) and per accelerator (its newest sample, in a node's snapshot or
an event of its own), however old, so the latest-telemetry read
models rebuild to the same rows after pruning. Storage under steady polling is then
O(nodes x reports per window), not O(time).

Two ways, one policy (docs/retention.md):
  * a day segment (ledger/segments.py) whose whole UTC day is older than the cutoff is retired:
    the observations the policy keeps move to the permanent segment, the partition is dropped.
    An observation in a day segment therefore stays at least `keep` and at most `keep` + 1 day.
  * observations in the permanent segment (received on a day without a segment, or kept past
    their day) are deleted in small batches, each its own short transaction, so ingest is never
    blocked behind them (DELETE takes no lock that an INSERT waits for).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, date, datetime, time, timedelta

import asyncpg
import msgspec
import structlog

from ledger.segments import LOCK_TIMEOUT, ensure_segments, finish_interrupted_detaches

log = structlog.get_logger(__name__)

DEFAULT_KEEP = timedelta(hours=24)
_BATCH = 20_000

# An old observation goes only if a newer one of the same kind (same stream, type and accelerator;
# `data->>'accelerator_id'` is null for host telemetry) exists: the newest always stays. A node's
# snapshot (NODE_TELEMETRY_OBSERVED) goes only if a newer snapshot samples every accelerator it
# samples, so each accelerator's newest sample stays too (that of a GPU left out of an incomplete
# scan, which keeps its last telemetry, and that of a GPU gone missing).
_SUPERSEDED = """EXISTS (
          SELECT 1 FROM {log} n
          WHERE n.stream_id = e.stream_id AND n.stream_version > e.stream_version
            AND n.event_class = 'observation' AND n.event_type = e.event_type
            AND (n.data->>'accelerator_id') IS NOT DISTINCT FROM (e.data->>'accelerator_id')
            AND (e.event_type <> 'NODE_TELEMETRY_OBSERVED'
                 OR coalesce(n.data->'accelerators', '[]') @> (
                     SELECT coalesce(jsonb_agg(jsonb_build_object('uuid', a->'uuid')), '[]')
                     FROM jsonb_array_elements(coalesce(e.data->'accelerators', '[]')) a)))"""

_PRUNE = f"""
DELETE FROM events WHERE segment = 'infinity' AND global_position IN (
    SELECT e.global_position FROM events e
    WHERE e.segment = 'infinity' AND e.event_class = 'observation' AND e.received_at < $1
      AND {_SUPERSEDED.format(log="events")}
    LIMIT $2)
"""

# A retired day's observations that the policy keeps: into the permanent segment, same rows.
_KEEP_PAST_DAY = f"""
UPDATE events e SET segment = 'infinity'
WHERE e.segment = $1 AND e.event_class = 'observation' AND NOT {_SUPERSEDED.format(log="events")}
"""

# After the detach, nothing can reach the day any more: an append that read the day's segment
# before it was lifted and committed after the move above is caught here, its kept observations
# copied back with their positions and transaction ids (a case of appends whose received_at is
# older than the cutoff, e.g. an import, racing a retention pass).
_KEEP_LATE = """
INSERT INTO events OVERRIDING SYSTEM VALUE
SELECT e.global_position, e.tx_id, e.event_id, e.stream_id, e.stream_version, e.event_type,
       e.event_class, e.schema_version, e.data, e.metadata, e.recorded_at, e.prev_hash, e.hash,
       e.received_at, 'infinity'
FROM "{table}" e
WHERE e.event_class = 'observation' AND NOT {superseded}
"""

_DAY_PARTITION = re.compile(r"^events_d(\d{8})$")


class RetentionReport(msgspec.Struct, frozen=True):
    deleted: int
    batches: int
    cutoff: datetime
    # Day segments dropped whole (their day, oldest first) and the observations kept from them.
    segments_dropped: list[date] = []
    kept_past_day: int = 0


async def _day_partitions(conn: asyncpg.Connection) -> list[tuple[date, str, bool]]:
    """(day, table, attached) of every day partition, attached or left detached by a pass cut
    short between its detach and its drop."""
    rows = await conn.fetch(
        "SELECT c.relname, EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhrelid = c.oid "
        "AND i.inhparent = 'events'::regclass) AS attached "
        "FROM pg_class c WHERE c.relkind = 'r' AND c.relnamespace = 'public'::regnamespace "
        "AND c.relname ~ '^events_d[0-9]{8}$'"
    )
    out = []
    for r in rows:
        m = _DAY_PARTITION.match(r["relname"])
        if m:
            out.append((datetime.strptime(m.group(1), "%Y%m%d").date(), r["relname"], r["attached"]))
    return sorted(out)


async def _retire_segment(pool: asyncpg.Pool, day: date, table: str, attached: bool) -> tuple[int, int]:
    """Retire one day segment; each step is safe to repeat if a pass is cut short. Returns
    (observations dropped, observations kept past their day)."""
    kept = dropped = 0
    async with pool.acquire() as conn:
        if attached:
            async with conn.transaction():
                # No append lands on the day from now on: mf_append finds no segment for it.
                await conn.execute("DELETE FROM event_segments WHERE day = $1", day)
            async with conn.transaction():
                status = await conn.execute(_KEEP_PAST_DAY, day)
                kept = int(status.split()[-1])
            await conn.execute(f"SET lock_timeout = '{LOCK_TIMEOUT}'")
            try:
                # Not in a transaction block (CONCURRENTLY): waits for the transactions that may
                # still read the partition, while appends and reads of `events` go on.
                await conn.execute(f'ALTER TABLE events DETACH PARTITION "{table}" CONCURRENTLY')
            finally:
                await conn.execute("RESET lock_timeout")
        async with conn.transaction():
            # newer events of the day itself count too: they are in the detached table now
            log_and_day = (
                "(SELECT stream_id, stream_version, event_class, event_type, data FROM events UNION ALL "
                f'SELECT stream_id, stream_version, event_class, event_type, data FROM "{table}")'
            )
            status = await conn.execute(
                _KEEP_LATE.format(table=table, superseded=_SUPERSEDED.format(log=log_and_day))
            )
            kept += int(status.split()[-1])
            dropped = int(await conn.fetchval(f'SELECT count(*) FROM "{table}"')) - int(status.split()[-1])
            await conn.execute(f'DROP TABLE "{table}"')
    log.info("retention.segment_dropped", day=day.isoformat(), observations=dropped, kept=kept)
    return dropped, kept


async def prune_observations(
    pool: asyncpg.Pool,
    *,
    keep: timedelta = DEFAULT_KEEP,
    now: datetime | None = None,
    batch: int = _BATCH,
    progress: Callable[[int, int], None] | None = None,
) -> RetentionReport:
    """Prune in batches; `progress(deleted so far, batches)` after each one."""
    cutoff = (now or datetime.now(UTC)) - keep
    deleted = batches = kept = 0
    dropped_days: list[date] = []
    async with pool.acquire() as conn:
        await finish_interrupted_detaches(conn)
        await ensure_segments(conn, datetime.now(UTC).date())
        partitions = await _day_partitions(conn)
    for day, table, attached in partitions:
        # A segment holds [day, day + 1) in UTC: retired once all of it is older than the cutoff.
        # (A detached one is a pass cut short after its detach: finished whatever its day.)
        if attached and datetime.combine(day + timedelta(days=1), time(), UTC) > cutoff:
            continue
        n, k = await _retire_segment(pool, day, table, attached)
        deleted += n
        kept += k
        dropped_days.append(day)
    while True:
        async with pool.acquire() as conn:
            status = await conn.execute(_PRUNE, cutoff, batch)
        n = int(status.split()[-1])
        batches += 1
        deleted += n
        if progress is not None:
            progress(deleted, batches)
        if n < batch:
            break
    return RetentionReport(
        deleted=deleted, batches=batches, cutoff=cutoff, segments_dropped=dropped_days, kept_past_day=kept
    )
