"""A batch of reports on kept copies as one statement (ledger/folded_append.py): its events folded
before they are sent, at positions reserved from the log's sequence, the read models' rows, the
checkpoints and the stream positions written by the same statement, and nothing of it where any
part was decided on something not current."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import asyncpg
import msgspec
import pytest

from collectors.facts import Known
from collectors.observations import StorageObservation
from ledger.reserved_positions import ReservedPositions
from tests.agent_support import observation, report_body
from tests.test_kept_reports import enrolled, position, server, verify


async def _log(pool: asyncpg.Pool, node_id: str) -> list[tuple[int, int]]:
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT stream_version, global_position FROM events WHERE stream_id = $1 ORDER BY stream_version",
            node_id,
        )
    return [(r["stream_version"], r["global_position"]) for r in rows]


async def test_a_steady_report_is_one_statement_and_rebuilds_to_what_it_wrote(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    a = server(pool, tmp_path, "a")
    principal, _ = await enrolled(a, "folded-agent")
    for seq in range(1, 6):
        ack = await a.reports.accept_report(principal, report_body("folded-agent", seq, mem_avail=seq), None)
        assert ack.status == "accepted"
    # Report 1 had no stream position kept; 2 to 5 were folded before they were sent.
    assert a.reports.store.states.folded_appends == 4
    assert await position(pool, principal.node_id) == (5, 5, 0)
    log = await _log(pool, principal.node_id)
    # A stream's positions ascend with its versions, whoever reserved them.
    assert [p for _v, p in log] == sorted(p for _v, p in log)
    async with pool.acquire() as conn:
        stored = await conn.fetchval(
            "SELECT position FROM projection_state WHERE projection = 'inventory' AND stream_id = $1",
            principal.node_id,
        )
    assert stored == log[-1][1]  # the checkpoint folded the position the event was stored at
    await verify(pool)


async def test_nodes_folded_in_one_statement_each_keep_their_own_state(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """Two nodes of different GPUs whose reports share each statement: every next report is
    decided on its own node's folded state, so neither node's log gains a lifecycle event."""
    from api.config import ServerConfig
    from api.wiring import build_services

    # One report transaction at a time, so both nodes' reports wait for the same statement.
    a = build_services(
        pool, ServerConfig(state_dir=tmp_path / "a", collector_timeout=5.0, report_transactions=1)
    )
    nodes = {"folded-one": 1, "folded-three": 3}
    principals = {key: (await enrolled(a, key))[0] for key in nodes}
    for seq in range(1, 7):
        acks = await asyncio.gather(
            *(
                a.reports.accept_report(
                    principals[key],
                    report_body(key, seq, obs=observation(mem_avail=seq, gpus=gpus, hostname=key)),
                    None,
                )
                for key, gpus in nodes.items()
            )
        )
        assert [ack.status for ack in acks] == ["accepted", "accepted"]
    assert a.reports.group_commit.units > a.reports.group_commit.batches  # statements were shared
    assert a.reports.store.states.folded_appends >= 4
    for key, gpus in nodes.items():
        async with pool.acquire() as conn:
            lifecycle = await conn.fetch(
                "SELECT event_type FROM events WHERE stream_id = $1 AND event_class = 'lifecycle' "
                "AND event_type LIKE 'ACCELERATOR%' ORDER BY stream_version",
                principals[key].node_id,
            )
        assert [r["event_type"] for r in lifecycle] == ["ACCELERATOR_DISCOVERED"] * gpus, key
    await verify(pool)


async def test_positions_reserved_below_the_streams_last_are_renewed_before_the_append(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    a = server(pool, tmp_path, "a")
    principal, _ = await enrolled(a, "reserved-agent")
    for seq in (1, 2):
        await a.reports.accept_report(principal, report_body("reserved-agent", seq, mem_avail=seq), None)
    before = await _log(pool, principal.node_id)
    reserved = a.reports.store.reserved
    # What another writer's append would leave: positions this process holds that lie below the
    # stream's last one (here the ones it used already). The writer renews its reservation.
    reserved._free = [p for _v, p in before[-2:]]
    dropped = reserved.dropped
    ack = await a.reports.accept_report(principal, report_body("reserved-agent", 3, mem_avail=3), None)
    assert ack.status == "accepted"
    assert reserved.dropped == dropped + 1
    assert a.reports.store.states.folded_refused == 0  # renewed before sending, not refused
    after = await _log(pool, principal.node_id)
    assert after[: len(before)] == before  # nothing of the refused statement stands
    assert after[-1][1] > before[-1][1]
    # The next report is folded again, on a fresh reservation.
    folded = a.reports.store.states.folded_appends
    await a.reports.accept_report(principal, report_body("reserved-agent", 4, mem_avail=4), None)
    assert a.reports.store.states.folded_appends == folded + 1
    assert await position(pool, principal.node_id) == (4, 4, 0)
    await verify(pool)


async def test_a_position_the_sequence_never_handed_out_is_refused(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    a = server(pool, tmp_path, "a")
    principal, _ = await enrolled(a, "invented-agent")
    for seq in (1, 2):
        await a.reports.accept_report(principal, report_body("invented-agent", seq, mem_avail=seq), None)
    async with pool.acquire() as conn:
        last = await conn.fetchval("SELECT last_value FROM events_global_position_seq")
    a.reports.store.reserved._free = [last + 1_000_000]
    ack = await a.reports.accept_report(principal, report_body("invented-agent", 3, mem_avail=3), None)
    assert ack.status == "accepted"
    assert a.reports.store.states.folded_refused == 1
    assert all(p <= last + 1_000 for _v, p in await _log(pool, principal.node_id))
    await verify(pool)


async def test_a_read_model_row_missing_refuses_the_report_and_writes_nothing(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    a = server(pool, tmp_path, "a")
    principal, _ = await enrolled(a, "damaged-agent")
    for seq in (1, 2):
        await a.reports.accept_report(principal, report_body("damaged-agent", seq, mem_avail=seq), None)
    before = await _log(pool, principal.node_id)
    async with pool.acquire() as conn:
        await conn.execute("DELETE FROM hw_host_telemetry WHERE node_id = $1", principal.node_id)
    failed = False
    try:
        await a.reports.accept_report(principal, report_body("damaged-agent", 3, mem_avail=3), None)
    except RuntimeError as exc:
        failed = "rebuild" in str(exc)
    assert failed
    assert await _log(pool, principal.node_id) == before
    assert await position(pool, principal.node_id) == (2, 2, 0)


async def test_the_database_refuses_positions_not_above_each_streams_last(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    # The writer never sends such positions (it renews its reservation first); the function
    # refuses them all the same, before it writes anything.
    a = server(pool, tmp_path, "a")
    principal, _ = await enrolled(a, "guarded-agent")
    for seq in (1, 2):
        await a.reports.accept_report(principal, report_body("guarded-agent", seq, mem_avail=seq), None)
    log = await _log(pool, principal.node_id)
    version, last = log[-1]
    async with pool.acquire() as conn:
        rebuilt = await conn.fetchval(
            "SELECT rebuilt_at FROM projection_checkpoints WHERE projection = 'inventory'"
        )
        fresh = await conn.fetchval("SELECT nextval('events_global_position_seq'::regclass)")
        for positions in ([last], [fresh, fresh - 1], [None]):
            with pytest.raises(asyncpg.PostgresError) as refused:
                await conn.fetch(
                    "SELECT * FROM mf_append_folded(ARRAY[$1], ARRAY[$2::bigint], ARRAY[$3::int], $4::uuid[], "
                    "$5::text[], $6::text[], $7::int[], $8::jsonb[], $9::jsonb[], $10::bytea[], "
                    "$11::timestamptz[], $12::uuid[], $13::bigint[], 'inventory', ARRAY[$2::bigint], "
                    "ARRAY[$14::bigint], $15)",
                    principal.node_id,
                    version,
                    len(positions),
                    [uuid.uuid4() for _ in positions],
                    ["NODE_LABELS_CHANGED"] * len(positions),
                    ["lifecycle"] * len(positions),
                    [1] * len(positions),
                    ['{"labels": {}}'] * len(positions),
                    ['{"source": "test"}'] * len(positions),
                    [None] * len(positions),
                    [None] * len(positions),
                    [None] * len(positions),
                    positions,
                    last,
                    rebuilt,
                )
            assert getattr(refused.value, "sqlstate", None) == "MF412", positions
    assert await _log(pool, principal.node_id) == log


async def test_reserved_positions_ascend_and_are_not_kept_past_their_age(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        kept = ReservedPositions(at_once=4, max_age=3600.0)
        first = await kept.take(conn, 3)
        assert first == sorted(first) and kept.reservations == 1
        second = await kept.take(conn, 1)  # the fourth of the reservation
        assert second[0] > first[-1] and kept.reservations == 1
        third = await kept.take(conn, 2)  # none left: reserved again, above all before
        assert third[0] > second[0] and kept.reservations == 2
        # Another writer's position, taken from the sequence since: what is left lies below it.
        later = await conn.fetchval("SELECT nextval('events_global_position_seq'::regclass)")
        above = await kept.take(conn, 1, above=later)
        assert above[0] > later and kept.dropped == 1 and kept.reservations == 3
        aged = ReservedPositions(at_once=4, max_age=0.0)
        one = await aged.take(conn, 1)
        two = await aged.take(conn, 1)  # its reservation is too old: dropped, reserved again
        assert two[0] > one[0] and aged.reservations == 2 and aged.dropped == 1


async def test_a_folded_report_that_removes_rows_and_changes_the_inventory_rebuilds_alike(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    # The folded statement's deletes (a mount gone) and lifecycle events (a GPU gone, a mount
    # added) in the read models, numbered after the append's parameters.
    a = server(pool, tmp_path, "a")
    principal, _ = await enrolled(a, "changing-agent")
    two_mounts = msgspec.structs.replace(
        observation().host,
        storage=[
            StorageObservation(mount="/", used_bytes=Known(10), total_bytes=Known(100)),
            StorageObservation(mount="/data", used_bytes=Known(5), total_bytes=Known(50)),
        ],
    )
    bodies = [
        observation(mem_avail=1),
        msgspec.structs.replace(observation(mem_avail=2), host=two_mounts),
        msgspec.structs.replace(observation(mem_avail=3, gpus=1), host=two_mounts),
        observation(mem_avail=4, gpus=1),
    ]
    for seq, obs in enumerate(bodies, start=1):
        ack = await a.reports.accept_report(
            principal, report_body("changing-agent", seq, stream="inventory", obs=obs), None
        )
        assert ack.status == "accepted"
    assert a.reports.store.states.folded_appends == 3
    async with pool.acquire() as conn:
        mounts = await conn.fetch("SELECT mount FROM hw_node_storage WHERE node_id = $1", principal.node_id)
        statuses = await conn.fetch(
            "SELECT status FROM hw_accelerators WHERE node_id = $1 ORDER BY device_index", principal.node_id
        )
    assert [r["mount"] for r in mounts] == ["/"]
    assert [r["status"] for r in statuses] == ["active", "missing"]
    await verify(pool)
