"""`EventStore.append_many` (`mf_append_many`): a group commit's batch of streams in one call.

Every stream is checked on its own (version, tombstone, idempotency, hash chain) and every stream
that takes its events is written by one INSERT. A batch must store exactly what appending each
stream alone stores, and refuse exactly what it refuses; `mf_append` is the same call for one
stream.
"""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime

import asyncpg
import pytest

from collectors.facts import Known
from ledger.events import (
    HostTelemetryObserved,
    InventoryFailed,
    NewEvent,
    NodeDecommissioned,
    validate_metadata,
    validate_payload,
)
from ledger.store import AppendRequest, AppendResult, EventStore, LedgerError, StreamTombstoned
from ledger.verify import verify_chains
from tests.builders import new

TODAY = datetime.now(UTC)


def sample(i: int, at: datetime = TODAY) -> NewEvent:
    return new(HostTelemetryObserved(telemetry={"memory_available_bytes": Known(i)}, storage=[]), at)


def lifecycle(reason: str) -> NewEvent:
    return new(InventoryFailed(stage="host", reason=reason))


async def batch(store: EventStore, requests: list[AppendRequest]) -> list[AppendResult]:
    """Append as a group commit does: every stream locked first, in one transaction."""
    async with store.pool.acquire() as conn, conn.transaction():
        await store.open_streams(conn, sorted(r.stream_id for r in requests), "")
        return await store.append_many(conn, requests, locked=True)


async def log_rows(pool: asyncpg.Pool) -> list[asyncpg.Record]:
    async with pool.acquire() as conn:
        return await conn.fetch(
            "SELECT stream_id, stream_version, event_id, event_type, data, received_at, segment, "
            "recorded_at, global_position FROM events ORDER BY stream_id, stream_version"
        )


async def streams(pool: asyncpg.Pool) -> dict[str, tuple[int, int, bytes | None, datetime | None]]:
    async with pool.acquire() as conn:
        rows = await conn.fetch("SELECT * FROM streams")
    return {
        r["stream_id"]: (r["version"], r["lifecycle_version"], r["head_hash"], r["tombstoned_at"])
        for r in rows
    }


async def test_a_plain_batch_is_stored_as_each_stream_alone_would_store_it(pool: asyncpg.Pool) -> None:
    alone, together = EventStore(pool), EventStore(pool)
    # Streams with history (a lifecycle head) and a new one; today's samples land on today's
    # segment, an old day's on the permanent one.
    for store, side in ((alone, "a"), (together, "b")):
        await store.append(f"{side}-1", 0, [lifecycle("x"), sample(1)])
        await store.append(f"{side}-2", 0, [lifecycle("y")])

    def events() -> dict[str, list[NewEvent]]:
        return {
            "1": [sample(2), sample(3, datetime(2026, 1, 5, tzinfo=UTC))],
            "2": [sample(4)],
            "3": [sample(5)],
        }

    expected = {"1": 2, "2": 1, "3": 0}
    for key, evs in events().items():
        await alone.append(f"a-{key}", expected[key], evs)
    results = await batch(
        together, [AppendRequest(f"b-{k}", expected[k], evs) for k, evs in events().items()]
    )

    assert [(r.stream_id, r.stream_version, r.already_stored) for r in results] == [
        ("b-1", 4, False),
        ("b-2", 2, False),
        ("b-3", 1, False),
    ]
    rows = await log_rows(pool)

    def side(prefix: str) -> list[tuple[object, ...]]:
        return [
            (
                r["stream_id"][2:],
                r["stream_version"],
                r["event_type"],
                r["data"],
                r["received_at"],
                r["segment"],
            )
            for r in rows
            if r["stream_id"].startswith(prefix)
        ]

    assert side("a") == side("b")
    written = [
        r
        for r in rows
        if (r["stream_id"], r["stream_version"])
        in {(x.stream_id, e.stream_version) for x in results for e in x.events}
    ]
    assert len(written) == 4
    assert {r["segment"] for r in written} == {TODAY.date(), date.max}
    # The set-wise write: one recorded_at for the whole batch (stream by stream, one per stream).
    assert len({r["recorded_at"] for r in written}) == 1
    # What each result says is what the log holds.
    for result in results:
        stored = [
            (r["global_position"], r["stream_version"]) for r in rows if r["stream_id"] == result.stream_id
        ]
        assert [(e.global_position, e.stream_version) for e in result.events] == stored[-len(result.events) :]
    # The streams table: versions advanced, lifecycle heads untouched, the new stream created.
    table = await streams(pool)
    for key in expected:
        assert table[f"a-{key}"][:2] == table[f"b-{key}"][:2]
        assert (table[f"a-{key}"][2] is None) == (table[f"b-{key}"][2] is None)
    assert table["b-3"] == (1, 0, None, None)


async def test_a_stream_at_another_version_fails_the_whole_batch_and_writes_nothing(
    pool: asyncpg.Pool,
) -> None:
    store = EventStore(pool)
    await store.append("s-1", 0, [sample(1)])
    await store.append("s-2", 0, [sample(1)])
    before = await log_rows(pool)
    with pytest.raises(LedgerError):
        await batch(store, [AppendRequest("s-1", 1, [sample(2)]), AppendRequest("s-2", 0, [sample(2)])])
    assert await log_rows(pool) == before
    assert {k: v[0] for k, v in (await streams(pool)).items()} == {"s-1": 1, "s-2": 1}


async def test_a_tombstoned_stream_fails_the_whole_batch(pool: asyncpg.Pool) -> None:
    store = EventStore(pool)
    await store.append("s-1", 0, [sample(1)])
    async with pool.acquire() as conn:
        await conn.execute("UPDATE streams SET tombstoned_at = now() WHERE stream_id = 's-1'")
    with pytest.raises(LedgerError):
        await batch(store, [AppendRequest("s-1", None, [sample(2)]), AppendRequest("s-2", 0, [sample(2)])])
    assert [r["stream_id"] for r in await log_rows(pool)] == ["s-1"]


async def test_a_retried_stream_in_a_batch_gets_what_it_stored_and_the_others_are_appended(
    pool: asyncpg.Pool,
) -> None:
    store = EventStore(pool)
    retried = [sample(1), sample(2)]
    first = await store.append("s-1", 0, retried)
    results = await batch(store, [AppendRequest("s-1", 0, retried), AppendRequest("s-2", 0, [sample(3)])])
    assert results[0].already_stored
    assert [e.global_position for e in results[0].events] == [e.global_position for e in first.events]
    assert not results[1].already_stored and results[1].stream_version == 1
    assert [(r["stream_id"], r["stream_version"]) for r in await log_rows(pool)] == [
        ("s-1", 1),
        ("s-1", 2),
        ("s-2", 1),
    ]


async def test_an_event_id_stored_on_another_stream_fails_the_batch(pool: asyncpg.Pool) -> None:
    store = EventStore(pool)
    shared = NewEvent(payload=sample(1).payload, metadata=sample(1).metadata, event_id=uuid.uuid4())
    await store.append("s-1", 0, [shared])
    with pytest.raises(LedgerError):
        await batch(
            store, [AppendRequest("s-2", 0, [sample(2), shared]), AppendRequest("s-3", 0, [sample(3)])]
        )
    assert [r["stream_id"] for r in await log_rows(pool)] == ["s-1"]


async def test_a_batch_with_lifecycle_events_keeps_each_hash_chain(pool: asyncpg.Pool) -> None:
    alone, together = EventStore(pool), EventStore(pool)
    await alone.append("a-1", 0, [lifecycle("x")])
    await together.append("b-1", 0, [lifecycle("x")])
    await alone.append("a-1", 1, [sample(1), lifecycle("y")])
    await alone.append("a-2", 0, [lifecycle("z")])
    await batch(
        together,
        [AppendRequest("b-1", 1, [sample(1), lifecycle("y")]), AppendRequest("b-2", 0, [lifecycle("z")])],
    )
    table = await streams(pool)
    assert table["a-1"][:2] == table["b-1"][:2] == (3, 2)
    assert table["a-2"][:2] == table["b-2"][:2] == (1, 1)
    async with pool.acquire() as conn:
        chained = await conn.fetch(
            "SELECT stream_id, stream_version, prev_hash IS NOT NULL AS linked, hash IS NOT NULL AS hashed "
            "FROM events WHERE stream_id LIKE 'b-%' ORDER BY stream_id, stream_version"
        )
    assert [(r["stream_id"], r["stream_version"], r["linked"], r["hashed"]) for r in chained] == [
        ("b-1", 1, False, True),
        ("b-1", 2, False, False),
        ("b-1", 3, True, True),
        ("b-2", 1, False, True),
    ]
    async with pool.acquire() as conn:
        # Written set-wise (one recorded_at for the batch), and every hash, link and head holds.
        stamps = await conn.fetch(
            "SELECT DISTINCT recorded_at FROM events WHERE (stream_id, stream_version) IN "
            "(('b-1', 2), ('b-1', 3), ('b-2', 1))"
        )
        report = await verify_chains(conn)
    assert len(stamps) == 1
    assert report.ok and report.lifecycle_events == 6, report.breaks


async def test_a_batch_that_tombstones_a_stream_writes_it_with_the_others(pool: asyncpg.Pool) -> None:
    store = EventStore(pool)
    await store.append("s-1", 0, [lifecycle("x")])
    decommission = new(
        NodeDecommissioned(
            node_id="s-1",
            actor="op",
            reason="retired",
            decommissioned_at=TODAY,
            generation=1,
            digest="0" * 64,
        )
    )
    await batch(store, [AppendRequest("s-1", 1, [decommission]), AppendRequest("s-2", 0, [sample(1)])])
    table = await streams(pool)
    assert table["s-1"][0] == 2 and table["s-1"][3] is not None, "the stream is tombstoned"
    assert table["s-2"][0] == 1 and table["s-2"][3] is None
    async with pool.acquire() as conn:
        assert (await verify_chains(conn)).ok
        stamps = await conn.fetch(
            "SELECT DISTINCT recorded_at FROM events WHERE (stream_id, stream_version) IN "
            "(('s-1', 2), ('s-2', 1))"
        )
    assert len(stamps) == 1, "one INSERT for the batch"
    with pytest.raises(StreamTombstoned):
        await store.append("s-1", None, [sample(2)])


async def test_a_retry_that_expected_any_version_is_answered_in_the_same_call(pool: asyncpg.Pool) -> None:
    store = EventStore(pool)
    retried = [sample(1)]
    first = await store.append("s-1", None, retried)
    results = await batch(
        store, [AppendRequest("s-1", None, retried), AppendRequest("s-2", None, [sample(2)])]
    )
    assert results[0].already_stored
    assert [e.global_position for e in results[0].events] == [e.global_position for e in first.events]
    assert not results[1].already_stored and results[1].stream_version == 1
    assert {k: v[0] for k, v in (await streams(pool)).items()} == {"s-1": 1, "s-2": 1}


async def test_mf_append_is_the_one_stream_call(pool: asyncpg.Pool) -> None:
    """The database's one-stream entry point keeps its checks (the 0.1 interface, migrations)."""
    ids = [uuid.uuid4(), uuid.uuid4()]
    (data, _), (meta, _) = validate_payload(sample(1).payload), validate_metadata(sample(1).metadata)
    call = (
        "SELECT * FROM mf_append('s-1', $1, $2, ARRAY['HOST_TELEMETRY_OBSERVED', 'HOST_TELEMETRY_OBSERVED'], "
        "ARRAY['observation', 'observation'], ARRAY[1, 1], ARRAY[$3::jsonb, $3::jsonb], "
        "ARRAY[$4::jsonb, $4::jsonb])"
    )
    async with pool.acquire() as conn:
        stored = await conn.fetch(call, 0, ids, data.decode(), meta.decode())
        assert [(r["out_stream_version"], r["out_already_stored"]) for r in stored] == [
            (1, False),
            (2, False),
        ]
        again = await conn.fetch(call, 0, ids, data.decode(), meta.decode())
        assert [r["out_global_position"] for r in again] == [r["out_global_position"] for r in stored]
        assert all(r["out_already_stored"] for r in again)
        with pytest.raises(asyncpg.PostgresError) as refused:
            await conn.fetch(call, 1, [uuid.uuid4(), uuid.uuid4()], data.decode(), meta.decode())
        assert refused.value.sqlstate == "MF409"
    assert {k: v[0] for k, v in (await streams(pool)).items()} == {"s-1": 2}


@pytest.mark.parametrize(
    ("stream_ids", "counts"),
    [(["s-1", "s-1"], [1, 1]), (["s-1", "s-2"], [2, 1]), (["s-1", "s-2"], [2, 0])],
    ids=["a stream twice", "counts past the events", "an empty stream"],
)
async def test_a_malformed_call_is_refused_and_writes_nothing(
    pool: asyncpg.Pool, stream_ids: list[str], counts: list[int]
) -> None:
    (data, _), (meta, _) = validate_payload(sample(1).payload), validate_metadata(sample(1).metadata)
    async with pool.acquire() as conn:
        with pytest.raises(asyncpg.InvalidParameterValueError):
            await conn.fetch(
                "SELECT * FROM mf_append_many($1, ARRAY[NULL, NULL]::bigint[], $2, $3, "
                "ARRAY['HOST_TELEMETRY_OBSERVED', 'HOST_TELEMETRY_OBSERVED'], "
                "ARRAY['observation', 'observation'], ARRAY[1, 1], ARRAY[$4::jsonb, $4::jsonb], "
                "ARRAY[$5::jsonb, $5::jsonb], ARRAY[NULL, NULL]::bytea[], ARRAY[now(), now()], "
                "ARRAY[NULL, NULL]::uuid[])",
                stream_ids,
                counts,
                [uuid.uuid4(), uuid.uuid4()],
                data.decode(),
                meta.decode(),
            )
    assert await log_rows(pool) == []
