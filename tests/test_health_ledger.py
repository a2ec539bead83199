"""GPU health in the ledger: a verdict change is one lifecycle event, a steady state none, an XID
is recorded once, counters are telemetry, the fingerprint ignores all of it, and a rebuild and an
as-of read reproduce the verdicts."""

from __future__ import annotations

import uuid
from datetime import timedelta

import msgspec

from collectors.facts import Known
from collectors.gpu_health import (
    ECC_COUNTERS,
    AcceleratorHealthSignals,
    XidOccurrence,
)
from collectors.identity import NodeIdentity
from collectors.observations import AcceleratorObservation, HardwareObservation
from domain.health import XID_WINDOW
from domain.node import NodeState, evolve, node_id_for
from domain.reconcile import reconcile
from ledger.events import (
    AcceleratorHealthChanged,
    AcceleratorXidObserved,
    EventPayload,
    NewEvent,
    NodeTelemetryObserved,
    RecordedEvent,
    event_class_of,
    event_type_of,
)
from ledger.store import EventStore
from projections.inventory import ALL_PROJECTIONS, INVENTORY
from projections.pointintime import accelerator_records, inventory_as_of
from projections.rebuild import rebuild
from tests.builders import T0, gpu, host, meta, pending_remap, scan, signals
from tests.sample_reads import latest_samples

IDENTITY = NodeIdentity(key="health-node", source="configured")


def healthy_gpu(n: int, health: AcceleratorHealthSignals | None = None) -> AcceleratorObservation:
    return msgspec.structs.replace(gpu(n), health=health or signals())


def obs(*gpus: AcceleratorObservation, at: timedelta = timedelta(0)) -> HardwareObservation:
    return HardwareObservation(observed_at=T0 + at, host=host(), nvml=scan(list(gpus)))


class Node:
    """Reconcile and fold in memory, as the service does in one transaction."""

    def __init__(self) -> None:
        self.state = NodeState(node_id=node_id_for(IDENTITY.key))
        self.position = 0

    def refresh(self, observation: HardwareObservation) -> list[EventPayload]:
        payloads = reconcile(observation, self.state, IDENTITY)
        for p in payloads:
            self.position += 1
            self.state = evolve(
                self.state,
                RecordedEvent(
                    global_position=self.position,
                    stream_id=self.state.node_id,
                    stream_version=self.state.stream_version + 1,
                    event_id=uuid.uuid4(),
                    event_type=event_type_of(p),
                    event_class=event_class_of(p),
                    schema_version=1,
                    payload=p,
                    metadata=meta(observation.observed_at),
                    recorded_at=observation.observed_at,
                ),
            )
        return payloads


def lifecycle(payloads: list[EventPayload]) -> list[EventPayload]:
    return [p for p in payloads if event_class_of(p) == "lifecycle"]


def test_a_transition_is_one_lifecycle_event_and_a_steady_state_none() -> None:
    node = Node()
    node.refresh(obs(healthy_gpu(0), healthy_gpu(1)))
    fingerprint = node.state.fingerprint
    acc = node.state.accelerators[gpu(1).uuid]
    assert acc.health.status == "healthy"

    changed = node.refresh(obs(healthy_gpu(0), healthy_gpu(1, pending_remap())))
    (event,) = lifecycle(changed)
    assert isinstance(event, AcceleratorHealthChanged)
    assert (event.uuid, event.before, event.after, event.action) == (
        gpu(1).uuid,
        "healthy",
        "degraded",
        "reset_gpu",
    )
    assert [r.code for r in event.reasons] == ["row_remap_pending"]
    verdict = node.state.accelerators[gpu(1).uuid].health
    assert (verdict.status, verdict.action) == ("degraded", "reset_gpu")

    # Same verdict, growing counters: telemetry only, the counters in it.
    grown = msgspec.structs.replace(pending_remap(), pcie_replay_count=Known(40))
    steady = node.refresh(obs(healthy_gpu(0), healthy_gpu(1, grown)))
    assert lifecycle(steady) == []
    (snapshot,) = [p for p in steady if isinstance(p, NodeTelemetryObserved)]
    telemetry = [a for a in snapshot.accelerators if a.uuid == gpu(1).uuid]
    assert telemetry[0].health is not None and telemetry[0].health.pcie_replay_count == Known(40)
    assert node.state.fingerprint == fingerprint

    # Reset: the remap is done, the GPU is healthy again (before -> after, with the old reasons).
    (back,) = lifecycle(node.refresh(obs(healthy_gpu(0), healthy_gpu(1))))
    assert isinstance(back, AcceleratorHealthChanged)
    assert (back.before, back.after, back.before_reasons, back.reasons) == (
        "degraded",
        "healthy",
        ["row_remap_pending"],
        [],
    )
    assert node.state.fingerprint == fingerprint


def test_an_xid_is_recorded_once_and_fails_the_gpu_for_its_window() -> None:
    node = Node()
    node.refresh(obs(healthy_gpu(0)))
    xid = XidOccurrence(code=79, at=T0 + timedelta(minutes=1))
    with_xid = healthy_gpu(0, signals(xids=[xid]))
    first = lifecycle(node.refresh(obs(with_xid, at=timedelta(minutes=1))))
    assert [type(p) for p in first] == [AcceleratorXidObserved, AcceleratorHealthChanged]
    assert isinstance(first[0], AcceleratorXidObserved) and (first[0].code, first[0].at) == (79, xid.at)
    assert isinstance(first[1], AcceleratorHealthChanged) and (first[1].after, first[1].action) == (
        "failed",
        "service",
    )
    sampled = node.state.accelerator_telemetry.get(gpu(0).uuid)  # the XIDs' own sample leaves them out
    assert sampled is not None and sampled.health is not None and sampled.health.xids == []
    # The same occurrence reported again (a resent report) is not recorded twice.
    assert lifecycle(node.refresh(obs(with_xid, at=timedelta(minutes=2)))) == []
    # Quiet refreshes keep the verdict within the window, and clear it after.
    assert lifecycle(node.refresh(obs(healthy_gpu(0), at=timedelta(hours=1)))) == []
    (cleared,) = lifecycle(node.refresh(obs(healthy_gpu(0), at=XID_WINDOW + timedelta(minutes=2))))
    assert isinstance(cleared, AcceleratorHealthChanged) and cleared.after == "healthy"
    # Telemetry never carries the XIDs (they are lifecycle events).
    telemetry = node.state.accelerator_telemetry.get(gpu(0).uuid)
    assert telemetry is not None and telemetry.health is not None and telemetry.health.xids == []


def test_an_xid_drained_during_the_collection_counts_at_once() -> None:
    # observed_at is taken when the collection starts; NVML's XIDs are drained during it, so
    # their `at` is a little later. The GPU must fail by this refresh, not the next one.
    node = Node()
    node.refresh(obs(healthy_gpu(0)))
    collection_started = timedelta(minutes=1)
    xid = XidOccurrence(code=79, at=T0 + collection_started + timedelta(milliseconds=40))
    changed = lifecycle(node.refresh(obs(healthy_gpu(0, signals(xids=[xid])), at=collection_started)))
    assert [type(p) for p in changed] == [AcceleratorXidObserved, AcceleratorHealthChanged]
    assert node.state.accelerators[gpu(0).uuid].health.status == "failed"
    # And it still clears after its window, measured from when it was drained.
    (cleared,) = lifecycle(
        node.refresh(obs(healthy_gpu(0), at=collection_started + XID_WINDOW + timedelta(seconds=1)))
    )
    assert isinstance(cleared, AcceleratorHealthChanged) and cleared.after == "healthy"


def test_an_old_agent_without_signals_leaves_gpus_healthy_and_quiet() -> None:
    node = Node()
    assert lifecycle(node.refresh(obs(gpu(0))))[-1].__class__.__name__ != "AcceleratorHealthChanged"
    assert lifecycle(node.refresh(obs(gpu(0)))) == []
    assert node.state.accelerators[gpu(0).uuid].health.status == "healthy"
    # A GPU judged by its signals, then reported without any (and no XID): nothing holds the
    # verdict any longer, so it is healthy again, said once.
    node.refresh(obs(healthy_gpu(0, pending_remap())))
    assert node.state.accelerators[gpu(0).uuid].health.status == "degraded"
    (back,) = lifecycle(node.refresh(obs(gpu(0), at=timedelta(seconds=10))))
    assert isinstance(back, AcceleratorHealthChanged) and (back.before, back.after) == ("degraded", "healthy")
    assert lifecycle(node.refresh(obs(gpu(0), at=timedelta(seconds=20)))) == []


def test_a_gpu_discovered_failing_is_audited_at_once() -> None:
    node = Node()
    failing = healthy_gpu(
        0, signals(ecc_errors={**{n: Known(0) for n in ECC_COUNTERS}, "uncorrected_volatile": Known(2)})
    )
    changes = [p for p in node.refresh(obs(failing)) if isinstance(p, AcceleratorHealthChanged)]
    assert [(c.before, c.after, c.action) for c in changes] == [("healthy", "failed", "service")]


async def test_rebuild_and_as_of_reproduce_the_verdicts(store: EventStore) -> None:
    node_id = node_id_for(IDENTITY.key)
    steps = [
        obs(healthy_gpu(0), healthy_gpu(1)),
        obs(healthy_gpu(0), healthy_gpu(1, pending_remap()), at=timedelta(minutes=1)),
        obs(
            healthy_gpu(0, signals(xids=[XidOccurrence(code=79, at=T0 + timedelta(minutes=2))])),
            healthy_gpu(1, pending_remap()),
            at=timedelta(minutes=2),
        ),
    ]
    for step in steps:
        async with store.pool.acquire() as conn, conn.transaction():
            info = await store.lock_stream(conn, node_id)
            state = await INVENTORY.load_state(conn, node_id)
            payloads = reconcile(step, state, IDENTITY)
            await store.append(
                node_id,
                info.version,
                [NewEvent(p, meta(step.observed_at)) for p in payloads],
                conn=conn,
                locked=True,
            )

    async with store.pool.acquire() as conn:
        live = {
            r["uuid"]: (r["health_status"], r["health_action"], [x["code"] for x in r["health_reasons"]])
            for r in await conn.fetch(
                "SELECT uuid, health_status, health_action, health_reasons FROM hw_accelerators"
            )
        }
        latest = {u: x for u, _, x in await latest_samples(conn)}[gpu(1).uuid]
        as_of = await inventory_as_of(conn, T0 + timedelta(days=365), node_id=node_id)
    assert live == {
        gpu(0).uuid: ("failed", "service", ["xid_79"]),
        gpu(1).uuid: ("degraded", "reset_gpu", ["row_remap_pending"]),
    }
    assert latest is not None and latest.health is not None
    assert latest.health.remapped_rows["pending"] == Known(True)
    records = {
        r["uuid"]: (r["health_status"], r["health_action"], [x["code"] for x in r["health_reasons"]])
        for r in accelerator_records(as_of.nodes[0])
    }
    assert records == live
    report = await rebuild(store.pool, ALL_PROJECTIONS, verify=True)
    assert report.differences == []


def test_a_gpu_that_fell_off_the_bus_is_failed_by_its_xid() -> None:
    node = Node()
    node.refresh(obs(healthy_gpu(0), healthy_gpu(1)))
    xid = XidOccurrence(code=79, at=T0 + timedelta(minutes=1))
    incomplete = msgspec.structs.replace(
        scan([healthy_gpu(0)], status="incomplete", reason="GPU at index 1: GPU is lost"),
        unlisted_xids={gpu(1).uuid: [xid]},
    )
    payloads = node.refresh(HardwareObservation(observed_at=xid.at, host=host(), nvml=incomplete))
    health = [
        p for p in lifecycle(payloads) if isinstance(p, AcceleratorXidObserved | AcceleratorHealthChanged)
    ]
    assert [type(p) for p in health] == [AcceleratorXidObserved, AcceleratorHealthChanged]
    assert isinstance(health[1], AcceleratorHealthChanged)
    assert (health[1].uuid, health[1].after, health[1].action) == (gpu(1).uuid, "failed", "service")
    acc = node.state.accelerators[gpu(1).uuid]
    assert acc.status == "active"  # an incomplete scan marks nothing missing
    assert (acc.health.status, [r.code for r in acc.health.reasons]) == ("failed", ["xid_79"])
