"""The folded states an EventStore keeps (ledger.state_cache.StateCache) are used only where they are the
stored checkpoint: with two servers writing the same nodes, transactions that roll back after
their append, and rebuilds in between, every decision sees the state PostgreSQL holds and the
live read models equal a rebuild."""

from __future__ import annotations

import asyncio
import os
import uuid

import asyncpg
import msgspec
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from collectors.identity import NodeIdentity
from domain.node import NodeState, node_id_for
from domain.reconcile import reconcile
from ledger.events import NewEvent
from ledger.store import EventStore
from ledger.unit_of_work import UnitOfWork
from projections.inventory import ALL_PROJECTIONS, INVENTORY
from projections.rebuild import rebuild
from tests.builders import meta
from tests.test_projection_property import observation_of, plain_step, steps


class RolledBack(Exception):
    """Raised inside a unit of work after its append: the transaction is rolled back."""


# (server 0 or 1, what happens, node, observation): an append that commits, one whose transaction
# rolls back after the append, or a rebuild of the read models.
actions = st.lists(
    st.tuples(
        st.integers(0, 1),
        st.sampled_from(["commit", "commit", "commit", "rollback", "rebuild"]),
        st.integers(0, 1),
        steps,
    ),
    min_size=1,
    max_size=14,
)


async def stored_state(pool: asyncpg.Pool, node_id: str) -> NodeState:
    async with pool.acquire() as conn:
        return await INVENTORY.load_state(conn, node_id)


async def test_kept_states_never_stand_in_for_another_checkpoint(pool: asyncpg.Pool) -> None:
    loop = asyncio.get_running_loop()
    servers = [EventStore(pool, ALL_PROJECTIONS), EventStore(pool, ALL_PROJECTIONS)]

    @settings(
        max_examples=int(os.environ.get("MF_PROPERTY_EXAMPLES", "30")),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(history=actions)
    # Every run uses kept states and refuses them on both servers, whatever the random histories:
    # each server opens node 0 (miss), again (hit), then the other one has written it (miss).
    @example(
        history=[
            (0, "commit", 0, _step(40)),
            (0, "commit", 0, _step(41)),
            (1, "commit", 0, _step(42)),
            (1, "commit", 0, _step(43)),
            (0, "commit", 0, _step(44)),
        ]
    )
    def prop(history: list) -> None:  # type: ignore[type-arg]
        prefix = uuid.uuid4().hex[:8]

        async def example() -> None:
            for server, action, node_no, step in history:
                store = servers[server]
                if action == "rebuild":
                    await rebuild(pool, ALL_PROJECTIONS)
                    continue
                identity = NodeIdentity(key=f"{prefix}-{node_no}", source="configured")
                node_id = node_id_for(identity.key)

                def decide(
                    state: NodeState, identity: NodeIdentity = identity, step: dict = step
                ) -> list[NewEvent]:  # type: ignore[type-arg]
                    return [NewEvent(p, meta()) for p in reconcile(observation_of(step), state, identity)]

                try:
                    async with UnitOfWork(store, INVENTORY).open(node_id) as stream:
                        # What the decision is handed is what PostgreSQL holds, kept or sent.
                        assert stream.state == await stored_state(pool, node_id)
                        await stream.decide(decide)
                        if action == "rollback":
                            raise RolledBack
                except RolledBack:
                    pass
            report = await rebuild(pool, ALL_PROJECTIONS, verify=True)
            assert report.differences == [], report.differences

        asyncio.run_coroutine_threadsafe(example(), loop).result()

    await asyncio.to_thread(prop)
    # The property is about kept states, so they must have been used, and refused too.
    assert all(s.states.hits > 0 and s.states.misses > 0 for s in servers), [
        (s.states.hits, s.states.misses) for s in servers
    ]


async def test_a_store_uses_its_kept_state_and_sends_no_state_back(store: EventStore) -> None:
    identity = NodeIdentity(key="kept", source="configured")
    node_id = node_id_for(identity.key)
    uow = UnitOfWork(store, INVENTORY)
    step = plain_step()
    for temp in (40, 41, 42):
        async with uow.open(node_id) as stream:
            await stream.decide(
                lambda s, t=temp: [
                    NewEvent(p, meta()) for p in reconcile(observation_of({**step, "temp": t}), s, identity)
                ]
            )
    # The first open had no checkpoint; the next two found the one this store wrote.
    assert (store.states.hits, store.states.misses) == (2, 0)
    (entry,), rebuild_at = store.states.known("inventory", [node_id])
    assert entry is not None
    async with store.pool.acquire() as conn, conn.transaction():
        (row,) = await conn.fetch(
            "SELECT out_state, out_state_version FROM mf_open_streams($1, 'inventory', $2, $3, $4)",
            [node_id],
            [entry.version],
            [entry.position],
            rebuild_at,
        )
    assert row["out_state"] is None and row["out_state_version"] is not None


async def test_after_a_rebuild_the_rebuilt_states_are_used(store: EventStore) -> None:
    # A rebuild writes every state anew at the same checkpoints; the states it writes may differ
    # from the kept ones (a corrected fold). Simulated: the rebuilt state of the node is changed
    # in place, its checkpoint kept. The next unit of work must be handed the rebuilt one.
    identity = NodeIdentity(key="rebuilt", source="configured")
    node_id = node_id_for(identity.key)
    uow = UnitOfWork(store, INVENTORY)
    step = plain_step(gpus={0})
    for _ in range(2):
        async with uow.open(node_id) as stream:
            await stream.decide(
                lambda s: [NewEvent(p, meta()) for p in reconcile(observation_of(step), s, identity)]
            )
    await rebuild(store.pool, ALL_PROJECTIONS)
    corrected = msgspec.structs.replace(await stored_state(store.pool, node_id), hostname="corrected.example")
    async with store.pool.acquire() as conn:
        await conn.execute(
            "UPDATE projection_state SET state = $1 WHERE projection = 'inventory' AND stream_id = $2",
            INVENTORY.encode_state(corrected),
            node_id,
        )
    async with uow.open(node_id) as stream:
        assert stream.state.hostname == "corrected.example"


# --- appends in one round trip on kept states (EventStore._append_kept) -------------------------

# (server, what happens, node, observation, the append names the stream's version): a unit of work
# that commits or rolls back after its append, an append through the store's group commit (on the
# kept state where the store holds it), or a rebuild.
kept_actions = st.lists(
    st.tuples(
        st.integers(0, 1),
        st.sampled_from(["append", "append", "append", "commit", "rollback", "rebuild"]),
        st.integers(0, 1),
        steps,
        st.booleans(),
    ),
    min_size=1,
    max_size=14,
)


async def test_an_append_on_a_kept_state_folds_onto_the_stored_checkpoint(pool: asyncpg.Pool) -> None:
    loop = asyncio.get_running_loop()
    servers = [EventStore(pool, ALL_PROJECTIONS), EventStore(pool, ALL_PROJECTIONS)]

    @settings(
        max_examples=int(os.environ.get("MF_PROPERTY_EXAMPLES", "30")),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(history=kept_actions)
    # Both ways in every run, whatever the random histories: server 0 keeps node 0's state,
    # server 1 writes the node, server 0's kept state is refused (stale), then kept again.
    @example(
        history=[
            (0, "append", 0, _step(40), False),
            (1, "append", 0, _step(41), False),
            (0, "append", 0, _step(42), False),
            (0, "append", 0, _step(43), False),
        ]
    )
    def prop(history: list) -> None:  # type: ignore[type-arg]
        prefix = uuid.uuid4().hex[:8]

        async def example() -> None:
            for server, action, node_no, step, versioned in history:
                store = servers[server]
                if action == "rebuild":
                    await rebuild(pool, ALL_PROJECTIONS)
                    continue
                identity = NodeIdentity(key=f"{prefix}-{node_no}", source="configured")
                node_id = node_id_for(identity.key)
                if action == "append":
                    stored = await stored_state(pool, node_id)
                    events = [NewEvent(p, meta()) for p in reconcile(observation_of(step), stored, identity)]
                    if not events:
                        continue
                    expected = stored.stream_version if versioned else None
                    result = await store.append(node_id, expected, events)
                    # Folded onto what PostgreSQL held, kept or not.
                    assert result.states["inventory"] == INVENTORY.fold_all(stored, result.events)
                    continue
                try:
                    async with UnitOfWork(store, INVENTORY).open(node_id) as stream:
                        await stream.decide(
                            lambda s, i=identity, o=observation_of(step): [
                                NewEvent(p, meta()) for p in reconcile(o, s, i)
                            ]
                        )
                        if action == "rollback":
                            raise RolledBack
                except RolledBack:
                    pass
            report = await rebuild(pool, ALL_PROJECTIONS, verify=True)
            assert report.differences == [], report.differences

        asyncio.run_coroutine_threadsafe(example(), loop).result()

    await asyncio.to_thread(prop)
    # Both ways must have been taken: in one round trip, and refused for another checkpoint.
    assert sum(s.states.kept_appends for s in servers) > 0, [s.states.kept_appends for s in servers]
    assert sum(s.states.stale for s in servers) > 0, [s.states.stale for s in servers]


def _step(temp: int) -> dict:  # type: ignore[type-arg]
    return {
        "gpus": {0, 1},
        "status": "complete",
        "driver": "550.54.15",
        "kernel": "6.8.0-45-generic",
        "temp": temp,
        "swap_pci": False,
        "flicker": False,
        "fan_zero": False,
        "health": "clean",
    }


async def test_a_kept_state_of_a_rolled_back_append_is_never_folded_onto(pool: asyncpg.Pool) -> None:
    # Server a keeps the state of an append whose transaction rolled back; server b then takes the
    # stream to that same version with other events. The version alone matches a's kept entry:
    # only the checkpoint's position tells the two apart.
    a, b = EventStore(pool, ALL_PROJECTIONS), EventStore(pool, ALL_PROJECTIONS)
    identity = NodeIdentity(key="rolled-back", source="configured")
    node_id = node_id_for(identity.key)

    async def unit(store: EventStore, temp: int, *, roll_back: bool = False) -> int:
        try:
            async with UnitOfWork(store, INVENTORY).open(node_id) as stream:
                done = await stream.decide(
                    lambda s: [
                        NewEvent(p, meta()) for p in reconcile(observation_of(_step(temp)), s, identity)
                    ]
                )
                if roll_back:
                    raise RolledBack
                return done.stream_version
        except RolledBack:
            return done.stream_version

    await unit(a, 40)
    await unit(b, 40)  # b holds the stream's state too
    rolled_back = await unit(a, 41, roll_back=True)
    assert await unit(b, 90) == rolled_back  # the same version as a's kept entry
    stored = await stored_state(pool, node_id)
    events = [NewEvent(p, meta()) for p in reconcile(observation_of(_step(60)), stored, identity)]
    result = await a.append(node_id, None, events)
    assert a.states.stale == 1 and a.states.kept_appends == 0
    assert result.states["inventory"] == INVENTORY.fold_all(stored, result.events)
    report = await rebuild(pool, ALL_PROJECTIONS, verify=True)
    assert report.differences == [], report.differences


async def test_after_a_rebuild_a_kept_append_folds_onto_the_rebuilt_state(store: EventStore) -> None:
    # As test_after_a_rebuild_the_rebuilt_states_are_used, for the store's own append.
    identity = NodeIdentity(key="rebuilt-kept", source="configured")
    node_id = node_id_for(identity.key)
    for temp in (40, 41):
        stored = await stored_state(store.pool, node_id)
        events = [NewEvent(p, meta()) for p in reconcile(observation_of(_step(temp)), stored, identity)]
        await store.append(node_id, None, events)
    assert store.states.kept_appends == 1  # the second append, in one round trip
    await rebuild(store.pool, ALL_PROJECTIONS)
    # A part of the state no observation changes, so the next fold carries it over.
    corrected = msgspec.structs.replace(await stored_state(store.pool, node_id), display_name="corrected")
    async with store.pool.acquire() as conn:
        await conn.execute(
            "UPDATE projection_state SET state = $1 WHERE projection = 'inventory' AND stream_id = $2",
            INVENTORY.encode_state(corrected),
            node_id,
        )
    stored = await stored_state(store.pool, node_id)
    events = [NewEvent(p, meta()) for p in reconcile(observation_of(_step(42)), stored, identity)]
    result = await store.append(node_id, None, events)
    assert store.states.stale == 1
    assert result.states["inventory"] == INVENTORY.fold_all(corrected, result.events)
    assert result.states["inventory"].display_name == "corrected"
