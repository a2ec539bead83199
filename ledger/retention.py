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

import asyncio
import re
from collections.abc import Callable
from datetime import UTC, date, datetime, time, timedelta

import asyncpg
import msgspec
import structlog

from ledger.sealing import seal_due
from ledger.segments import LOCK_TIMEOUT, ensure_segments, finish_interrupted_detaches, quote_table

log = structlog.get_logger(__name__)

DEFAULT_KEEP = timedelta(hours=24)
RETENTION_LOCK_KEY = (
    7305820115  # beside the rebuild gate (7305820111), migrate (..12), rebuild (..13), segments (..14)
)
_BATCH = 20_000

# An old observation goes only if a newer one of the same kind (same stream, type and accelerator;
# `data->>'accelerator_id'` is null for host telemetry) exists: the newest always stays. A node's
# snapshot (NODE_TELEMETRY_OBSERVED) goes only if a newer snapshot samples every accelerator it
# samples, so each accelerator's newest sample stays too (that of a GPU left out of an incomplete
# scan, which keeps its last telemetry, and that of a GPU gone missing). Where either is stored
# compact (ledger/compact.py) the two are compared by the digest of the GPUs they sample
# (mf_sampled): the newer one must sample the same GPUs, which keeps a little more than the jsonb
# rule where a scan sampled more GPUs than the one before, never less. `e` is the old event, `n`
# the newer one.
_NEWER_OF_SAME_KIND = """
            n.stream_id = e.stream_id AND n.stream_version > e.stream_version
            AND n.event_class = 'observation' AND n.event_type = e.event_type
            AND (n.data->>'accelerator_id') IS NOT DISTINCT FROM (e.data->>'accelerator_id')
            AND (e.event_type <> 'NODE_TELEMETRY_OBSERVED'
                 OR CASE WHEN n.body IS NULL AND e.body IS NULL
                         THEN coalesce(n.data->'accelerators', '[]') @> (
                             SELECT coalesce(jsonb_agg(jsonb_build_object('uuid', a->'uuid')), '[]')
                             FROM jsonb_array_elements(coalesce(e.data->'accelerators', '[]')) a)
                         ELSE mf_sampled(n.data, n.sampled) = mf_sampled(e.data, e.sampled) END)"""
# Newer events in the log.
_NEWER_IN_LOG = "SELECT 1 FROM events n WHERE" + _NEWER_OF_SAME_KIND
# Newer events in the log or in a detached day's table (`{table}`).
_NEWER_IN_LOG_OR_DAY = (
    "SELECT 1 FROM (SELECT stream_id, stream_version, event_class, event_type, data, body, sampled "
    "FROM events UNION ALL SELECT stream_id, stream_version, event_class, event_type, data, body, "
    "sampled FROM {table}) n WHERE" + _NEWER_OF_SAME_KIND
)

# The permanent segment's old observations, a batch at a time.
_PRUNE = (
    """
DELETE FROM events WHERE segment = 'infinity' AND global_position IN (
    SELECT e.global_position FROM events e
    WHERE e.segment = 'infinity' AND e.event_class = 'observation' AND e.received_at < $1
      AND EXISTS ("""
    + _NEWER_IN_LOG
    + """)
    LIMIT $2)
"""
)

# What a retired day keeps, as the CTE `kept`, of the streams $1 to $2 of the day's table
# (`{table}`). Asking every row of a day whether something newer supersedes it is quadratic per
# stream (a day holds 8,640 snapshots of a node at 10 s), so one pass over the day in stream order
# first drops each row that the very next event of its stream supersedes: same kind and GPU and,
# for a snapshot, every GPU it sampled sampled again. What is left (about one row per stream: its
# last of the day, and rows after which a scan sampled fewer GPUs) gets the exact question, each
# by index (a subquery with LIMIT is never turned into a join over the whole log). The same rule
# as the DELETE above, decided in two steps.
_DAY_ROWS = """
WITH rows AS (
    -- Each row's data read once (a snapshot is stored compressed: every access decompresses
    -- it), what the window compares computed here and not again in lead(): 2.4x faster.
    SELECT e.global_position, e.stream_id, e.stream_version, e.event_type,
           CASE WHEN e.event_type <> 'NODE_TELEMETRY_OBSERVED'
                THEN e.data->>'accelerator_id' END AS accelerator,
           -- What a snapshot samples: its GPUs' UUIDs, or of one stored compact the digest of them
           -- (so two compact snapshots compare equal when they sample the same GPUs).
           CASE WHEN e.event_type <> 'NODE_TELEMETRY_OBSERVED' THEN NULL
                WHEN e.body IS NULL THEN jsonb_path_query_array(e.data, '$.accelerators[*].uuid')
                ELSE jsonb_build_array(e.sampled::text) END AS sampled
    FROM {table} e
    WHERE e.event_class = 'observation' AND e.stream_id BETWEEN $1 AND $2"""
_DAY_CANDIDATES = """
    OFFSET 0
), day AS (
    SELECT r.global_position, r.event_type, r.accelerator, r.sampled,
           lead(r.event_type) OVER w AS next_type,
           lead(r.accelerator) OVER w AS next_accelerator,
           lead(r.sampled) OVER w AS next_sampled
    FROM rows r
    WINDOW w AS (PARTITION BY r.stream_id ORDER BY r.stream_version)
), candidates AS MATERIALIZED (
    SELECT d.global_position FROM day d
    WHERE d.next_type IS NULL OR d.next_type <> d.event_type
       OR d.next_accelerator IS DISTINCT FROM d.accelerator
       OR (d.event_type = 'NODE_TELEMETRY_OBSERVED' AND NOT d.next_sampled @> d.sampled)
), kept AS MATERIALIZED (
    SELECT e.global_position FROM candidates c
    JOIN {table} e ON e.global_position = c.global_position
    WHERE ("""
_KEPT_END = """ LIMIT 1) IS NULL
)"""

# Before the detach: the kept observations move into the permanent segment, the same rows ($3:
# the day).
_KEEP_PAST_DAY = (
    _DAY_ROWS
    + _DAY_CANDIDATES
    + _NEWER_IN_LOG
    + _KEPT_END
    + """
UPDATE events e SET segment = 'infinity'
FROM kept k
WHERE e.segment = $3 AND e.global_position = k.global_position
"""
)

# After the detach, nothing can reach the day any more: an append that read the day's segment
# before it was lifted and committed after the move above is caught here, its kept observations
# copied back with their positions and transaction ids (a case of appends whose received_at is
# older than the cutoff, e.g. an import, racing a retention pass). Newer events of the day
# itself count too: they are in the detached table now. Only the rows the move could not see
# are looked at: those whose transaction had not committed when the day was lifted ($3, the
# snapshot taken then; every step of the move saw at least what it saw). A pass cut short
# before its drop has no such snapshot ($3 null) and looks at every row left.
_KEEP_LATE = (
    _DAY_ROWS
    + " AND ($3::text IS NULL OR NOT pg_visible_in_snapshot(e.tx_id, $3::text::pg_snapshot))"
    + _DAY_CANDIDATES
    + _NEWER_IN_LOG_OR_DAY
    + _KEPT_END
    + """
INSERT INTO events OVERRIDING SYSTEM VALUE
SELECT e.global_position, e.tx_id, e.event_id, e.stream_id, e.stream_version, e.event_type,
       e.event_class, e.schema_version, e.data, e.metadata, e.recorded_at, e.prev_hash, e.hash,
       e.received_at, 'infinity', e.body, e.sampled
FROM {table} e JOIN kept k ON k.global_position = e.global_position
"""
)

# The streams a day holds, in index order, one index probe each (a loose index scan: a day holds
# thousands of rows per stream, so DISTINCT would read them all).
_DAY_STREAMS = """
WITH RECURSIVE ids AS (
    (SELECT stream_id FROM {table} ORDER BY stream_id LIMIT 1)
    UNION ALL
    SELECT (SELECT t.stream_id FROM {table} t WHERE t.stream_id > ids.stream_id
            ORDER BY t.stream_id LIMIT 1)
    FROM ids WHERE ids.stream_id IS NOT NULL
)
SELECT stream_id FROM ids WHERE stream_id IS NOT NULL
"""
_DAY_ESTIMATE = "SELECT reltuples FROM pg_class WHERE oid = quote_ident($1)::regclass"
_DAY_COUNT = "SELECT count(*) FROM {table}"
_DETACH = "ALTER TABLE events DETACH PARTITION {table} CONCURRENTLY"
_DROP_DAY = "DROP TABLE {table}"


def _on(statement: str, table: str) -> str:
    """`statement` on one day's table: its `{table}` is the table's name, quoted (quote_table)."""
    return statement.format(table=quote_table(table))


# A day is decided in steps of about this many observations (whole streams), each its own
# transaction, with a rest after each as long as the step took: the pass then takes at most half
# of a core from ingest while it reads the day, however large the day, and no step holds a core
# long enough to show in ingest's p99 (20,000 did: docs/retention.md).
STEP_OBSERVATIONS = 10_000
REST = 1.0

_DAY_PARTITION = re.compile(r"^events_d(\d{8})$")


class RetentionReport(msgspec.Struct, frozen=True):
    deleted: int
    batches: int
    cutoff: datetime
    # Day segments dropped whole (their day, oldest first) and the observations kept from them.
    segments_dropped: list[date] = []
    kept_past_day: int = 0
    skipped: bool = False  # another server's pass was running
    steps: int = 0  # transactions the retired days were decided in (docs/retention.md)
    # Day segments whose day is over, sealed by this pass (their day, oldest first; ledger/sealing.py).
    segments_sealed: list[date] = []


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


async def _stream_ranges(conn: asyncpg.Connection, table: str, step: int) -> list[tuple[str, str]]:
    """The day's streams as inclusive (first, last) ranges of about `step` observations each."""
    ids = [r["stream_id"] for r in await conn.fetch(_on(_DAY_STREAMS, table))]
    if not ids:
        return []
    rows = await conn.fetchval(_DAY_ESTIMATE, table)
    if rows is None or rows < 0:  # never analyzed (autovacuum analyzes each partition)
        rows = await conn.fetchval(_on(_DAY_COUNT, table))
    per_range = max(1, int(step * len(ids) / max(float(rows), 1.0)))
    return [(ids[i], ids[min(i + per_range, len(ids)) - 1]) for i in range(0, len(ids), per_range)]


async def _in_steps(
    conn: asyncpg.Connection, ranges: list[tuple[str, str]], sql: str, *args: object, rest: float
) -> tuple[int, int]:
    """`sql` once per range of streams (its $1 and $2; `args` from $3), each in its own transaction, resting
    `rest` times as long as each step took. Returns (rows touched, steps)."""
    touched = 0
    loop = asyncio.get_running_loop()
    for k, (first, last) in enumerate(ranges):
        started = loop.time()
        async with conn.transaction():
            # The planner cannot know how few candidates the day has; compiling it (JIT) for
            # the many it guesses costs more than the step itself.
            await conn.execute("SET LOCAL jit = off")
            status = await conn.execute(sql, first, last, *args)
        touched += int(status.split()[-1])
        if rest > 0 and k + 1 < len(ranges):
            await asyncio.sleep((loop.time() - started) * rest)
    return touched, len(ranges)


async def _retire_segment(
    pool: asyncpg.Pool, day: date, table: str, attached: bool, *, step: int, rest: float
) -> tuple[int, int, int]:
    """Retire one day segment; each step is safe to repeat if a pass is cut short. Returns
    (observations dropped, observations kept past their day, steps)."""
    kept = dropped = moved_in = 0
    lifted_at: str | None = None
    async with pool.acquire() as conn:
        if attached:
            async with conn.transaction():
                # No append lands on the day from now on: mf_append finds no segment for it.
                await conn.execute("DELETE FROM event_segments WHERE day = $1", day)
            # What has committed by now, every step below sees; what has not is looked at again
            # after the detach.
            lifted_at = await conn.fetchval("SELECT pg_current_snapshot()::text")
            # Stream by stream (the rule looks only at a row's own stream), in steps. A stream
            # that an append still in flight adds to the day is caught after the detach.
            ranges = await _stream_ranges(conn, table, step)
            kept, moved_in = await _in_steps(conn, ranges, _on(_KEEP_PAST_DAY, table), day, rest=rest)
            await conn.execute("SELECT set_config('lock_timeout', $1, false)", LOCK_TIMEOUT)
            try:
                # Not in a transaction block (CONCURRENTLY): waits for the transactions that may
                # still read the partition, while appends and reads of `events` go on.
                await conn.execute(_on(_DETACH, table))
            finally:
                await conn.execute("RESET lock_timeout")
        # Nothing writes to the detached day any more: its streams are final.
        ranges = await _stream_ranges(conn, table, step)
        copied, copied_in = await _in_steps(conn, ranges, _on(_KEEP_LATE, table), lifted_at, rest=rest)
        kept += copied
        async with conn.transaction():
            dropped = int(await conn.fetchval(_on(_DAY_COUNT, table))) - copied
            await conn.execute(_on(_DROP_DAY, table))
    steps = moved_in + copied_in
    log.info("retention.segment_dropped", day=day.isoformat(), observations=dropped, kept=kept, steps=steps)
    return dropped, kept, steps


async def prune_observations(
    pool: asyncpg.Pool,
    *,
    keep: timedelta = DEFAULT_KEEP,
    now: datetime | None = None,
    batch: int = _BATCH,
    progress: Callable[[int, int], None] | None = None,
    step: int = STEP_OBSERVATIONS,
    rest: float = REST,
) -> RetentionReport:
    """Prune in batches; `progress(deleted so far, batches)` after each one. A retired day is
    decided in steps of about `step` observations, resting `rest` times each step's length in
    between. Then the day segments whose day is over are sealed (ledger/sealing.py). One pass at
    a time over the database: a pass that finds another server's running returns at once,
    `skipped`."""
    at = now or datetime.now(UTC)
    cutoff = at - keep
    async with pool.acquire() as guard:
        if not await guard.fetchval("SELECT pg_try_advisory_lock($1)", RETENTION_LOCK_KEY):
            return RetentionReport(deleted=0, batches=0, cutoff=cutoff, skipped=True)
        try:
            report = await _pass(pool, cutoff, batch, progress, step, rest)
            return msgspec.structs.replace(report, segments_sealed=await seal_due(pool, now=at))
        finally:
            await guard.execute("SELECT pg_advisory_unlock($1)", RETENTION_LOCK_KEY)


async def _pass(
    pool: asyncpg.Pool,
    cutoff: datetime,
    batch: int,
    progress: Callable[[int, int], None] | None,
    step: int,
    rest: float,
) -> RetentionReport:
    deleted = batches = kept = steps = 0
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
        n, k, m = await _retire_segment(pool, day, table, attached, step=step, rest=rest)
        deleted += n
        kept += k
        steps += m
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
        deleted=deleted,
        batches=batches,
        cutoff=cutoff,
        segments_dropped=dropped_days,
        kept_past_day=kept,
        steps=steps,
    )
