"""The log's day segments (ledger/segments.py, docs/retention.md): observations land on the
partition of the UTC day they were received; retention drops a whole past day, keeping each node's
and each GPU's newest sample, and the read models rebuild to the same rows afterwards."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, date, datetime, timedelta

import asyncpg
import pytest

from api.services.health_policy import _HEALTH_EVENTS, _HEALTH_HEAD
from api.services.inventory import HardwareInventoryService
from collectors.identity import NodeIdentity
from collectors.observations import HardwareObservation
from domain.health_backtest import BACKTEST_EVENT_TYPES
from ledger.events import OBSERVATION_EVENT_TYPES, EventMetadata
from ledger.reading import Checkpoint, LogFilter, _log_query, read_log
from ledger.retention import prune_observations
from ledger.segments import ensure_segments, segments
from ledger.store import EventStore
from projections.inventory import ALL_PROJECTIONS
from projections.rebuild import rebuild
from tests.builders import gpu, host, scan
from tests.sample_reads import latest_temperatures

START = datetime(2026, 11, 1, tzinfo=UTC)


async def partitions(conn: asyncpg.Connection) -> dict[str, int]:
    """Each partition of `events` and the events it holds."""
    rows = await conn.fetch(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = 'events'::regclass ORDER BY 1"
    )
    return {r["relname"]: int(await conn.fetchval(f'SELECT count(*) FROM "{r["relname"]}"')) for r in rows}


async def simulate(store: EventStore, nodes: int, reports: int) -> None:
    """`nodes` nodes reporting every 6 simulated hours from START; node 0 loses its GPU after its
    second report; node 1 falls silent after its second report."""
    service = HardwareInventoryService(store)
    sem = asyncio.Semaphore(8)

    async def report(n: int, r: int) -> None:
        at = START + r * timedelta(hours=6)
        gpus = [gpu(0, temp=30 + r)] if not (n == 0 and r >= 2) else []
        obs = HardwareObservation(observed_at=at, host=host(f"node-{n}", mem_avail=r), nvml=scan(gpus))
        async with sem:
            await service.reconcile_observation(
                NodeIdentity(key=f"seg-{n}", source="configured"),
                obs,
                EventMetadata(received_at=at, source="agent", observed_at=at),
            )

    for r in range(reports):
        await asyncio.gather(*(report(n, r) for n in range(nodes) if not (n == 1 and r >= 2)))


async def test_observations_land_on_the_segment_of_the_day_they_were_received(store: EventStore) -> None:
    async with store.pool.acquire() as conn:
        await ensure_segments(conn, START.date(), ahead=1)  # 1 and 2 November
        assert [s.day for s in await segments(conn)][:2] == [date(2026, 11, 1), date(2026, 11, 2)]
    await simulate(store, nodes=3, reports=12)  # 1-3 November: the 3rd has no segment
    async with store.pool.acquire() as conn:
        held = await partitions(conn)
        by_day = {
            r["seg"]: r["n"]
            for r in await conn.fetch(
                "SELECT segment::text AS seg, count(*) AS n FROM events WHERE event_class = 'observation' GROUP BY 1"
            )
        }
    assert by_day == {"2026-11-01": 10, "2026-11-02": 8, "infinity": 8}, by_day
    assert held["events_d20261101"] == 10 and held["events_d20261102"] == 8
    # every lifecycle event is in the permanent segment, with the observations of the 3rd
    assert held["events_permanent"] > 8
    # and the log reads as one: the catch-up read delivers every event of every partition once
    # (in commit order, which concurrent appends make differ from position order)
    # (an event shows once every older writing transaction of the cluster has ended: poll)
    positions: list[int] = []
    checkpoint, deadline = Checkpoint(), asyncio.get_running_loop().time() + 30
    while len(positions) < sum(held.values()) and asyncio.get_running_loop().time() < deadline:
        events, checkpoint = await store.read_all(checkpoint, limit=10_000)
        positions += [e.global_position for e in events]
        await asyncio.sleep(0.01 if events else 0.05)
    async with store.pool.acquire() as conn:
        stored = {r["global_position"] for r in await conn.fetch("SELECT global_position FROM events")}
    assert len(positions) == len(set(positions)) == sum(held.values()) and set(positions) == stored


async def test_reads_by_type_find_every_segment_s_events_and_only_the_permanent_one_is_indexed_by_type(
    store: EventStore,
) -> None:
    async with store.pool.acquire() as conn:
        await ensure_segments(conn, START.date(), ahead=1)  # 1 and 2 November
    await simulate(store, nodes=3, reports=12)  # 1-3 November: the 3rd has no segment
    async with store.pool.acquire() as conn:
        # a telemetry snapshot in a day segment writes no entry of an index by type
        by_type = {
            r["tablename"]
            for r in await conn.fetch(
                "SELECT tablename FROM pg_indexes WHERE indexdef LIKE '%(event_type, %'"
            )
        }
        assert by_type == {"events_permanent"}, by_type
        # what the reads by type deliver is what the whole log holds of those types, in commit order
        # (once every event shows: the read stops below the cluster's oldest running transaction)
        stored = await conn.fetchval("SELECT count(*) FROM events")
        deadline = asyncio.get_running_loop().time() + 30
        while len((whole := await read_log(conn, Checkpoint(), limit=10_000)).entries) < stored:
            assert asyncio.get_running_loop().time() < deadline, "the log's horizon did not pass its events"
            await asyncio.sleep(0.05)
        assert not whole.more

        async def of_types(*types: str) -> list[int]:
            got, after = [], Checkpoint()
            while True:  # small pages, so the reads cross their page boundaries
                page = await read_log(conn, after, limit=7, where=LogFilter(event_types=types))
                got += [e.global_position for e in page.entries]
                if not page.more:
                    return got
                after = page.resume

        for types in (("NODE_TELEMETRY_OBSERVED",), ("ACCELERATOR_DISCOVERED", "ACCELERATOR_MISSING"),
                      ("NODE_TELEMETRY_OBSERVED", "ACCELERATOR_MISSING"), ("NO_SUCH_TYPE",)):  # fmt: skip
            expected = [e.global_position for e in whole.entries if e.event_type in types]
            assert await of_types(*types) == expected, types
        assert len(await of_types("NODE_TELEMETRY_OBSERVED")) == 26  # 10 + 8 in day segments, 8 not
        assert len(await of_types("ACCELERATOR_MISSING")) == 1
        # a read of lifecycle types, and the backtest's health reads, leave the day segments out
        await conn.execute("SET enable_seqscan = off")
        lifecycle = _log_query(Checkpoint(), LogFilter(event_types=("ACCELERATOR_MISSING",)), 101)
        for sql, args in ((lifecycle.text, lifecycle.args), (_HEALTH_HEAD, BACKTEST_EVENT_TYPES),
                          (_HEALTH_EVENTS, (list(BACKTEST_EVENT_TYPES), 0, 100))):  # fmt: skip
            plan = "\n".join(r[0] for r in await conn.fetch("EXPLAIN " + sql, *args))
            assert "events_permanent" in plan and "events_d" not in plan, plan
            # (the page in position order may walk the primary key instead, as cheap on a small log)
            assert "events_permanent_type_idx" in plan or sql is _HEALTH_EVENTS, plan
    # the backtest's types are lifecycle types: the health reads name the permanent segment
    assert OBSERVATION_EVENT_TYPES.isdisjoint(BACKTEST_EVENT_TYPES)


async def test_retention_drops_a_past_day_whole_and_keeps_every_newest_sample(store: EventStore) -> None:
    nodes = 200
    async with store.pool.acquire() as conn:
        await ensure_segments(conn, START.date(), ahead=2)  # 1-3 November
    await simulate(store, nodes=nodes, reports=12)  # every 6 h, 1 November 00:00 to 3 November 18:00
    async with store.pool.acquire() as conn:
        before = await latest_temperatures(conn)
        lifecycle = await conn.fetchval("SELECT count(*) FROM events WHERE event_class = 'lifecycle'")
        held = await partitions(conn)
    assert held["events_d20261101"] == nodes * 4 - 2

    now = START + timedelta(days=2, hours=18)  # the cutoff (24 h) is 2 November 18:00
    result = await prune_observations(store.pool, keep=timedelta(hours=24), now=now)
    assert result.segments_dropped == [date(2026, 11, 1)], "only a day wholly older than the cutoff"
    # kept from the 1st: node 0's GPU's last sample (its second report) and node 1's last report
    assert result.kept_past_day == 2
    assert result.deleted == nodes * 4 - 2 - 2
    async with store.pool.acquire() as conn:
        after = await partitions(conn)
        assert "events_d20261101" not in after
        assert await conn.fetchval("SELECT count(*) FROM pg_class WHERE relname = 'events_d20261101'") == 0
        assert date(2026, 11, 1) not in [s.day for s in await segments(conn)]
        assert await conn.fetchval("SELECT count(*) FROM events WHERE event_class = 'lifecycle'") == lifecycle
        # the 2nd stays whole: a day segment goes only when all of its day is past the cutoff
        assert after["events_d20261102"] == held["events_d20261102"]
        assert await latest_temperatures(conn) == before
        kept = await conn.fetch(
            "SELECT n.hostname, e.segment::text AS seg, e.received_at FROM events e JOIN hw_nodes n ON n.node_id = e.stream_id "
            "WHERE e.event_class = 'observation' AND e.received_at < $1 ORDER BY 1",
            datetime(2026, 11, 2, tzinfo=UTC),
        )
    assert [(r["hostname"], r["seg"]) for r in kept] == [("node-0", "infinity"), ("node-1", "infinity")]
    assert {r["received_at"] for r in kept} == {START + timedelta(hours=6)}, "same events, same times"

    report = await rebuild(store.pool, ALL_PROJECTIONS, verify=True)
    assert report.differences == []
    async with store.pool.acquire() as conn:
        assert await latest_temperatures(conn) == before
    again = await prune_observations(store.pool, keep=timedelta(hours=24), now=now)
    assert again.deleted == 0 and again.segments_dropped == []


async def test_a_retirement_cut_short_is_finished_by_the_next_pass(store: EventStore) -> None:
    """The server killed after the day was detached and before it was dropped: the next pass
    drops it, and what the policy keeps is still kept."""
    async with store.pool.acquire() as conn:
        await ensure_segments(conn, START.date(), ahead=1)
    await simulate(store, nodes=3, reports=8)  # 1 and 2 November
    async with store.pool.acquire() as conn:
        before = await latest_temperatures(conn)
        # what a pass does before its drop, without moving the kept observations first
        await conn.execute("DELETE FROM event_segments WHERE day = '2026-11-01'")
        await conn.execute("ALTER TABLE events DETACH PARTITION events_d20261101")
    result = await prune_observations(store.pool, keep=timedelta(hours=24), now=START + timedelta(days=2))
    assert date(2026, 11, 1) in result.segments_dropped
    assert result.kept_past_day == 2  # node 0's GPU's last sample, node 1's last report, copied back
    async with store.pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM pg_class WHERE relname = 'events_d20261101'") == 0
        assert await latest_temperatures(conn) == before
    report = await rebuild(store.pool, ALL_PROJECTIONS, verify=True)
    assert report.differences == []


async def test_an_observation_committed_after_its_day_was_lifted_is_kept_by_the_copy_back(
    store: EventStore,
) -> None:
    """An append still in flight when a pass lifts its day (it had found the day's segment): the
    move cannot see it, the detach waits for it, and the copy-back keeps it, as the policy says
    of the only observation of its stream."""
    async with store.pool.acquire() as conn:
        await ensure_segments(conn, START.date(), ahead=0)
    await simulate(store, nodes=2, reports=2)
    async with store.pool.acquire() as late:
        transaction = late.transaction()
        await transaction.start()
        await late.execute(
            "INSERT INTO events (event_id, stream_id, stream_version, event_type, event_class, schema_version, "
            "data, metadata, received_at, segment) VALUES (gen_random_uuid(), 'late-1', 1, "
            "'NODE_TELEMETRY_OBSERVED', 'observation', 1, '{}', '{}', $1, $2)",
            START + timedelta(hours=12),
            START.date(),
        )
        prune = asyncio.create_task(
            prune_observations(store.pool, keep=timedelta(hours=1), now=START + timedelta(days=2), rest=0)
        )
        deadline = asyncio.get_running_loop().time() + 30
        async with store.pool.acquire() as watch:
            while not await watch.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'ALTER TABLE events DETACH%' "
                "AND wait_event_type = 'Lock'"
            ):
                assert asyncio.get_running_loop().time() < deadline, "the detach never waited"
                assert not prune.done(), prune
                await asyncio.sleep(0.01)
        await transaction.commit()
        result = await prune
    assert result.segments_dropped == [START.date()]
    async with store.pool.acquire() as conn:
        rows = await conn.fetch("SELECT segment::text AS seg FROM events WHERE stream_id = 'late-1'")
    assert [r["seg"] for r in rows] == ["infinity"]


async def test_an_append_to_a_retired_day_goes_to_the_permanent_segment(store: EventStore) -> None:
    async with store.pool.acquire() as conn:
        await ensure_segments(conn, START.date(), ahead=0)
    await simulate(store, nodes=2, reports=1)
    await prune_observations(store.pool, keep=timedelta(hours=1), now=START + timedelta(days=1, hours=1))
    await simulate(store, nodes=2, reports=1)  # received on 1 November again (an import, say)
    async with store.pool.acquire() as conn:
        rows = await conn.fetch("SELECT segment::text AS seg FROM events WHERE event_class = 'observation'")
    assert len(rows) == 4 and {r["seg"] for r in rows} == {"infinity"}


@pytest.mark.parametrize(
    ("step", "analyzed"),
    [(20_000, False), (1, False), (60, True)],
    ids=["one step", "a stream per step", "steps of a few streams, from the statistics"],
)
async def test_a_retired_day_keeps_exactly_what_the_policy_keeps(
    store: EventStore, step: int, analyzed: bool
) -> None:
    """Snapshots sampling random subsets of four GPUs (incomplete scans, GPUs lost and back): the
    retirement's two-step decision keeps exactly the snapshots that no newer one samples a
    superset of, the rule the row-by-row prune applies, however the day is cut into steps."""
    rng = random.Random(12)
    streams, per, uuids = 12, 25, [f"GPU-{g}" for g in range(4)]
    sampled = {
        (s, v): sorted(rng.sample(uuids, rng.randint(0, 4)))
        for s in range(streams)
        for v in range(1, per + 1)
    }
    async with store.pool.acquire() as conn:
        await ensure_segments(conn, START.date(), ahead=0)
        await conn.executemany(
            "INSERT INTO events (event_id, stream_id, stream_version, event_type, event_class, schema_version, "
            "data, metadata, received_at, segment) VALUES (gen_random_uuid(), $1, $2, 'NODE_TELEMETRY_OBSERVED', "
            "'observation', 1, $3, '{}', $4, $5)",
            [
                (f"rule-{s}", v, {"accelerators": [{"uuid": u, "telemetry": {}} for u in sampled[(s, v)]]},
                 START + timedelta(seconds=v), START.date())
                for (s, v) in sampled
            ],
        )  # fmt: skip
        if analyzed:  # the steps are sized from the partition's row estimate, else by counting
            await conn.execute("ANALYZE events_d20261101")
    expected = {
        (f"rule-{s}", v)
        for (s, v), mine in sampled.items()
        if not any(set(mine) <= set(sampled[(s, w)]) for w in range(v + 1, per + 1))
    }
    result = await prune_observations(
        store.pool, keep=timedelta(hours=1), now=START + timedelta(days=2), step=step, rest=0
    )
    assert result.segments_dropped == [START.date()]
    # one pass over the day before its detach, one after: in one step each, a stream per step,
    # or a few streams per step
    if step == 20_000:
        assert result.steps == 2
    elif step == 1:
        assert result.steps == 2 * streams
    else:
        assert 2 < result.steps < 2 * streams, result.steps
    async with store.pool.acquire() as conn:
        kept = {
            (r["stream_id"], r["stream_version"])
            for r in await conn.fetch(
                "SELECT stream_id, stream_version FROM events WHERE stream_id LIKE 'rule-%'"
            )
        }
    assert kept == expected and result.kept_past_day == len(expected)
    assert len(expected) > streams, "the case needs snapshots kept besides each stream's last"


async def test_one_retention_pass_at_a_time(store: EventStore) -> None:
    """Two servers' passes at once: the second is skipped, so no two retire the same day."""
    async with store.pool.acquire() as other:
        await other.execute("SELECT pg_advisory_lock(7305820115)")  # another server's pass
        try:
            skipped = await prune_observations(store.pool)
        finally:
            await other.execute("SELECT pg_advisory_unlock(7305820115)")
    assert skipped.skipped and skipped.deleted == 0
    assert not (await prune_observations(store.pool)).skipped
