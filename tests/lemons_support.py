"""A GPU that fell off the bus (XID 79) on node A and was moved to node B, beside a GPU that failed
once in a long service on node C and a GPU that was only degraded: refreshes reconciled and
appended as the service does (one locked unit per node and refresh), with times counted back
from now so that the default window of the lemons (90 days) holds them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec

from collectors.gpu_health import AcceleratorHealthSignals, XidOccurrence
from collectors.identity import NodeIdentity
from collectors.observations import AcceleratorObservation, HardwareObservation
from domain.node import node_id_for
from domain.reconcile import reconcile
from ledger.events import NewEvent
from ledger.store import EventStore
from projections.inventory import INVENTORY
from tests.builders import gpu, host, meta, pending_remap, scan, signals, uncorrected_ecc

NOW = datetime.now(UTC).replace(microsecond=0)
BASE = NOW - timedelta(days=10)
MOVED = gpu(0).uuid  # XID 79 on A, then moved to B
NEIGHBOUR = gpu(1).uuid  # stays on A, only degraded
STEADY = gpu(3).uuid  # one failure in a long service on C
ON_B = gpu(2).uuid  # B's own GPU, never failing
NODE_A, NODE_B, NODE_C = node_id_for("lemon-a"), node_id_for("lemon-b"), node_id_for("lemon-c")
# Service: A from BASE to its last sample there (BASE + 1 d); B from BASE + 2 d 1 h to BASE + 5 d.
MOVED_SERVICE_DAYS = 1 + (3 * 24 - 1) / 24


def _gpu(n: int, health: AcceleratorHealthSignals | None = None) -> AcceleratorObservation:
    return msgspec.structs.replace(gpu(n), health=health or signals())


async def observe(store: EventStore, key: str, at: datetime, *gpus: AcceleratorObservation) -> None:
    """One refresh of the node `key` at `at`: reconciled on its state under its lock, appended."""
    node_id = node_id_for(key)
    observation = HardwareObservation(observed_at=at, host=host(key), nvml=scan(list(gpus)))
    async with store.pool.acquire() as conn, conn.transaction():
        info = await store.lock_stream(conn, node_id)
        state = await INVENTORY.load_state(conn, node_id)
        payloads = reconcile(observation, state, NodeIdentity(key=key, source="configured"))
        events = [NewEvent(p, meta(at)) for p in payloads]
        await store.append(node_id, info.version, events, conn=conn, locked=True)


async def seed_moved_gpu(store: EventStore) -> None:
    day = timedelta(days=1)
    await observe(store, "lemon-c", NOW - 80 * day, _gpu(3))
    await observe(store, "lemon-a", BASE, _gpu(0), _gpu(1))
    xid = XidOccurrence(code=79, at=BASE + day)
    await observe(store, "lemon-a", BASE + day, _gpu(0, signals(xids=[xid])), _gpu(1))
    # Pulled from A (a complete scan without it), installed in B.
    await observe(store, "lemon-a", BASE + 2 * day, _gpu(1))
    await observe(store, "lemon-b", BASE + 2 * day + timedelta(hours=1), _gpu(0), _gpu(2))
    await observe(store, "lemon-a", BASE + 3 * day, _gpu(1, pending_remap()))
    await observe(store, "lemon-b", BASE + 5 * day, _gpu(0), _gpu(2))
    await observe(store, "lemon-c", NOW - 5 * day, _gpu(3, uncorrected_ecc()))
    await observe(store, "lemon-c", NOW - day, _gpu(3, uncorrected_ecc()))
