"""bench.ingest's retention tier: old telemetry snapshots put on a past day's segment for the
product's prune to remove while the closed loop runs, and the events table's size and dead tuples."""

from __future__ import annotations

from datetime import date, timedelta
from typing import Any

from bench import harness as h

RETENTION_STREAMS = 200  # the old snapshots are spread over this many simulated node streams


async def fill_old_telemetry(pool: Any, events: int) -> date:
    """`events` NODE_TELEMETRY_OBSERVED snapshots received over the whole UTC day before yesterday
    (copies of a real report's stored snapshot) on that day's segment, as the product's appends
    put them there, in `RETENTION_STREAMS` streams of their own, each ending with one snapshot
    received now: everything on the old day is prunable. Returns the day."""
    from ledger.segments import ensure_segments

    per = max(2, events // RETENTION_STREAMS)
    async with pool.acquire() as conn:
        today = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
        day = today - timedelta(days=2)
        await ensure_segments(conn, day, ahead=0)
        await ensure_segments(conn, today, ahead=0)
        await conn.execute(
            """
            INSERT INTO events (event_id, stream_id, stream_version, event_type, event_class,
                                schema_version, data, metadata, body, sampled, recorded_at,
                                received_at, segment)
            SELECT gen_random_uuid(), 'retention-sim-' || s, v, e.event_type, e.event_class,
                   e.schema_version, e.data, e.metadata, e.body, e.sampled, now(), r.at,
                   (r.at AT TIME ZONE 'UTC')::date
            FROM (SELECT * FROM events WHERE event_type = 'NODE_TELEMETRY_OBSERVED' LIMIT 1) e,
                 generate_series(1, $1) s, generate_series(1, $2) v,
                 LATERAL (SELECT CASE WHEN v = $2 THEN now()
                                 ELSE ($4::date)::timestamp AT TIME ZONE 'UTC' + (v - 1) * ($3 * interval '1 second')
                                 END AS at) r
            """,
            RETENTION_STREAMS,
            per,
            86_400.0 / per,
            day,
        )
        await conn.execute("VACUUM ANALYZE events")
    return day


async def table_figures(pool: Any) -> tuple[int, int]:
    """(bytes of the events table: every partition with its TOAST and indexes, dead tuples)."""
    async with pool.acquire() as conn:
        size = await conn.fetchval(
            f"SELECT sum(pg_total_relation_size(relid)) FROM ({h.LOG_PARTITIONS}) leaves"
        )
        dead = await conn.fetchval(
            f"SELECT sum(n_dead_tup) FROM pg_stat_user_tables WHERE relid IN ({h.LOG_PARTITIONS})"
        )
    return int(size), int(dead or 0)
