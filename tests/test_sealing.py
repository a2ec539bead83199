"""A day segment whose day is over is sealed (ledger/sealing.py, docs/storage.md): its indexes
rebuilt packed, the log reading exactly as before, appends still taken, and a rebuild cut short
finished by the next pass."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime, timedelta

import asyncpg

from api.services.metrics.exposition import render
from api.services.metrics.snapshot import read_snapshot
from api.services.reads.liveness import LivenessPolicy
from collectors.facts import Known
from ledger.events import AcceleratorSample, EventMetadata, NewEvent, NodeTelemetryObserved
from ledger.reading import EVENT_COLUMNS, event_from_row
from ledger.retention import RETENTION_LOCK_KEY, prune_observations
from ledger.segments import ensure_segments
from ledger.store import AppendRequest, EventStore

DAY = date(2026, 11, 20)
PARTITION = "events_d20261120"
AFTER_THE_DAY = datetime(2026, 11, 21, 1, 30, tzinfo=UTC)
STREAMS = [str(uuid.UUID(int=n * 104729)) for n in range(1, 41)]


def snapshot(stream: str, k: int) -> NewEvent:
    at = datetime(2026, 11, 20, 8, tzinfo=UTC) + timedelta(seconds=10 * k)
    payload = NodeTelemetryObserved(
        telemetry={"memory_available_bytes": Known(k)},
        storage=[],
        accelerators=[AcceleratorSample("a", f"GPU-{stream}", {"temperature_celsius": Known(40 + k % 30)})],
    )
    return NewEvent(payload=payload, metadata=EventMetadata(received_at=at, source="agent", observed_at=at))


async def fill(pool: asyncpg.Pool, reports: int) -> None:
    """`reports` snapshots of each stream, received on DAY, the streams interleaved as a fleet's are."""
    store = EventStore(pool)
    async with pool.acquire() as conn:
        await ensure_segments(conn, DAY, ahead=0)
        for k in range(reports):
            async with conn.transaction():
                await store.append_many(conn, [AppendRequest(s, None, [snapshot(s, k)]) for s in STREAMS])


async def the_log(pool: asyncpg.Pool) -> list[object]:
    async with pool.acquire() as conn:
        rows = await conn.fetch(f"SELECT {EVENT_COLUMNS} FROM events ORDER BY global_position")
    return [event_from_row(r) for r in rows]


async def indexes(pool: asyncpg.Pool) -> dict[str, tuple[int, bool, list[str] | None]]:
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT c.relname, pg_relation_size(c.oid) AS size, i.indisvalid, c.reloptions "
            "FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = $1::regclass",
            PARTITION,
        )
    return {r["relname"]: (r["size"], r["indisvalid"], r["reloptions"]) for r in rows}


async def seal_segments(pool: asyncpg.Pool, *, now: datetime) -> list[date]:
    """A retention pass at `now` that keeps a week (no day of these retired): the days it sealed."""
    report = await prune_observations(pool, keep=timedelta(days=7), now=now)
    return report.segments_sealed


async def unsealed_days(pool: asyncpg.Pool, now: datetime) -> int:
    """`modelforge_log_unsealed_day_segments` as a scrape at `now` shows it."""
    text = render(await read_snapshot(pool, LivenessPolicy(), {}, now)).decode()
    (line,) = [x for x in text.splitlines() if x.startswith("modelforge_log_unsealed_day_segments ")]
    return int(float(line.split()[1]))


async def sealed_days(pool: asyncpg.Pool) -> list[date]:
    async with pool.acquire() as conn:
        return [
            r["day"] for r in await conn.fetch("SELECT day FROM event_segments WHERE sealed_at IS NOT NULL")
        ]


async def test_a_day_over_is_sealed_packed_and_reads_as_before(pool: asyncpg.Pool) -> None:
    await fill(pool, 60)
    log = await the_log(pool)
    before = await indexes(pool)
    # not before its day is over and an hour has passed
    assert await seal_segments(pool, now=AFTER_THE_DAY - timedelta(hours=1)) == []
    assert await unsealed_days(pool, AFTER_THE_DAY - timedelta(hours=1)) == 0
    assert await unsealed_days(pool, AFTER_THE_DAY) == 1  # what an operator's alert watches
    assert await seal_segments(pool, now=AFTER_THE_DAY) == [DAY]
    assert await unsealed_days(pool, AFTER_THE_DAY) == 0
    after = await indexes(pool)
    assert set(after) == set(before)
    assert all(valid and options == ["fillfactor=100"] for _size, valid, options in after.values())
    # the indexes keyed by stream were about 60 % full
    assert sum(size for size, _, _ in after.values()) < 0.8 * sum(size for size, _, _ in before.values())
    assert await the_log(pool) == log
    assert await sealed_days(pool) == [DAY]
    assert await seal_segments(pool, now=AFTER_THE_DAY + timedelta(days=1)) == []
    # a late append still lands on the day, and reads back
    await EventStore(pool).append(STREAMS[0], None, [snapshot(STREAMS[0], 999)])
    assert len(await the_log(pool)) == len(log) + 1


async def test_a_rebuild_cut_short_is_finished_by_the_next_pass(pool: asyncpg.Pool) -> None:
    await fill(pool, 5)
    async with pool.acquire() as conn:
        # what REINDEX CONCURRENTLY leaves when it is stopped mid-way: an invalid copy
        try:
            await conn.execute(
                f"CREATE UNIQUE INDEX CONCURRENTLY {PARTITION}_pkey_ccnew ON {PARTITION} (stream_id)"
            )
        except asyncpg.UniqueViolationError:
            pass
    assert (await indexes(pool))[f"{PARTITION}_pkey_ccnew"][1] is False
    assert await seal_segments(pool, now=AFTER_THE_DAY) == [DAY]
    after = await indexes(pool)
    assert f"{PARTITION}_pkey_ccnew" not in after
    assert all(valid for _size, valid, _ in after.values())


async def test_no_segment_is_sealed_while_a_retention_pass_runs(pool: asyncpg.Pool) -> None:
    await fill(pool, 2)
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT pg_try_advisory_lock($1)", RETENTION_LOCK_KEY)
        try:
            assert await seal_segments(pool, now=AFTER_THE_DAY) == []
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", RETENTION_LOCK_KEY)
    assert await seal_segments(pool, now=AFTER_THE_DAY) == [DAY]
