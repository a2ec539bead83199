"""The one gap-safe read of the log, where transaction ids gain a digit.

Rows are written with chosen `tx_id` values (the column default is overridden) around 999/1,000,
99,999/100,000 and 999,999/1,000,000, in a shuffled order so that global positions disagree with
the commit order. Every limit from 1 to the row count must deliver each event exactly once, in
numeric (tx_id, position) order. A text sort ('100000' < '99999') fails this at every boundary.
"""

from __future__ import annotations

import asyncio
import random
import uuid

import asyncpg
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectors.facts import Known
from ledger import reading
from ledger.events import HostTelemetryObserved, validate_metadata, validate_payload
from ledger.reading import Checkpoint, LogFilter, StoredEvent, read_log
from tests.builders import meta
from tests.loop_support import OtherWork, ran_between, turns_at_calls

BOUNDARY_TXS = [
    997,
    998,
    999,
    1_000,
    1_001,
    99_998,
    99_999,
    100_000,
    100_001,
    999_998,
    999_999,
    1_000_000,
    1_000_001,
]


async def burn_transaction_ids_past(conn: asyncpg.Connection, target: int) -> None:
    """Move the cluster's transaction counter and the xmin horizon past `target`, so rows written
    with tx ids up to `target` are below the horizon and readable. Each subtransaction that writes
    takes its own id, so one DO block burns tens of thousands in a fraction of a second."""
    await conn.execute("CREATE TEMP TABLE IF NOT EXISTS burn (i int)")
    while await conn.fetchval("SELECT pg_current_xact_id()::text::bigint") <= target + 1:
        await conn.execute(
            "DO $$ BEGIN FOR i IN 1..50000 LOOP "
            "BEGIN INSERT INTO burn VALUES (i); EXCEPTION WHEN OTHERS THEN NULL; END; "
            "END LOOP; END $$"
        )
        await conn.execute("TRUNCATE burn")
    # The horizon is cluster-wide: another session's open transaction may hold it back a while.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 120
    while await conn.fetchval("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint") <= target:
        assert loop.time() < deadline, "the xmin horizon did not pass the chosen transaction ids"
        await asyncio.sleep(0.2)


async def write_rows(conn: asyncpg.Connection, txs: list[int], seed: int = 0) -> list[tuple[int, int]]:
    """One observation event per tx id given, inserted in a shuffled order, with its tx id set by
    hand. Returns (tx_id, global_position) of each, as the model of the expected order."""
    data = validate_payload(
        HostTelemetryObserved(telemetry={"memory_available_bytes": Known(1)}, storage=[])
    )[0].decode()
    metadata = validate_metadata(meta())[0].decode()
    order = list(txs)
    random.Random(seed).shuffle(order)
    written: list[tuple[int, int]] = []
    for tx in order:
        stream = f"boundary-{uuid.uuid4().hex[:12]}"
        position = await conn.fetchval(
            "INSERT INTO events (tx_id, event_id, stream_id, stream_version, event_type, event_class, "
            "schema_version, data, metadata) VALUES ($1::xid8, $2, $3, 1, 'HOST_TELEMETRY_OBSERVED', "
            "'observation', 1, $4::text::jsonb, $5::text::jsonb) RETURNING global_position",
            tx,
            uuid.uuid4(),
            stream,
            data,
            metadata,
        )
        written.append((tx, position))
    return written


async def read_everything(conn: asyncpg.Connection, limit: int) -> list[tuple[int, int]]:
    """Follow the log page by page with `resume` until an empty page."""
    seen: list[tuple[int, int]] = []
    after = Checkpoint()
    pages = 0
    while True:
        page = await read_log(conn, after, limit=limit)
        pages += 1
        assert pages < 10_000
        if not page.entries:
            assert page.resume == after, "an empty page resumes where it was asked to start"
            return seen
        assert len(page.entries) <= limit
        for entry in page.entries:
            assert not isinstance(entry, StoredEvent), entry.error
            row = await conn.fetchrow(
                "SELECT tx_id FROM events WHERE global_position = $1", entry.global_position
            )
            seen.append((row["tx_id"], entry.global_position))
        after = page.resume


async def test_every_limit_delivers_each_event_once_in_numeric_order_across_digit_boundaries(
    pool: asyncpg.Pool,
) -> None:
    async with pool.acquire() as conn:
        await burn_transaction_ids_past(conn, max(BOUNDARY_TXS))
        # Two events in most transactions, so the position breaks ties inside one tx id.
        written = await write_rows(conn, BOUNDARY_TXS + BOUNDARY_TXS[::2], seed=10)
        expected = sorted(written)
        assert [tx for tx, _ in expected][:5] == [997, 997, 998, 999, 999]
        for limit in range(1, len(written) + 1):
            got = await read_everything(conn, limit)
            assert got == expected, f"limit {limit}: {got} != {expected}"


async def host_samples(conn: asyncpg.Connection, streams: list[str]) -> None:
    """One host telemetry observation on each stream, each in a transaction of its own (real tx ids)."""
    data = validate_payload(
        HostTelemetryObserved(telemetry={"memory_available_bytes": Known(2)}, storage=[])
    )[0].decode()
    for stream in streams:
        await conn.execute(
            "INSERT INTO events (event_id, stream_id, stream_version, event_type, event_class, "
            "schema_version, data, metadata) VALUES ($1, $2, 1, 'HOST_TELEMETRY_OBSERVED', "
            "'observation', 1, $3::text::jsonb, $4::text::jsonb)",
            uuid.uuid4(),
            stream,
            data,
            validate_metadata(meta())[0].decode(),
        )


async def test_a_resumed_cursor_delivers_exactly_what_committed_since(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await burn_transaction_ids_past(conn, 100_001)
        first = await write_rows(conn, [99_999, 100_000], seed=1)
        page = await read_log(conn, Checkpoint(), limit=100)
        assert [e.global_position for e in page.entries] == [p for _, p in sorted(first)]
        assert not page.more
        empty = await read_log(conn, page.resume, limit=100)
        assert empty.entries == [] and empty.resume == page.resume
        # Later commits (real tx ids, above the boundary rows) arrive once on the next poll.
        await host_samples(conn, [f"later-{n}" for n in range(3)])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        delivered: list[str] = []
        after = empty.resume
        while len(delivered) < 3:
            assert loop.time() < deadline, "later events never arrived"
            p = await read_log(conn, after, limit=2)
            delivered.extend(e.stream_id for e in p.entries)
            after = p.resume
            if not p.entries:
                await asyncio.sleep(0.05)
        assert sorted(delivered) == ["later-0", "later-1", "later-2"]
        assert (await read_log(conn, after, limit=10)).entries == []


async def test_filters_keep_the_commit_order_and_the_resume_point(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await burn_transaction_ids_past(conn, 1_000_001)
        written = await write_rows(conn, BOUNDARY_TXS, seed=3)
        by_position = {p: tx for tx, p in written}
        target = await conn.fetchval(
            "SELECT stream_id FROM events WHERE global_position = $1", sorted(written)[5][1]
        )
        page = await read_log(conn, Checkpoint(), limit=1, where=LogFilter(stream_id=target))
        assert [e.stream_id for e in page.entries] == [target]
        assert page.resume == Checkpoint(
            by_position[page.entries[0].global_position], page.entries[0].global_position
        )
        rest = await read_log(conn, page.resume, limit=5, where=LogFilter(stream_id=target))
        assert rest.entries == [] and rest.resume == page.resume


# Tx ids of mixed magnitudes, below a horizon burned once for the whole property.
_tx_ids = st.one_of(
    st.integers(3, 9_999),
    st.integers(9_990, 10_010),
    st.integers(99_990, 100_010),
    st.integers(10_000, 1_000_001),
)


async def test_property_any_tx_ids_any_limit_match_the_model(pool: asyncpg.Pool) -> None:
    loop = asyncio.get_running_loop()
    async with pool.acquire() as setup:
        await burn_transaction_ids_past(setup, 1_000_001)

    async def example(txs: list[int], limit: int, seed: int) -> None:
        async with pool.acquire() as conn:
            await conn.execute("DELETE FROM events WHERE event_class = 'observation'")
            written = await write_rows(conn, txs, seed=seed)
            got = await read_everything(conn, limit)
            assert got == sorted(written)

    @given(
        txs=st.lists(_tx_ids, min_size=0, max_size=25),
        limit=st.integers(1, 30),
        seed=st.integers(0, 1000),
    )
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    def prop(txs: list[int], limit: int, seed: int) -> None:
        asyncio.run_coroutine_threadsafe(example(txs, limit, seed), loop).result()

    await asyncio.to_thread(prop)


async def test_an_undecodable_event_is_returned_as_stored_and_marked(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await burn_transaction_ids_past(conn, 1_001)
        written = await write_rows(conn, [999, 1_000, 1_001], seed=4)
        victim = sorted(written)[1][1]
        await conn.execute(
            "UPDATE events SET data = jsonb_set(data, '{telemetry,memory_available_bytes,state}', "
            "'\"known-tampered\"') WHERE global_position = $1",
            victim,
        )
        page = await read_log(conn, Checkpoint(), limit=10)
        assert [e.global_position for e in page.entries] == [p for _, p in sorted(written)]
        marked = [e for e in page.entries if isinstance(e, StoredEvent)]
        assert [m.global_position for m in marked] == [victim]
        assert "known-tampered" in msgspec.json.encode(marked[0].raw_data()).decode()
        assert marked[0].error


@given(
    stream=st.none() | st.just("s"),
    types=st.sampled_from([(), ("A",), ("A", "B")]),
    event_class=st.none() | st.just("observation"),
    accelerator=st.none() | st.just("GPU-1"),
    since=st.booleans(),
    until=st.booleans(),
)
def test_the_log_read_numbers_each_filter_after_the_checkpoint(
    stream: str | None,
    types: tuple[str, ...],
    event_class: str | None,
    accelerator: str | None,
    since: bool,
    until: bool,
) -> None:
    # Fixed fragments, each with the next parameter number: $1, $2 the checkpoint, the limit last.
    import re
    from datetime import UTC, datetime

    from ledger.reading import _log_query

    at = datetime(2026, 12, 1, tzinfo=UTC)
    where = LogFilter(
        stream_id=stream,
        event_types=types,
        event_class=event_class,  # type: ignore[arg-type]
        accelerator_uuid=accelerator,
        recorded_since=at if since else None,
        recorded_until=at if until else None,
    )
    statement = _log_query(Checkpoint(7, 9), where, 51)
    numbers = sorted({int(n) for n in re.findall(r"\$(\d+)", statement.text)})
    assert numbers == list(range(1, len(statement.args) + 1))
    assert statement.args[:2] == [7, 9] and statement.args[-1] == 51
    assert statement.text.endswith(f"LIMIT ${len(statement.args)}")
    given_filters = [v for v in (stream, list(types) or None, event_class, accelerator) if v is not None]
    assert statement.args[2 : 2 + len(given_filters)] == given_filters


async def test_a_page_lets_other_work_run_while_it_decodes(
    pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page of a thousand snapshots is a hundred milliseconds and more of decoding, and the
    server's reports and requests wait on the same event loop: the rows are decoded a slice at a
    time, and what else is ready runs between two slices. The page is the same."""
    observations = LogFilter(event_class="observation")
    async with pool.acquire() as conn:
        await host_samples(conn, [f"sliced-{n}" for n in range(9)])
        # The horizon is cluster-wide: another session's open transaction may hold it back a while.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while len((whole := await read_log(conn, Checkpoint(), limit=100, where=observations)).entries) < 9:
            assert loop.time() < deadline, "the events never came below the horizon"
            await asyncio.sleep(0.05)
        other = OtherWork()
        monkeypatch.setattr(reading, "DECODE_SLICE", 2)
        seen = turns_at_calls(monkeypatch, reading, "entry_from_row", other)
        async with other:
            sliced = await read_log(conn, Checkpoint(), limit=100, where=observations)
    assert [e.stream_id for e in sliced.entries] == [e.stream_id for e in whole.entries]
    assert len(seen) == len(whole.entries) >= 9
    slices = seen[::2]  # the first row of each slice of two
    assert ran_between(slices), seen


async def test_streams_that_share_an_index_key_are_read_apart(pool: asyncpg.Pool) -> None:
    """The log's indexes by stream hold an eight-byte key of the stream id (mf_stream_key), which
    two streams may share. Here every stream has the same key: a read of one stream's events and
    the history's read of one node's observations still find that stream's rows alone."""
    from datetime import UTC, datetime, timedelta

    from ledger.telemetry_hours import COUNTED, RECEIVED_IN

    at = datetime(2026, 12, 1, 10, tzinfo=UTC)
    data = validate_payload(
        HostTelemetryObserved(telemetry={"memory_available_bytes": Known(3)}, storage=[])
    )[0].decode()
    async with pool.acquire() as conn:
        await conn.execute(
            "CREATE OR REPLACE FUNCTION mf_stream_key(p_stream_id text) RETURNS bigint "
            "LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 7::bigint $$"
        )
        await conn.execute("REINDEX TABLE events")
        for version in (1, 2, 3):
            for stream in ("shared-a", "shared-b"):
                await conn.execute(
                    "INSERT INTO events (event_id, stream_id, stream_version, event_type, "
                    "event_class, schema_version, data, metadata, received_at) VALUES ($1, $2, $3, "
                    "'HOST_TELEMETRY_OBSERVED', 'observation', 1, $4::text::jsonb, $5::text::jsonb, $6)",
                    uuid.uuid4(),
                    stream,
                    version,
                    data,
                    validate_metadata(meta())[0].decode(),
                    at + timedelta(minutes=version),
                )
        await conn.execute("SET enable_seqscan = off")  # the indexes, as with a fleet's log
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        only_a = LogFilter(stream_id="shared-a")
        while len((await read_log(conn, Checkpoint(), limit=100)).entries) < 6:
            assert loop.time() < deadline, "the log's horizon did not pass its events"
            await asyncio.sleep(0.05)
        read, after = [], Checkpoint()
        while (page := await read_log(conn, after, limit=2, where=only_a)).entries:
            read += [(e.stream_id, e.stream_version) for e in page.entries]
            after = page.resume
        assert read == [("shared-a", 1), ("shared-a", 2), ("shared-a", 3)]
        window = ("shared-b", at, at + timedelta(hours=1))
        assert await conn.fetchval(f"SELECT count(*) FROM events e WHERE {RECEIVED_IN}", *window) == 3
        # the count a stored hour is checked by is the key's: this node's hours are read from the log
        counted = await conn.fetch(COUNTED, *window)
        assert [(r["hour_start"], r["rows_held"]) for r in counted] == [(at, 6)]


async def test_a_read_by_stream_walks_the_stream_keys_index_in_commit_order(pool: asyncpg.Pool) -> None:
    """A page of one node's events, with a log of many nodes' snapshots: PostgreSQL walks the
    index of the stream's key in commit order and stops at the page's end, never fetching and
    sorting the node's every row for one page (which it did where its estimate of the node's rows
    took the key's condition and the id's as independent: a handful instead of thousands)."""
    async with pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO events (event_id, stream_id, stream_version, event_type, event_class, "
            "schema_version, body) SELECT gen_random_uuid(), 'many-' || s, v, "
            "'NODE_TELEMETRY_OBSERVED', 'observation', 1, '\\x01'::bytea "
            "FROM generate_series(1, 400) v, generate_series(1, 60) s ORDER BY v, s"
        )
        await conn.execute("ANALYZE events")
        page = reading._log_query(Checkpoint(), LogFilter(stream_id="many-7"), 50)
        plan = [r[0] for r in await conn.fetch("EXPLAIN " + page.text, *page.args)]
        assert not any("Sort  (" in line for line in plan), plan  # a Sort node, not a merge's key
        assert any("Index Scan using events_permanent_stream_tx_idx" in line for line in plan), plan
