"""The event store on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import collections
import uuid

import asyncpg
import pytest

from collectors.facts import Known
from ledger.events import EventValidationError, HostTelemetryObserved, InventoryFailed, NewEvent
from ledger.store import Checkpoint, EventStore, StreamVersionConflict
from tests.builders import meta, new


def telemetry(i: int) -> NewEvent:
    return new(HostTelemetryObserved(telemetry={"memory_available_bytes": Known(i)}, storage=[]))


def lifecycle(reason: str = "x") -> NewEvent:
    return new(InventoryFailed(stage="host", reason=reason))


async def test_catch_up_reader_sees_every_committed_event_exactly_once(pool: asyncpg.Pool) -> None:
    """8 writers x 10-event transactions on different streams while a reader follows the gap-safe
    catch-up read in pages of 2,000: 5 rounds of 8,000 events, nothing skipped, nothing twice.

    Eight writers commit out of position order in every round: already in the first, a reader
    without the xmin gate skips hundreds of its events, and one ordering or resuming by position
    alone delivers dozens to hundreds twice. Transaction ids gaining a digit, which only a long run
    crosses by chance, is tested head-on in tests/test_log_reading.py."""
    store = EventStore(pool)  # the log alone: this is about the catch-up order, not projections
    writers, batch, rounds, per_round = 8, 10, 5, 8_000
    per_writer = per_round // (writers * batch)
    checkpoint = Checkpoint()
    for round_no in range(rounds):
        written: set[uuid.UUID] = set()
        seen: list[uuid.UUID] = []
        done = asyncio.Event()

        async def writer(w: int, round_no: int = round_no, written: set[uuid.UUID] = written) -> None:
            stream = f"round-{round_no}-writer-{w}"
            version = 0
            for _ in range(per_writer):
                events = [telemetry(i) for i in range(batch)]
                # A transaction of its own per batch, where the store's group commit would have
                # merged them into fewer: on a connection outside a transaction block, the append's
                # one statement commits alone (its positions are taken, then it commits after its
                # other writes and the WAL flush), so eight writers' transactions commit in any order.
                async with pool.acquire() as conn:
                    assert not conn.is_in_transaction()
                    await store.append(stream, version, events, conn=conn)
                version += batch
                written.update(e.event_id for e in events)

        async def reader(seen: list[uuid.UUID] = seen, done: asyncio.Event = done) -> None:
            # Follows the log until every written event has arrived (the xmin horizon is
            # cluster-wide, so another session's open transaction may hold delivery back for a
            # while: the reader waits, it never gives up on an empty read), then reads once more
            # to show nothing arrives twice.
            nonlocal checkpoint
            deadline = None
            async with pool.acquire() as conn:
                while True:
                    events, checkpoint = await store.read_all(checkpoint, limit=2000, conn=conn)
                    seen.extend(e.event_id for e in events)
                    if done.is_set():
                        deadline = deadline or asyncio.get_running_loop().time() + 60
                        if len(seen) >= per_round or asyncio.get_running_loop().time() > deadline:
                            extra, checkpoint = await store.read_all(checkpoint, limit=2000, conn=conn)
                            seen.extend(e.event_id for e in extra)
                            return
                    if not events:
                        await asyncio.sleep(0.001)

        reading = asyncio.create_task(reader())
        await asyncio.gather(*(writer(w) for w in range(writers)))
        done.set()
        await reading
        assert len(written) == per_round
        if len(seen) != len(set(seen)):  # say which rows, so a failure can be diagnosed
            twice = [k for k, n in collections.Counter(seen).items() if n > 1]
            async with pool.acquire() as conn:
                rows = await conn.fetch(
                    "SELECT event_id, tx_id::text AS tx, global_position, stream_id, ctid::text AS row_ctid "
                    "FROM events WHERE event_id = ANY($1) ORDER BY global_position",
                    twice[:20],
                )
            detail = [dict(r) for r in rows]
            raise AssertionError(f"round {round_no}: {len(twice)} events delivered twice: {detail}")
        assert set(seen) == written, f"round {round_no}: {len(written - set(seen))} events skipped"


async def test_late_commit_is_skipped_by_a_naive_reader_but_not_by_ours(pool: asyncpg.Pool) -> None:
    store = EventStore(pool)
    a = await pool.acquire()
    b = await pool.acquire()
    try:
        tx_a = a.transaction()
        await tx_a.start()
        first = await store.append("stream-a", 0, [lifecycle("a")], conn=a)  # takes a position...
        await store.append("stream-b", 0, [lifecycle("b")])  # ...B takes a later one and commits first
        pos_a = first.events[0].global_position

        naive_last = 0
        rows = await b.fetch(
            "SELECT global_position FROM events WHERE global_position > $1 ORDER BY 1", naive_last
        )
        naive_seen = [r[0] for r in rows]
        naive_last = max(naive_seen)
        assert pos_a not in naive_seen and naive_last > pos_a

        ours, cp = await store.read_all(Checkpoint(), conn=b)
        assert ours == [], "nothing may be delivered while an older transaction is still open"

        await tx_a.commit()
        rows = await b.fetch("SELECT global_position FROM events WHERE global_position > $1", naive_last)
        assert rows == [], "the naive reader has passed A's event for good"

        # Delivered once the horizon passes A; another session's open transaction on this cluster
        # may hold it back a while (the reader waits, it never skips).
        ours = []
        deadline = asyncio.get_running_loop().time() + 60
        while len(ours) < 2 and asyncio.get_running_loop().time() < deadline:
            more, cp = await store.read_all(cp, conn=b)
            ours.extend(more)
            if not more:
                await asyncio.sleep(0.05)
        assert [e.stream_id for e in ours] == ["stream-a", "stream-b"]
        again, _ = await store.read_all(cp, conn=b)
        assert again == []
    finally:
        await pool.release(a)
        await pool.release(b)


async def test_two_appenders_same_expected_version_exactly_one_wins(store: EventStore) -> None:
    await store.append("s", 0, [lifecycle("base")])
    results = await asyncio.gather(
        store.append("s", 1, [lifecycle("one"), lifecycle("one-b")]),
        store.append("s", 1, [lifecycle("two"), lifecycle("two-b")]),
        return_exceptions=True,
    )
    wins = [r for r in results if not isinstance(r, BaseException)]
    conflicts = [r for r in results if isinstance(r, StreamVersionConflict)]
    assert len(wins) == 1 and len(conflicts) == 1
    assert conflicts[0].expected == 1 and conflicts[0].actual == 3
    events = await store.read_stream("s")
    assert [e.stream_version for e in events] == [1, 2, 3]
    reasons = [e.payload.reason for e in events]  # type: ignore[union-attr]
    assert reasons in (["base", "one", "one-b"], ["base", "two", "two-b"])


async def test_stale_expected_version_raises_typed_conflict_and_writes_nothing(store: EventStore) -> None:
    await store.append("s", 0, [lifecycle()])
    with pytest.raises(StreamVersionConflict):
        await store.append("s", 0, [lifecycle("late")])
    assert len(await store.read_stream("s")) == 1


async def test_same_event_appended_twice_is_stored_once(store: EventStore) -> None:
    batch = [lifecycle("a"), telemetry(1)]
    first = await store.append("s", 0, batch)
    second = await store.append("s", 0, batch)  # a retry: stale version, same ids
    assert second.already_stored and not first.already_stored
    assert [e.global_position for e in second.events] == [e.global_position for e in first.events]
    async with store.pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM events") == 2


async def test_lifecycle_events_are_immutable_in_sql(store: EventStore) -> None:
    await store.append("s", 0, [lifecycle(), telemetry(1)])
    async with store.pool.acquire() as conn:
        with pytest.raises(asyncpg.PostgresError, match="immutable"):
            await conn.execute("UPDATE events SET data = '{}' WHERE event_class = 'lifecycle'")
        with pytest.raises(asyncpg.PostgresError, match="immutable"):
            await conn.execute("DELETE FROM events WHERE event_class = 'lifecycle'")
        with pytest.raises(asyncpg.PostgresError, match="truncated"):
            await conn.execute("TRUNCATE events")
        # observation events may be pruned by retention
        assert await conn.execute("DELETE FROM events WHERE event_class = 'observation'") == "DELETE 1"
        assert await conn.fetchval("SELECT count(*) FROM events") == 1


async def test_event_failing_schema_validation_is_refused_and_nothing_written(store: EventStore) -> None:
    good = lifecycle()
    bad_type = NewEvent(payload=InventoryFailed(stage="host", reason=42), metadata=meta())  # type: ignore[arg-type]
    not_in_catalog = NewEvent(payload=meta(), metadata=meta())  # type: ignore[arg-type]
    for bad in (bad_type, not_in_catalog):
        with pytest.raises(EventValidationError):
            await store.append("s", 0, [good, bad])
    async with store.pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM events") == 0
        assert await conn.fetchval("SELECT count(*) FROM streams") == 0


async def test_an_append_with_projections_outside_a_transaction_is_refused_and_writes_nothing(
    store: EventStore,
) -> None:
    """Its events and their read-model rows are one unit of work: on a bare connection each
    statement would commit alone, so a failure between them would leave events without rows."""
    async with store.pool.acquire() as conn:
        with pytest.raises(RuntimeError, match="transaction"):
            await store.append("s", 0, [lifecycle()], conn=conn)
        assert await conn.fetchval("SELECT count(*) FROM events") == 0
        async with conn.transaction():
            await store.append("s", 0, [lifecycle()], conn=conn)
        assert await conn.fetchval("SELECT count(*) FROM events") == 1


async def test_hash_chain_links_lifecycle_events(store: EventStore) -> None:
    await store.append("s", 0, [lifecycle("a"), telemetry(1), lifecycle("b")])
    async with store.pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT event_class, prev_hash, hash, mf_event_hash(prev_hash, stream_id, stream_version, event_id, "
            "event_type, schema_version, data, metadata, recorded_at) AS recomputed FROM events ORDER BY 1, stream_version"
        )
        head = await conn.fetchval("SELECT head_hash FROM streams WHERE stream_id = 's'")
    life = [r for r in rows if r["event_class"] == "lifecycle"]
    assert life[0]["prev_hash"] is None and life[1]["prev_hash"] == life[0]["hash"]
    assert all(r["hash"] == r["recomputed"] for r in life)
    assert head == life[1]["hash"]


async def test_event_hash_is_inlined_into_the_appends_plan(store: EventStore) -> None:
    # Declared IMMUTABLE over a STABLE body (concat_ws), the hash was a SQL function PostgreSQL
    # cannot inline: every transaction that appended a lifecycle event parsed and planned its
    # body again. Inlined, the caller's cached plan holds the expression itself.
    async with store.pool.acquire() as conn:
        plan = "\n".join(
            r[0]
            for r in await conn.fetch(
                "EXPLAIN (VERBOSE) SELECT mf_event_hash(NULL, 's', 1, gen_random_uuid(), 'T', 1, "
                "'{}'::jsonb, '{}'::jsonb, now())"
            )
        )
    assert "sha256(" in plan and "mf_event_hash" not in plan, plan


async def test_migrate_is_idempotent(pool: asyncpg.Pool) -> None:
    from ledger.schema import LATEST_SCHEMA_VERSION, migrate

    # Day partitions of the log are left out: `migrate` keeps segments ahead of today, so once
    # the UTC day has turned since the template was made it adds the new day's (a run across
    # midnight failed here on 2026-12-02 00:03 for that reason alone).
    snapshot = (
        "SELECT string_agg(c.table_name || '.' || c.column_name || ':' || c.data_type, ',' ORDER BY 1) "
        "FROM information_schema.columns c JOIN pg_class r ON r.relname = c.table_name "
        "AND r.relnamespace = 'public'::regnamespace WHERE c.table_schema = 'public' AND NOT r.relispartition"
    )
    count_indexes = (
        "SELECT count(*) FROM pg_indexes i JOIN pg_class r ON r.relname = i.tablename "
        "AND r.relnamespace = 'public'::regnamespace WHERE i.schemaname = 'public' AND NOT r.relispartition"
    )
    async with pool.acquire() as conn:
        before = await conn.fetchval(snapshot)
        indexes = await conn.fetchval(count_indexes)
        assert await migrate(conn) == LATEST_SCHEMA_VERSION
        assert await migrate(conn) == LATEST_SCHEMA_VERSION
        assert await conn.fetchval(snapshot) == before
        assert await conn.fetchval(count_indexes) == indexes
        assert await conn.fetchval("SELECT count(*) FROM schema_version") == LATEST_SCHEMA_VERSION


async def test_concurrent_appends_share_transactions_and_a_conflict_fails_only_its_own(
    store: EventStore,
) -> None:
    """EventStore.append without a connection group-commits: appends to different streams made
    at once share transactions, and a stale expected version refuses that append alone."""
    await store.append("stale", 0, [lifecycle("base")])
    outcomes = await asyncio.gather(
        *(store.append(f"s{i}", 0, [lifecycle(f"r{i}"), telemetry(i)]) for i in range(6)),
        store.append("stale", 0, [lifecycle("late")]),
        return_exceptions=True,
    )
    assert all(not isinstance(o, BaseException) for o in outcomes[:6])
    assert isinstance(outcomes[6], StreamVersionConflict) and outcomes[6].stream_id == "stale"
    async with store.pool.acquire() as conn:
        per_stream = await conn.fetch(
            "SELECT stream_id, count(*) AS n, count(DISTINCT tx_id) AS tx FROM events GROUP BY stream_id"
        )
        transactions = await conn.fetchval(
            "SELECT count(DISTINCT tx_id) FROM events WHERE stream_id <> 'stale'"
        )
    assert {r["stream_id"]: r["n"] for r in per_stream} == {**{f"s{i}": 2 for i in range(6)}, "stale": 1}
    assert all(r["tx"] == 1 for r in per_stream)  # each append all in one transaction
    assert transactions < 6  # and appends made together share them
