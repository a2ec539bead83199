"""A compute node's state, folded from its stream: the pure `evolve(state, event) -> state`.

The reconciler decides against this state and the inventory projection stores it; both use the
same fold, so what the service decides on is exactly what a rebuild from the log produces.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterable
from datetime import datetime
from functools import lru_cache
from typing import Literal, TypeAlias

import msgspec

from collectors.facts import UNKNOWN, Fact, Known
from collectors.gpu_health import AcceleratorHealthSignals, XidOccurrence
from collectors.observations import (
    ACCELERATOR_INVENTORY_FACTS,
    DRIVER_FACTS,
    NODE_INVENTORY_FACTS,
    CpuInfo,
    OsInfo,
    StorageObservation,
)
from domain.health import HEALTHY, XID_WINDOW, HealthVerdict
from ledger.events import (
    AcceleratorDiscovered,
    AcceleratorHealthChanged,
    AcceleratorMissing,
    AcceleratorTelemetryObserved,
    AcceleratorXidObserved,
    CredentialIssued,
    CredentialRevoked,
    HardwareChanged,
    HostTelemetryObserved,
    InventoryFailed,
    InventoryStatusChanged,
    NodeDecommissioned,
    NodeDiscovered,
    NodeMetadataChanged,
    NodeTelemetryObserved,
    RecordedEvent,
    WorkLeaseAcquired,
    WorkLeaseReleased,
)

# Fixed namespace: the same identity key gives the same node id on any machine, in any process.
NODE_ID_NAMESPACE = uuid.UUID("6f1d7c1e-3b0a-5a8e-9f61-4d2b8c0e7a10")

AcceleratorStatus: TypeAlias = Literal["active", "missing", "decommissioned"]
NodeStatus: TypeAlias = Literal["active", "decommissioned"]
InventoryStatus: TypeAlias = Literal["pending", "ok", "degraded", "failed"]

_UNKNOWN_OS = OsInfo(name=UNKNOWN, version=UNKNOWN, kernel=UNKNOWN, architecture=UNKNOWN)
_UNKNOWN_CPU = CpuInfo(model=UNKNOWN, sockets=UNKNOWN, physical_cores=UNKNOWN, logical_cores=UNKNOWN)


# Cached: every report derives its node's id again (uuid5 is a SHA-1); the cache holds a
# 10,000-node fleet. Its GPUs' ids: collectors.identity.accelerator_id_for.
@lru_cache(maxsize=16_384)
def node_id_for(identity_key: str) -> str:
    """The node's internal UUID: derived from the identity key, so it maps to it uniquely and a
    rediscovery after any loss of read models lands on the same node."""
    return str(uuid.uuid5(NODE_ID_NAMESPACE, identity_key))


class Telemetry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    metrics: dict[str, Fact]
    observed_at: datetime | None
    received_at: datetime
    position: int
    health: AcceleratorHealthSignals | None = None  # accelerators only


class AcceleratorState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    accelerator_id: str
    uuid: str
    status: AcceleratorStatus
    index: Fact
    name: Fact
    pci_bus_id: Fact
    memory_total_bytes: Fact
    compute_capability: Fact
    mig_mode: Fact
    driver_version: Fact
    cuda_driver_version: Fact
    first_seen_at: datetime
    last_seen_at: datetime
    position: int
    missing_since: datetime | None = None
    health: HealthVerdict = HEALTHY
    # The XIDs recorded lately (within XID_WINDOW of the newest, at most MAX_RECENT_XIDS): what
    # the verdict counts and what a repeated report of the same occurrence is recognized by.
    xids: list[XidOccurrence] = []
    # The node stream version of each of `xids` (0: recorded before versions were kept), in the
    # same order: what a verdict names as its evidence.
    xid_versions: list[int] = []
    # Where checkpoints of inventory versions before 8 kept the GPU's latest sample (null in those
    # written split). Read only: the projection moves it to NodeState.accelerator_telemetry when it
    # decodes such a checkpoint (one a refused rebuild left as it was, docs/upgrades.md).
    legacy_telemetry: Telemetry | None = msgspec.field(default=None, name="telemetry")

    def versions_of_xids(self) -> dict[XidOccurrence, int]:
        """The stream version that recorded each of `xids` (the first of equal occurrences)."""
        versions = self.xid_versions if len(self.xid_versions) == len(self.xids) else [0] * len(self.xids)
        out: dict[XidOccurrence, int] = {}
        for x, v in zip(self.xids, versions, strict=True):
            out.setdefault(x, v)
        return out


MAX_RECENT_XIDS = 64


def _remember_xid(
    acc: AcceleratorState, new: XidOccurrence, version: int
) -> tuple[list[XidOccurrence], list[int]]:
    versions = acc.xid_versions if len(acc.xid_versions) == len(acc.xids) else [0] * len(acc.xids)
    kept = sorted([*zip(acc.xids, versions, strict=True), (new, version)], key=lambda p: (p[0].at, p[0].code))
    newest = kept[-1][0].at
    kept = [p for p in kept if p[0].at > newest - XID_WINDOW][-MAX_RECENT_XIDS:]
    return [x for x, _v in kept], [v for _x, v in kept]


class LastRun(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    outcome: Literal["succeeded", "failed"]
    status: InventoryStatus
    reasons: list[str]
    nvml_status: str | None
    at: datetime
    position: int


class CredentialState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A node credential (docs/NODE_AGENT_PROTOCOL.md): its secret's SHA-256, never the secret."""

    credential_id: str
    identity_key: str
    hostname: str
    secret_sha256: str
    enrollment_token_id: str
    issued_at: datetime
    position: int
    revoked_at: datetime | None = None
    revoked_reason: str | None = None


class LeaseState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A work lease on the node (docs/NODE_DECOMMISSION.md): held until released; one with an
    `expires_at` stops counting at that moment (and is dropped from the state at the node's next
    lease event or its tombstone)."""

    lease_id: str
    owner: str
    reason: str
    acquired_at: datetime
    position: int
    expires_at: datetime | None = None
    actor: str | None = None

    def active_at(self, moment: datetime) -> bool:
        return self.expires_at is None or self.expires_at > moment


class NodeState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    node_id: str
    stream_version: int = 0
    lifecycle_version: int = 0
    position: int = 0
    discovered: bool = False
    identity_key: str | None = None
    identity_source: str | None = None
    hostname: str | None = None
    display_name: str | None = None
    status: NodeStatus = "active"
    os: OsInfo = _UNKNOWN_OS
    cpu: CpuInfo = _UNKNOWN_CPU
    memory_total_bytes: Fact = UNKNOWN
    driver_version: Fact = UNKNOWN
    cuda_driver_version: Fact = UNKNOWN
    accelerators: dict[str, AcceleratorState] = {}  # by GPU UUID
    inventory_status: InventoryStatus = "pending"
    inventory_reasons: list[str] = []
    accelerator_capability: Literal["present", "absent", "unknown"] = "unknown"
    nvml_status: str | None = None
    last_run: LastRun | None = None
    fingerprint: str | None = None
    fingerprint_position: int | None = None
    host_telemetry: Telemetry | None = None
    # Each active accelerator's latest sample, by GPU UUID. Kept beside the accelerators, not in
    # them: a steady report replaces the samples and leaves every AcceleratorState as it was.
    accelerator_telemetry: dict[str, Telemetry] = {}
    storage: list[StorageObservation] = []
    source: str | None = None
    first_seen_at: datetime | None = None
    last_seen_at: datetime | None = None
    last_observed_at: datetime | None = None
    last_received_at: datetime | None = None
    clock_skew_seconds: float | None = None
    decommissioned_at: datetime | None = None
    credentials: dict[str, CredentialState] = {}  # by credential id
    leases: dict[str, LeaseState] = {}  # unreleased work leases, by lease id


def _value(fact: Fact) -> object:
    return fact.value if isinstance(fact, Known) else None


def fingerprint_of(state: NodeState) -> str | None:
    """SHA-256 of the canonical JSON of the node's identity, OS and active accelerators
    (docs/architecture.md, "Fingerprint"). Nothing transient goes in. None before discovery."""
    if not state.discovered or state.identity_key is None:
        return None
    doc = {
        "identity_key": state.identity_key,
        "os": {
            "name": _value(state.os.name),
            "version": _value(state.os.version),
            "kernel": _value(state.os.kernel),
            "architecture": _value(state.os.architecture),
        },
        "accelerators": [
            {
                "uuid": acc.uuid,
                "model": _value(acc.name),
                "pci_bus_id": _value(acc.pci_bus_id),
                "memory_total_bytes": _value(acc.memory_total_bytes),
                "compute_capability": _value(acc.compute_capability),
                "driver_version": _value(acc.driver_version),
                "cuda_driver_version": _value(acc.cuda_driver_version),
            }
            for acc in sorted(state.accelerators.values(), key=lambda a: a.uuid)
            if acc.status == "active"
        ],
    }
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


_ACCELERATOR_FACTS = frozenset((*ACCELERATOR_INVENTORY_FACTS, *DRIVER_FACTS))
_NODE_FACTS = frozenset(NODE_INVENTORY_FACTS)


# Only these events change what the fingerprint covers (identity, OS, active accelerators and
# their facts); computing it on every other event would cost a fifth of a rebuild's time.
_FINGERPRINT_INPUTS = (NodeDiscovered, HardwareChanged, AcceleratorDiscovered, AcceleratorMissing)


def _seen(state: NodeState, event: RecordedEvent) -> NodeState:
    """Bookkeeping every event of the stream updates: versions, times, liveness by receive time."""
    meta = event.metadata
    skew = state.clock_skew_seconds
    if meta.agent_sent_at is not None:
        # An agent's clock when it sent: a spooled report's age is not clock skew.
        skew = (meta.agent_sent_at - meta.received_at).total_seconds()
    elif meta.observed_at is not None:
        skew = (meta.observed_at - meta.received_at).total_seconds()
    lifecycle = state.lifecycle_version + (1 if event.event_class == "lifecycle" else 0)
    return msgspec.structs.replace(
        state,
        stream_version=event.stream_version,
        lifecycle_version=lifecycle,
        position=event.global_position,
        last_received_at=meta.received_at,
        last_observed_at=meta.observed_at or state.last_observed_at,
        clock_skew_seconds=skew,
        source=meta.source if meta.source in ("local", "agent") else state.source,
    )


_ADMINISTRATIVE = (
    CredentialIssued,
    CredentialRevoked,
    WorkLeaseAcquired,
    WorkLeaseReleased,
    NodeDecommissioned,
)


def _administrative(state: NodeState, event: RecordedEvent) -> NodeState:
    """Credential, lease and decommission events: versions move, but they are no sign of life of
    the node (liveness and clock skew come from its own reports only)."""
    p = event.payload
    at = event.metadata.received_at
    credentials = state.credentials
    leases = state.leases
    updates: dict[str, object] = {}
    if isinstance(p, CredentialIssued):
        credentials = dict(credentials)
        credentials[p.credential_id] = CredentialState(
            credential_id=p.credential_id,
            identity_key=p.identity_key,
            hostname=p.hostname,
            secret_sha256=p.secret_sha256,
            enrollment_token_id=p.enrollment_token_id,
            issued_at=at,
            position=event.global_position,
        )
    elif isinstance(p, CredentialRevoked) and p.credential_id in credentials:
        old = credentials[p.credential_id]
        if old.revoked_at is None:
            credentials = dict(credentials)
            credentials[p.credential_id] = msgspec.structs.replace(
                old, revoked_at=at, revoked_reason=p.reason, position=event.global_position
            )
    elif isinstance(p, WorkLeaseAcquired | WorkLeaseReleased):
        # Leases that expired by this event's time are dropped, so the state stays bounded.
        leases = {k: v for k, v in leases.items() if v.active_at(at)}
        if isinstance(p, WorkLeaseAcquired):
            leases[p.lease_id] = LeaseState(
                lease_id=p.lease_id,
                owner=p.owner,
                reason=p.reason,
                acquired_at=at,
                position=event.global_position,
                expires_at=p.expires_at,
                actor=event.metadata.actor,
            )
        else:
            leases.pop(p.lease_id, None)
    elif isinstance(p, NodeDecommissioned):
        # The tombstone: the node stays (status `decommissioned`, its facts and history), but
        # nothing of its current truth does: no live telemetry, no storage figures, no schedulable
        # accelerator, no usable credential (revoked by their own events just before this one; any
        # left is revoked here), no lease.
        credentials = {
            k: c
            if c.revoked_at is not None
            else msgspec.structs.replace(
                c, revoked_at=at, revoked_reason="node decommissioned", position=event.global_position
            )
            for k, c in credentials.items()
        }
        leases = {}
        samples = state.accelerator_telemetry
        updates = {
            "status": "decommissioned",
            "decommissioned_at": p.decommissioned_at,
            "accelerators": {
                u: msgspec.structs.replace(
                    a,
                    status="decommissioned",
                    last_seen_at=samples[u].received_at if u in samples else a.last_seen_at,
                    position=event.global_position,
                )
                for u, a in state.accelerators.items()
            },
            "host_telemetry": None,
            "accelerator_telemetry": {},
            "storage": [],
        }
    return msgspec.structs.replace(
        state,
        stream_version=event.stream_version,
        lifecycle_version=state.lifecycle_version + (1 if event.event_class == "lifecycle" else 0),
        position=event.global_position,
        credentials=credentials,
        leases=leases,
        **updates,
    )


def _host_sample(
    s: NodeState, telemetry: dict[str, Fact], storage: list[StorageObservation], event: RecordedEvent
) -> NodeState:
    # Telemetry alone does not clear a failed run: the next refresh does. The metrics and mounts
    # are the event's own dict and list, not copies: folded states and events are values that
    # nothing changes in place.
    at = event.metadata.received_at
    return msgspec.structs.replace(
        s,
        host_telemetry=Telemetry(
            metrics=telemetry,
            observed_at=event.metadata.observed_at,
            received_at=at,
            position=event.global_position,
        ),
        storage=storage,
        last_seen_at=at if s.discovered else s.last_seen_at,
    )


def _accelerator_samples(
    s: NodeState,
    samples: Iterable[tuple[str, dict[str, Fact], AcceleratorHealthSignals | None]],
    event: RecordedEvent,
    metrics: bool,
) -> NodeState:
    """Each active GPU's sample `(uuid, telemetry, health)` of one event, in one new state (its
    metrics left out unless `metrics`). A GPU the event does not sample keeps its latest."""
    accelerators = s.accelerators
    observed_at, received_at = event.metadata.observed_at, event.metadata.received_at
    latest: dict[str, Telemetry] | None = None
    # The samples without metrics (left out) and without health signals are one value: one object.
    bare: Telemetry | None = None
    for gpu_uuid, telemetry, health in samples:
        acc = accelerators.get(gpu_uuid)
        if acc is None or acc.status != "active":
            continue
        if latest is None:
            latest = dict(s.accelerator_telemetry)
        # `last_seen_at` stays as the lifecycle left it; readers take the later of it and the
        # telemetry's receive time, so a report does not rewrite the accelerator row.
        if health is None and not metrics:
            if bare is None:
                bare = Telemetry({}, observed_at, received_at, event.global_position)
            latest[gpu_uuid] = bare
        else:
            latest[gpu_uuid] = Telemetry(
                telemetry if metrics else {}, observed_at, received_at, event.global_position, health
            )
    return s if latest is None else msgspec.structs.replace(s, accelerator_telemetry=latest)


def _without_sample(s: NodeState, gpu_uuid: str) -> dict[str, Telemetry]:
    if gpu_uuid not in s.accelerator_telemetry:
        return s.accelerator_telemetry
    return {u: t for u, t in s.accelerator_telemetry.items() if u != gpu_uuid}


def evolve(state: NodeState, event: RecordedEvent, *, gpu_metrics: bool = True) -> NodeState:
    """Fold one event of the node's stream into its state. Pure. Without `gpu_metrics`, a GPU's
    sample keeps its times, position and health signals, not its metrics: the form a checkpoint
    stores (projections/inventory.py `persisted`), as the event at that position holds them."""
    p = event.payload
    if isinstance(p, _ADMINISTRATIVE):
        return _administrative(state, event)
    at = event.metadata.received_at
    s = _seen(state, event)
    match p:
        # A node's telemetry snapshot first: nearly every event of a node's stream is one.
        case NodeTelemetryObserved():
            s = _host_sample(s, p.telemetry, p.storage, event)
            s = _accelerator_samples(
                s, [(a.uuid, a.telemetry, a.health) for a in p.accelerators], event, gpu_metrics
            )
        case NodeDiscovered():
            s = msgspec.structs.replace(
                s,
                discovered=True,
                identity_key=p.identity_key,
                identity_source=p.identity_source,
                hostname=p.hostname,
                display_name=s.display_name or p.hostname,
                os=p.os,
                cpu=p.cpu,
                memory_total_bytes=p.memory_total_bytes,
                driver_version=p.driver_version,
                cuda_driver_version=p.cuda_driver_version,
                first_seen_at=s.first_seen_at or at,
                last_seen_at=at,
            )
        case NodeMetadataChanged():
            updates: dict[str, object] = {}
            for field, change in p.changes.items():
                if field in ("hostname", "display_name"):
                    updates[field] = change.after
            s = msgspec.structs.replace(s, **updates)
        case AcceleratorDiscovered():
            previous = s.accelerators.get(p.uuid)
            acc = AcceleratorState(
                accelerator_id=p.accelerator_id,
                uuid=p.uuid,
                status="active",
                index=p.index,
                name=p.name,
                pci_bus_id=p.pci_bus_id,
                memory_total_bytes=p.memory_total_bytes,
                compute_capability=p.compute_capability,
                mig_mode=p.mig_mode,
                driver_version=p.driver_version,
                cuda_driver_version=p.cuda_driver_version,
                first_seen_at=previous.first_seen_at if previous else at,
                last_seen_at=at,
                position=event.global_position,
                # A (re)discovered GPU is judged afresh by the same refresh; its XIDs still count.
                health=HEALTHY,
                xids=previous.xids if previous else [],
                xid_versions=previous.xid_versions if previous else [],
            )
            s = msgspec.structs.replace(
                s,
                accelerators={**s.accelerators, p.uuid: acc},
                accelerator_telemetry=_without_sample(s, p.uuid),
            )
        case AcceleratorMissing():
            acc0 = s.accelerators.get(p.uuid)
            if acc0 is not None:
                # A missing GPU keeps its facts and history but no longer claims live telemetry.
                sample = s.accelerator_telemetry.get(p.uuid)
                acc = msgspec.structs.replace(
                    acc0,
                    status="missing",
                    missing_since=at,
                    position=event.global_position,
                    # last seen: the last telemetry it sent before it went missing
                    last_seen_at=sample.received_at if sample else acc0.last_seen_at,
                )
                s = msgspec.structs.replace(
                    s,
                    accelerators={**s.accelerators, p.uuid: acc},
                    accelerator_telemetry=_without_sample(s, p.uuid),
                )
        case HardwareChanged():
            if p.subject == "node":
                node_updates: dict[str, object] = {}
                for field, change in p.changes.items():
                    if field in _NODE_FACTS:
                        node_updates[field] = change.after
                    elif field.startswith("os.") or field.startswith("cpu."):
                        group, _, name = field.partition(".")
                        current: OsInfo | CpuInfo = node_updates.get(group) or getattr(s, group)  # type: ignore[assignment]
                        node_updates[group] = msgspec.structs.replace(current, **{name: change.after})
                s = msgspec.structs.replace(s, **node_updates)
            elif p.accelerator_uuid is not None and p.accelerator_uuid in s.accelerators:
                acc0 = s.accelerators[p.accelerator_uuid]
                acc_updates = {f: c.after for f, c in p.changes.items() if f in _ACCELERATOR_FACTS}
                acc = msgspec.structs.replace(
                    acc0,
                    position=event.global_position,
                    **acc_updates,
                )
                s = msgspec.structs.replace(s, accelerators={**s.accelerators, acc.uuid: acc})
        case AcceleratorHealthChanged():
            acc0 = s.accelerators.get(p.uuid)
            if acc0 is not None:
                verdict = HealthVerdict(status=p.after, action=p.action, reasons=list(p.reasons))
                acc = msgspec.structs.replace(acc0, health=verdict, position=event.global_position)
                s = msgspec.structs.replace(s, accelerators={**s.accelerators, p.uuid: acc})
        case AcceleratorXidObserved():
            acc0 = s.accelerators.get(p.uuid)
            if acc0 is not None:
                xids, versions = _remember_xid(
                    acc0, XidOccurrence(code=p.code, at=p.at), event.stream_version
                )
                acc = msgspec.structs.replace(acc0, xids=xids, xid_versions=versions)
                s = msgspec.structs.replace(s, accelerators={**s.accelerators, p.uuid: acc})
        case InventoryStatusChanged():
            s = msgspec.structs.replace(
                s,
                inventory_status=p.status,
                inventory_reasons=list(p.reasons),
                nvml_status=p.nvml_status,
                accelerator_capability=p.accelerator_capability,
                last_run=LastRun(
                    outcome="succeeded",
                    status=p.status,
                    reasons=list(p.reasons),
                    nvml_status=p.nvml_status,
                    at=at,
                    position=event.global_position,
                ),
            )
        case InventoryFailed():
            s = msgspec.structs.replace(
                s,
                inventory_status="failed",
                inventory_reasons=[f"{p.stage}: {p.reason}"],
                last_run=LastRun(
                    outcome="failed",
                    status="failed",
                    reasons=[f"{p.stage}: {p.reason}"],
                    nvml_status=s.nvml_status,
                    at=at,
                    position=event.global_position,
                ),
            )
        case HostTelemetryObserved():
            s = _host_sample(s, p.telemetry, p.storage, event)
        case AcceleratorTelemetryObserved():
            s = _accelerator_samples(s, [(p.uuid, p.telemetry, p.health)], event, gpu_metrics)
        case _:
            pass  # events of other concerns (credentials, leases) do not change inventory.
    if isinstance(p, _FINGERPRINT_INPUTS):
        fp = fingerprint_of(s)
        if fp != s.fingerprint:
            s = msgspec.structs.replace(s, fingerprint=fp, fingerprint_position=event.global_position)
    return s
