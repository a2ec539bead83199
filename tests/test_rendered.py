"""Rendered reads (api/services/reads/rendered.py): a node or a page is rendered once per change of what
it shows, and a read never shows less than a query of its own would have shown: every commit
before the read arrived, by this server or any other, whatever order the commits came in."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import asyncpg
import msgspec
import pytest

from api.services.reads.liveness import LivenessPolicy
from api.services.reads.rendered import RenderedReads
from api.services.reads.rendering import Loaded, Rendered, render
from api.services.reads.repository import HardwareRepository
from collectors.facts import Known
from collectors.identity import NodeIdentity
from domain.node import NodeState, node_id_for
from domain.reconcile import reconcile
from ledger.changes import DEFAULT_LIMIT, ChangeMark, read_changes
from ledger.events import HostTelemetryObserved, NewEvent
from ledger.store import EventStore
from projections.inventory import ALL_PROJECTIONS
from projections.rebuild import rebuild
from tests.builders import gpu, meta, observation


def node_key(i: int) -> str:
    return f"rendered-node-{i}"


async def discover(store: EventStore, i: int, gpus: int = 2) -> str:
    node = node_id_for(node_key(i))
    identity = NodeIdentity(key=node_key(i), source="configured")
    at = datetime.now(UTC)
    events = [
        NewEvent(payload=p, metadata=meta(at, source="agent"))
        for p in reconcile(observation([gpu(k) for k in range(gpus)]), NodeState(node_id=node), identity)
    ]
    await store.append(node, 0, events)
    return node


def sample(memory: int, at: datetime | None = None) -> NewEvent:
    payload = HostTelemetryObserved(telemetry={"memory_available_bytes": Known(memory)}, storage=[])
    return NewEvent(payload=payload, metadata=meta(at or datetime.now(UTC), source="agent"))


class Reader:
    """What `GET /hardware/nodes/{id}` does: the rendered read in front of the repository."""

    def __init__(self, pool: asyncpg.Pool, liveness: LivenessPolicy | None = None) -> None:
        self.repository = HardwareRepository(pool, liveness)
        self.rendered = RenderedReads(pool)

    async def node(self, node_id: str) -> dict[str, object]:
        got = await self.rendered.read(
            ("node", node_id), frozenset({node_id}), lambda: self.repository.nodes.render(node_id)
        )
        assert got is not None
        body: dict[str, object] = msgspec.json.decode(got.body)
        return body


def memory_of(body: dict[str, object]) -> object:
    telemetry = body["telemetry"]
    assert isinstance(telemetry, dict)
    return telemetry["memory_available_bytes"]


async def test_a_kept_node_is_served_until_its_stream_changes_on_any_server(pool: asyncpg.Pool) -> None:
    store = EventStore(pool, ALL_PROJECTIONS)
    node, other = await discover(store, 1), await discover(store, 2)
    reader = Reader(pool)
    first = await reader.node(node)
    assert await reader.node(node) == first
    assert reader.rendered.hits == 1, "the second read is the kept rendering"
    # Another node's report leaves it kept; its own report (a write this reader's process never
    # saw: another server's) is in the very next read.
    await store.append(other, None, [sample(7)])
    assert await reader.node(node) == first
    assert reader.rendered.hits == 2
    await store.append(node, None, [sample(42)])
    assert memory_of(await reader.node(node)) == {"state": "known", "value": 42}


async def test_a_transaction_that_commits_after_a_probe_is_seen_by_the_next_read(pool: asyncpg.Pool) -> None:
    """The commit-order gap: a transaction that appended before a probe and commits after it
    (its id below the probe's xmax, in progress then) must not be missed by the next probe."""
    store = EventStore(pool, ALL_PROJECTIONS)
    node = await discover(store, 1)
    reader = Reader(pool)
    async with pool.acquire() as writer:
        tx = writer.transaction()
        await tx.start()
        await store.append(node, None, [sample(99)], conn=writer)
        # A later transaction commits first, so the probe's snapshot sees a newer id than ours.
        await discover(store, 2)
        before = await reader.node(node)
        assert memory_of(before) != {"state": "known", "value": 99}
        assert await reader.node(node) == before  # kept
        await tx.commit()
    assert memory_of(await reader.node(node)) == {"state": "known", "value": 99}


async def test_a_rendering_made_while_its_stream_changed_is_not_kept(pool: asyncpg.Pool) -> None:
    """A read's query may run before a commit that a concurrent read's probe already saw: what
    it rendered is served to it once, never kept for the reads after."""
    store = EventStore(pool, ALL_PROJECTIONS)
    node = await discover(store, 1)
    reader = Reader(pool)
    stale = await reader.repository.nodes.render(node)
    assert stale is not None
    release = asyncio.Event()

    async def slow_load() -> Loaded:
        await release.wait()
        return stale  # what a query that ran before the commit below rendered

    probes = reader.rendered.probes
    slow = asyncio.create_task(reader.rendered.read(("node", node), frozenset({node}), slow_load))
    for _ in range(500):  # until its probe is done: then its query "ran"
        if reader.rendered.probes > probes:
            break
        await asyncio.sleep(0.01)
    await store.append(node, None, [sample(5)])
    fresh = await reader.node(node)  # a probe that sees the commit
    assert memory_of(fresh) == {"state": "known", "value": 5}
    release.set()
    assert await slow == stale[0]
    assert await reader.node(node) == fresh


async def test_liveness_is_kept_only_until_its_verdict_would_change(pool: asyncpg.Pool) -> None:
    store = EventStore(pool, ALL_PROJECTIONS)
    node = await discover(store, 1)
    received = datetime.now(UTC)
    await store.append(node, None, [sample(1, received)])
    reader = Reader(pool, LivenessPolicy(stale_after=1.5, offline_after=3.0))

    async def at(seconds: float) -> object:
        # Read once the central clock is `seconds` past the report (the verdicts' thresholds).
        await asyncio.sleep(
            max(0.0, (received + timedelta(seconds=seconds) - datetime.now(UTC)).total_seconds())
        )
        return (await reader.node(node))["liveness"]

    assert await at(0) == "online"
    assert await at(0) == "online"
    assert reader.rendered.hits == 1, "kept while the verdict holds"
    assert await at(1.6) == "stale"
    assert await at(3.1) == "offline"


async def test_a_rebuild_drops_every_kept_rendering(pool: asyncpg.Pool) -> None:
    store = EventStore(pool, ALL_PROJECTIONS)
    node = await discover(store, 1)
    reader = Reader(pool)
    async with pool.acquire() as conn:
        # A read model that drifted from the log (edited by hand): rendered and kept as it is...
        await conn.execute("UPDATE hw_nodes SET hostname = 'drifted' WHERE node_id = $1", node)
    assert (await reader.node(node))["hostname"] == "drifted"
    assert (await reader.node(node))["hostname"] == "drifted"
    # ...until a rebuild swaps in the read models the log says.
    await rebuild(pool, ALL_PROJECTIONS)
    assert (await reader.node(node))["hostname"] == "gpu-host-1"


async def test_a_fleet_page_is_dropped_by_any_change_a_node_page_by_its_own(pool: asyncpg.Pool) -> None:
    store = EventStore(pool, ALL_PROJECTIONS)
    one, two = await discover(store, 1), await discover(store, 2)
    repository = HardwareRepository(pool)
    rendered = RenderedReads(pool)
    loads: list[object] = []

    def page(node_id: str | None) -> object:
        async def load() -> Loaded:
            loads.append(node_id)
            items, _ = await repository.accelerators.page(node_id=node_id, status=None, cursor=None, limit=10)
            return render(items), None

        streams = None if node_id is None else frozenset({node_id})
        return rendered.read(("accelerators", node_id), streams, load)

    for _ in range(2):
        await page(None)  # type: ignore[misc]
        await page(one)  # type: ignore[misc]
    assert loads == [None, one]
    await store.append(two, None, [sample(3)])
    await page(None)  # type: ignore[misc]
    await page(one)  # type: ignore[misc]
    assert loads == [None, one, None], "node two's report drops the fleet page only"


async def test_kept_renderings_stay_within_their_byte_budget(pool: asyncpg.Pool) -> None:
    rendered = RenderedReads(pool, max_bytes=40_000)
    body = Rendered(b"x" * 9_000, '"e"')

    async def load() -> Loaded:
        return body, None

    for i in range(20):
        await rendered.read(("k", i), frozenset({f"s{i}"}), load)
    assert rendered.kept_bytes <= 40_000
    assert rendered.misses == 20
    await rendered.read(("k", 19), frozenset({"s19"}), load)  # the newest is kept
    assert rendered.hits == 1


async def test_nothing_is_served_when_the_log_cannot_be_probed(database_dsn: str) -> None:
    pool = await asyncpg.create_pool(database_dsn, min_size=1, max_size=2)
    rendered = RenderedReads(pool)

    async def load() -> Loaded:
        return Rendered(b"{}", '"e"'), None

    await rendered.read("k", None, load)
    await pool.close()
    with pytest.raises(asyncpg.InterfaceError):
        await rendered.read("k", None, load)


async def test_concurrent_reads_share_probes(pool: asyncpg.Pool) -> None:
    store = EventStore(pool, ALL_PROJECTIONS)
    node = await discover(store, 1)
    reader = Reader(pool)
    await reader.node(node)
    probes = reader.rendered.probes
    bodies = await asyncio.gather(*(reader.node(node) for _ in range(50)))
    assert len({msgspec.json.encode(b) for b in bodies}) == 1
    assert reader.rendered.probes - probes < 50
    assert reader.rendered.probes - probes >= 1


async def test_reads_waiting_for_a_cancelled_probe_are_cancelled_not_left_hanging(pool: asyncpg.Pool) -> None:
    rendered = RenderedReads(pool)

    async def load() -> Loaded:
        return Rendered(b"{}", '"e"'), None

    await rendered.read("k", None, load)
    first = asyncio.create_task(rendered.read("k", None, load))
    await asyncio.sleep(0)  # its probe is running
    second = asyncio.create_task(rendered.read("k", None, load))  # waits for the next probe
    await asyncio.sleep(0)
    assert rendered._prober is not None
    rendered._prober.cancel()
    for task in (first, second):
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
    assert await rendered.read("k", None, load) == Rendered(b"{}", '"e"'), "a later read probes again"


async def test_more_changes_than_a_probe_reads_drop_everything_kept(pool: asyncpg.Pool) -> None:
    store = EventStore(pool, ALL_PROJECTIONS)
    nodes = [await discover(store, i) for i in range(4)]
    reader = Reader(pool)
    reader.rendered = RenderedReads(pool, probe_limit=2)
    first = await reader.node(nodes[0])
    assert await reader.node(nodes[0]) == first
    # Three other nodes report: the probe reads two of their events, so it cannot tell that
    # node 0 did not change, and renders it again.
    for node in nodes[1:]:
        await store.append(node, None, [sample(8)])
    misses = reader.rendered.misses
    assert await reader.node(nodes[0]) == first
    assert reader.rendered.misses == misses + 1


async def test_the_probe_reads_the_log_by_index_whatever_plan_is_cached(pool: asyncpg.Pool) -> None:
    """The probe (`mf_read_changes`) always runs its generic plan, planned without the
    parameters' values: `tx_id >= $1 OR tx_id = ANY($2)` was a sequential scan of the whole log in
    one (84 ms on 1.2 million events, at every probe), and as a prepared statement left to
    PostgreSQL's choice it was planned anew at every probe. On a log of 200,000 events a probe
    that finds nothing new reads a handful of index pages, not the log."""
    async with pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO events (tx_id, event_id, stream_id, stream_version, event_type, event_class, "
            "schema_version, data, metadata, segment) "
            "SELECT (1000 + g)::text::xid8, gen_random_uuid(), 'n' || (g % 500), g, "
            "'NODE_TELEMETRY_OBSERVED', 'observation', 1, '{}', '{}', 'infinity' "
            "FROM generate_series(1, 200000) g"
        )
        await conn.execute("ANALYZE events")
        # The newest 101 events (transactions 200,900 on) and one in progress then (2,001).
        probe = (
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT * FROM mf_read_changes('200900', '{2001}', $1)"
        )
        await conn.fetchval(probe, DEFAULT_LIMIT)  # the first call of a session plans it
        plan = await conn.fetchval(probe, DEFAULT_LIMIT)
        changes = await read_changes(conn, ChangeMark(xmax=200_900, in_progress=(2001,)))
    touched = plan[0]["Plan"]["Shared Hit Blocks"] + plan[0]["Plan"]["Shared Read Blocks"]
    assert touched < 100, f"a probe read {touched} pages of a 200,000-event log"
    assert changes.complete
    assert changes.streams == {f"n{g % 500}" for g in range(199_900, 200_001)} | {"n1"}


async def test_a_probe_reads_no_log_written_by_one_transaction_when_none_was_in_progress(
    pool: asyncpg.Pool,
) -> None:
    """A log written by one transaction (a bulk import): its statistics say every event has the
    same transaction id, so the generic plan of the in-progress lookup (`tx_id = ANY($2)`) reads
    the whole log. The probe skips that lookup when the previous probe saw nothing in progress,
    the usual case: it then reads a handful of index pages (it read the whole log before)."""
    async with pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO events (event_id, stream_id, stream_version, event_type, event_class, "
            "schema_version, data, metadata, segment) "
            "SELECT gen_random_uuid(), 'n' || (g % 500), g, 'NODE_TELEMETRY_OBSERVED', 'observation', 1, "
            "'{}', '{}', 'infinity' FROM generate_series(1, 200000) g"
        )
        await conn.execute("ANALYZE events")
        # The premise: a moment when no transaction is in progress. The snapshot is the cluster's,
        # so another database's transaction counts too: wait for such a moment.
        mark = (await read_changes(conn, None)).mark
        for _ in range(300):
            if mark.in_progress == ():
                break
            await asyncio.sleep(0.1)
            mark = (await read_changes(conn, mark)).mark
        assert mark.in_progress == (), f"transactions {mark.in_progress} stayed in progress for 30 s"
        probe = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT * FROM mf_read_changes($1, '{}', $2)"
        await conn.fetchval(probe, mark.xmax, DEFAULT_LIMIT)  # the first call of a session plans it
        plan = await conn.fetchval(probe, mark.xmax, DEFAULT_LIMIT)
        changes = await read_changes(conn, mark)
    touched = plan[0]["Plan"]["Shared Hit Blocks"] + plan[0]["Plan"]["Shared Read Blocks"]
    assert touched < 100, f"a probe read {touched} pages of a 200,000-event log"
    assert changes.complete and changes.streams == frozenset()


async def test_a_budget_of_zero_keeps_nothing_and_probes_nothing(pool: asyncpg.Pool) -> None:
    """`MODELFORGE_RENDERED_READS_MIB=0`: every read is its own query, as before rendered reads."""
    store = EventStore(pool, ALL_PROJECTIONS)
    node = await discover(store, 1)
    reader = Reader(pool)
    reader.rendered = RenderedReads(pool, max_bytes=0)
    first = await reader.node(node)
    await store.append(node, None, [sample(11)])
    assert memory_of(await reader.node(node)) == {"state": "known", "value": 11} != memory_of(first)
    assert (reader.rendered.hits, reader.rendered.probes, reader.rendered.kept_bytes) == (0, 0, 0)


async def test_kept_pages_walk_every_accelerator_once_at_every_limit_before_and_after_a_discovery(
    make_api,  # type: ignore[no-untyped-def]
) -> None:
    """The route's pages through rendered reads, keyed by cursor and limit: every limit from 1 to
    past the end walks each accelerator exactly once, the second walk (kept pages) equals the
    first, and a node discovered between walks is in the next one."""
    from tests.fixtures_nvml import multi_gpu_scenario

    api = make_api(multi_gpu_scenario(8))
    await api.refresh()

    async def walk(limit: int) -> list[str]:
        seen: list[str] = []
        cursor = None
        while True:
            params = {"limit": str(limit)} | ({"cursor": cursor} if cursor else {})
            page = (await api.get("/api/v1/hardware/accelerators", params=params)).json()
            assert len(page["items"]) <= limit
            seen += [a["id"] for a in page["items"]]
            cursor = page["next_cursor"]
            if not cursor:
                return seen

    for limit in range(1, 10):
        first = await walk(limit)
        assert len(first) == 8 == len(set(first)) and first == sorted(first)
        assert await walk(limit) == first
    await discover(EventStore(api.pool, ALL_PROJECTIONS), 1, gpus=3)
    for limit in (1, 4, 11, 12):
        after = await walk(limit)
        assert len(after) == 11 == len(set(after)) and set(first) < set(after)
