"""Bounded telemetry: prune observation events by policy; lifecycle events are never pruned.

Policy: keep every observation received within `keep` of `now`, and always the newest observation
per node and kind (host telemetry) and per accelerator (its newest sample, in a node's snapshot or
an event of its own), however old, so the latest-telemetry read
models rebuild to the same rows after pruning. Storage under steady polling is then
O(nodes x reports per window), not O(time).

Pruning runs in small batches, each its own short transaction, so ingest is never blocked behind
it (DELETE takes no lock that an INSERT waits for).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import asyncpg
import msgspec

DEFAULT_KEEP = timedelta(hours=24)
_BATCH = 20_000

# An old observation goes only if a newer one of the same kind (same stream, type and accelerator;
# `data->>'accelerator_id'` is null for host telemetry) exists: the newest always stays. A node's
# snapshot (NODE_TELEMETRY_OBSERVED) goes only if a newer snapshot samples every accelerator it
# samples, so each accelerator's newest sample stays too (that of a GPU left out of an incomplete
# scan, which keeps its last telemetry, and that of a GPU gone missing).
_PRUNE = """
DELETE FROM events WHERE global_position IN (
    SELECT e.global_position FROM events e
    WHERE e.event_class = 'observation' AND e.received_at < $1
      AND EXISTS (
          SELECT 1 FROM events n
          WHERE n.stream_id = e.stream_id AND n.stream_version > e.stream_version
            AND n.event_class = 'observation' AND n.event_type = e.event_type
            AND (n.data->>'accelerator_id') IS NOT DISTINCT FROM (e.data->>'accelerator_id')
            AND (e.event_type <> 'NODE_TELEMETRY_OBSERVED'
                 OR coalesce(n.data->'accelerators', '[]') @> (
                     SELECT coalesce(jsonb_agg(jsonb_build_object('uuid', a->'uuid')), '[]')
                     FROM jsonb_array_elements(coalesce(e.data->'accelerators', '[]')) a)))
    LIMIT $2)
"""


class RetentionReport(msgspec.Struct, frozen=True):
    deleted: int
    batches: int
    cutoff: datetime


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
    deleted = batches = 0
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
    return RetentionReport(deleted=deleted, batches=batches, cutoff=cutoff)
