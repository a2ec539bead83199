from __future__ import annotations

from domain.node import NodeState, node_id_for
from domain.reconcile import NodeIdentity, reconcile
from ledger.store import EventStore
from projections.inventory import INVENTORY
from projections.rebuild import rebuild
from tests.builders import new, observation


async def test_append_and_rebuild(store: EventStore) -> None:
    node_id = node_id_for("key-1")
    events = reconcile(observation(), NodeState(node_id=node_id), NodeIdentity("key-1", "configured"))
    result = await store.append(node_id, 0, [new(e) for e in events])
    assert result.stream_version == len(events)
    async with store.pool.acquire() as conn:
        state = await INVENTORY.load_state(conn, node_id)
        assert state.discovered
        assert len(state.accelerators) == 2
        n = await conn.fetchval("select count(*) from hw_accelerators")
        assert n == 2
    report = await rebuild(store.pool, [INVENTORY], verify=True)
    assert report.differences == [], report.differences
    report = await rebuild(store.pool, [INVENTORY])
    assert report.swapped
