"""A snapshot of format 4 (as of 3) names its GPUs by their index in a stored set (ledger/gpu_sets.py,
docs/storage.md): the store writes the set with the first snapshot that names it, every reader
gets the snapshot back exactly, a set is never changed or removed, and neither a rolled-back
append nor a set lost to a failover leaves a snapshot that cannot be read."""

from __future__ import annotations

import uuid
from datetime import timedelta

import asyncpg
import pytest

from collectors.facts import Known
from ledger.compact import gpu_set
from ledger.events import AcceleratorSample, NodeTelemetryObserved, RecordedEvent
from ledger.reading import EVENT_COLUMNS, event_from_row
from ledger.store import EventStore
from tests.builders import T0, new

GPUS = [f"GPU-{uuid.UUID(int=n * 7919)}" for n in (5, 1, 3)]  # listed out of byte order


def snapshot(temperature: int, gpus: list[str] = GPUS) -> NodeTelemetryObserved:
    return NodeTelemetryObserved(
        telemetry={"memory_available_bytes": Known(1 << 30)},
        storage=[],
        accelerators=[
            AcceleratorSample(f"acc-{i}", u, {"temperature_celsius": Known(temperature + i)})
            for i, u in enumerate(gpus)
        ],
    )


async def logged(pool: asyncpg.Pool, stream: str) -> list[tuple[int, RecordedEvent]]:
    """Each stored snapshot's format and the event the log's reader gives back."""
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            f"SELECT {EVENT_COLUMNS} FROM events WHERE stream_id = $1 ORDER BY stream_version", stream
        )
    return [(r["body"][1], event_from_row(r)) for r in rows]


async def append(store: EventStore, stream: str, temperature: int) -> None:
    await store.append(stream, None, [new(snapshot(temperature), T0 + timedelta(seconds=temperature))])


async def test_snapshots_name_their_stored_set_and_read_back_exactly(pool: asyncpg.Pool) -> None:
    store = EventStore(pool)
    stream = str(uuid.uuid4())
    for t in (40, 41, 42):
        await append(store, stream, t)
    got = await logged(pool, stream)
    assert [form for form, _ in got] == [4, 4, 4]
    assert [e.payload for _, e in got] == [snapshot(t) for t in (40, 41, 42)]
    async with pool.acquire() as conn:
        stored = await conn.fetch("SELECT sampled, gpus FROM gpu_sets")
    assert [(r["sampled"], r["gpus"]) for r in stored] == [
        (gpu_set(snapshot(0)).sampled, ",".join(sorted(GPUS)))
    ]
    # another node's store (another server) finds the set stored and names it too
    other = str(uuid.uuid4())
    await append(EventStore(pool), other, 50)
    assert [form for form, _ in await logged(pool, other)] == [4]


async def test_a_rolled_back_append_leaves_no_snapshot_naming_a_set_that_is_not_stored(
    pool: asyncpg.Pool,
) -> None:
    store = EventStore(pool)
    stream = str(uuid.uuid4())
    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        await store.append(stream, None, [new(snapshot(40))], conn=conn)
        await tx.rollback()
        assert await conn.fetchval("SELECT count(*) FROM gpu_sets") == 0
    await append(store, stream, 41)
    await append(store, stream, 42)
    got = await logged(pool, stream)
    assert [(form, e.payload) for form, e in got] == [(4, snapshot(41)), (4, snapshot(42))]


async def test_a_set_a_failover_lost_is_stored_again_before_a_snapshot_names_it(pool: asyncpg.Pool) -> None:
    store = EventStore(pool)
    stream = str(uuid.uuid4())
    await append(store, stream, 40)
    await append(store, stream, 41)  # the set found committed: remembered, not written again
    async with pool.acquire() as conn:
        # what a standby promoted without the set's commit holds
        await conn.execute("ALTER TABLE gpu_sets DISABLE TRIGGER gpu_sets_immutable")
        await conn.execute("DELETE FROM gpu_sets")
        await conn.execute("ALTER TABLE gpu_sets ENABLE TRIGGER gpu_sets_immutable")
    await append(store, stream, 42)  # refused by the database, then run again at once
    got = await logged(pool, stream)
    assert [e.payload for _, e in got][2:] == [snapshot(42)] and got[2][0] == 4
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM gpu_sets") == 1


async def test_a_set_stored_under_the_digest_with_other_gpus_is_never_named(pool: asyncpg.Pool) -> None:
    digest = gpu_set(snapshot(0)).sampled
    async with pool.acquire() as conn:
        # an md5 collision, which the table's check would otherwise refuse
        await conn.execute("ALTER TABLE gpu_sets DROP CONSTRAINT gpu_sets_digest_check")
        await conn.execute("INSERT INTO gpu_sets (sampled, gpus) VALUES ($1, 'GPU-other')", digest)
    store = EventStore(pool)
    stream = str(uuid.uuid4())
    await append(store, stream, 40)
    await append(store, stream, 41)
    assert [(form, e.payload) for form, e in await logged(pool, stream)] == [
        (2, snapshot(40)),
        (2, snapshot(41)),
    ]


async def test_a_stored_set_cannot_be_changed_removed_or_forged(pool: asyncpg.Pool) -> None:
    await append(EventStore(pool), str(uuid.uuid4()), 40)
    async with pool.acquire() as conn:
        for sql in ("UPDATE gpu_sets SET gpus = gpus", "DELETE FROM gpu_sets", "TRUNCATE gpu_sets"):
            with pytest.raises(asyncpg.RestrictViolationError, match=r"refused|cannot be truncated"):
                await conn.execute(sql)
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute("INSERT INTO gpu_sets (sampled, gpus) VALUES ($1, 'GPU-x')", uuid.uuid4())
        assert await conn.fetchval("SELECT count(*) FROM gpu_sets") == 1
