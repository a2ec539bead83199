"""The hardware inventory read models: compute nodes, accelerators, node storage, latest host and
accelerator telemetry, fingerprints, inventory runs and work leases, all from one fold of the node's
stream (`domain.node.evolve`)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import msgspec

from collectors.facts import Fact, Known
from collectors.observations import StorageObservation
from domain.node import NodeState, Telemetry, evolve
from ledger.events import (
    RecordedEvent,
    is_decommission_audit_stream,
    is_enrollment_token_stream,
    is_health_policy_stream,
    is_webhook_stream,
)
from projections.agent import CREDENTIALS, ENROLLMENT_TOKEN_PROJECTION, agent_rows
from projections.framework import Projection, Row, Rows, TableSpec

NODES = TableSpec(
    name="hw_nodes",
    columns=(
        "node_id",
        "identity_key",
        "identity_source",
        "hostname",
        "display_name",
        "status",
        "inventory_status",
        "inventory_reasons",
        "accelerator_capability",
        "fingerprint",
        "fingerprint_position",
        "os",
        "cpu",
        "memory_total_bytes",
        "driver_version",
        "cuda_driver_version",
        "source",
        "first_seen_at",
        "decommissioned_at",
        "lifecycle_version",
        "final_received_at",
    ),
    key=("node_id",),
)
ACCELERATORS = TableSpec(
    name="hw_accelerators",
    columns=(
        "accelerator_id",
        "node_id",
        "uuid",
        "status",
        "device_index",
        "pci_bus_id",
        "name",
        "memory_total_bytes",
        "compute_capability",
        "mig_mode",
        "driver_version",
        "cuda_driver_version",
        "first_seen_at",
        "last_seen_at",
        "missing_since",
        "position",
        "health_status",
        "health_action",
        "health_reasons",
        "health_xids",
    ),
    key=("accelerator_id",),
)
NODE_STORAGE = TableSpec(
    name="hw_node_storage",
    columns=("node_id", "mount", "used_bytes", "total_bytes"),
    key=("node_id", "mount"),
)
HOST_TELEMETRY = TableSpec(
    name="hw_host_telemetry",
    columns=("node_id", "metrics", "observed_at", "received_at", "clock_skew_seconds", "position"),
    key=("node_id",),
)
ACCELERATOR_TELEMETRY = TableSpec(
    name="hw_accelerator_telemetry",
    # The sample (metrics, health signals) stays in the event at `position` (schema.sql).
    columns=("accelerator_id", "node_id", "observed_at", "received_at", "position"),
    key=("accelerator_id",),
)
FINGERPRINTS = TableSpec(
    name="hw_fingerprints",
    columns=("node_id", "fingerprint", "position"),
    key=("node_id",),
)
INVENTORY_RUNS = TableSpec(
    name="hw_inventory_runs",
    columns=("node_id", "outcome", "status", "reasons", "nvml_status", "at", "position"),
    key=("node_id",),
)

# Unreleased work leases (docs/NODE_DECOMMISSION.md); whether one is still active (not expired) is
# judged when read, by the reader's clock.
WORK_LEASES = TableSpec(
    name="hw_work_leases",
    columns=("lease_id", "node_id", "owner", "reason", "acquired_at", "expires_at", "actor", "position"),
    key=("lease_id",),
)


class HostSampleRef(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """The node's latest host sample in a checkpoint: its times and position (its metrics last)."""

    observed_at: datetime | None
    received_at: datetime
    position: int


# Of a GPU in a checkpoint's first part: its sample is the node's latest snapshot (the host
# sample's times and position, no metrics kept, no health signals).
_HOST_SAMPLE = 0


_SCALARS = (bool, int, float, str)


def _packed(fact: Fact) -> Any:
    """A fact in a checkpoint's first part: a known scalar as itself, any other as its tagged map
    (a steady report's metrics and mounts are known numbers: a third of their maps' bytes)."""
    if type(fact) is Known and type(fact.value) in _SCALARS:
        return fact.value
    return msgspec.to_builtins(fact)


def _unpacked(value: Any) -> Fact:
    if type(value) is dict:
        fact: Fact = msgspec.convert(value, Fact)
        return fact
    return Known(value)


class NodeVolatile(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """What a steady report changes in a node's folded state: the first part of its checkpoint
    (`Projection.split`), the rest of the state after it unchanged. Most often changed first:
    what stays the same (the host's metrics, the mounts) then joins the unchanged rest."""

    stream_version: int
    position: int
    last_received_at: datetime | None
    last_observed_at: datetime | None
    clock_skew_seconds: float | None
    last_seen_at: datetime | None
    host: HostSampleRef | None
    # One per accelerator of the rest, in its order: None (no sample), `_HOST_SAMPLE`, or its own.
    accelerators: list[int | Telemetry | None]
    # The host's metrics and the mounts, their facts `_packed`: (name, fact) and (mount, used, total).
    host_metrics: dict[str, Any]
    storage: list[tuple[str, Any, Any]]


def _gpu_sample(t: Telemetry | None, host: Telemetry | None) -> int | Telemetry | None:
    if (
        t is not None
        and host is not None
        and t.position == host.position
        and t.received_at == host.received_at
        and t.observed_at == host.observed_at
        and t.health is None
        and not t.metrics
    ):
        return _HOST_SAMPLE
    return t


def _samples_beside(state: NodeState) -> NodeState:
    """A state decoded from a checkpoint of an inventory version before 8, whose accelerators held
    their latest samples, with each active one's sample beside it (as the fold keeps it)."""
    if all(a.legacy_telemetry is None for a in state.accelerators.values()):
        return state
    samples = dict(state.accelerator_telemetry)
    for u, a in state.accelerators.items():
        if a.legacy_telemetry is not None and a.status == "active":
            samples.setdefault(u, a.legacy_telemetry)
    return msgspec.structs.replace(
        state,
        accelerators={
            u: msgspec.structs.replace(a, legacy_telemetry=None) for u, a in state.accelerators.items()
        },
        accelerator_telemetry=samples,
    )


def _gpu_samples(state: NodeState, host: Telemetry | None) -> list[int | Telemetry | None]:
    """`_gpu_sample` of each accelerator's sample, in the accelerators' order: worked out once per
    sample object (a snapshot's GPUs without health signals share theirs, domain.node)."""
    samples = state.accelerator_telemetry
    out: list[int | Telemetry | None] = []
    last: Telemetry | None = None
    answer: int | Telemetry | None = None
    for u in state.accelerators:
        t = samples.get(u)
        if t is not last or not out:
            last, answer = t, _gpu_sample(t, host)
        out.append(answer)
    return out


class InventoryProjection(Projection[NodeState]):
    name = "inventory"
    # 2: GPU health verdicts, recent XIDs and health signals.
    # 3: the recent XIDs on the accelerator row (hw_accelerators.health_xids), for the API and /metrics.
    # 4: a GPU's telemetry row points at the event holding its sample instead of copying it.
    # 5: the node stream versions of the XIDs a GPU remembers (the evidence of its verdicts).
    # 6: only a GPU whose latest sample is not in the node's latest snapshot has a telemetry row.
    # 7: a decommissioned node keeps when its last report was received (hw_nodes.final_received_at).
    # 8: the GPUs' samples kept beside their accelerators in the state (its checkpoint's shape).
    version = 8
    tables = (
        NODES,
        ACCELERATORS,
        NODE_STORAGE,
        HOST_TELEMETRY,
        ACCELERATOR_TELEMETRY,
        FINGERPRINTS,
        INVENTORY_RUNS,
        CREDENTIALS,
        WORK_LEASES,
    )
    state_type = NodeState

    def handles(self, stream_id: str) -> bool:
        # Token streams: projections.agent. Refused-revival audit streams, the health policy
        # stream and the webhook subscriptions' stream: events only, no read model.
        return not (
            is_enrollment_token_stream(stream_id)
            or is_decommission_audit_stream(stream_id)
            or is_health_policy_stream(stream_id)
            or is_webhook_stream(stream_id)
        )

    def initial(self, stream_id: str) -> NodeState:
        return NodeState(node_id=stream_id)

    def fold(self, state: NodeState, event: RecordedEvent) -> NodeState:
        # Folded as `persisted` keeps it: a report's GPU metrics are not copied into the state
        # only to be left out of its checkpoint again.
        return evolve(state, event, gpu_metrics=False)

    def fold_whole(self, state: NodeState, event: RecordedEvent) -> NodeState:
        """`fold` with each GPU's metrics in its sample (what an as-of read shows)."""
        return evolve(state, event)

    def persisted(self, state: NodeState) -> NodeState:
        # GPU telemetry metrics are most of a node's state and change with every report: the
        # checkpoint keeps each sample's times and position only (the decisions read no metric);
        # the event at that position holds the metrics. A telemetry row is built from the
        # sample's times and position alone, so the slim row equals the whole one.
        samples = state.accelerator_telemetry
        if not any(t.metrics for t in samples.values()):
            return state
        return msgspec.structs.replace(
            state,
            accelerator_telemetry={
                u: msgspec.structs.replace(t, metrics={}) if t.metrics else t for u, t in samples.items()
            },
        )

    def checkpoint_of(self, state: NodeState) -> tuple[int, int]:
        return state.stream_version, state.position

    volatile_type = NodeVolatile

    def split(self, state: NodeState) -> tuple[NodeVolatile, NodeState]:
        host = state.host_telemetry
        volatile = NodeVolatile(
            stream_version=state.stream_version,
            position=state.position,
            last_received_at=state.last_received_at,
            last_observed_at=state.last_observed_at,
            clock_skew_seconds=state.clock_skew_seconds,
            last_seen_at=state.last_seen_at,
            host=None if host is None else HostSampleRef(host.observed_at, host.received_at, host.position),
            accelerators=_gpu_samples(state, host),
            host_metrics={} if host is None else {k: _packed(f) for k, f in host.metrics.items()},
            storage=[(m.mount, _packed(m.used_bytes), _packed(m.total_bytes)) for m in state.storage],
        )
        rest = msgspec.structs.replace(
            state,
            stream_version=0,
            position=0,
            last_received_at=None,
            last_observed_at=None,
            clock_skew_seconds=None,
            last_seen_at=None,
            host_telemetry=None,
            accelerator_telemetry={},
            storage=[],
        )
        return volatile, rest

    def decode_state(self, raw: str | bytes) -> NodeState:
        return _samples_beside(super().decode_state(raw))

    def joined(self, volatile: NodeVolatile, rest: NodeState) -> NodeState:
        v = volatile
        if len(v.accelerators) != len(rest.accelerators):
            raise ValueError("a checkpoint's samples do not match its accelerators")
        host = (
            None
            if v.host is None
            else Telemetry(
                metrics={k: _unpacked(f) for k, f in v.host_metrics.items()},
                observed_at=v.host.observed_at,
                received_at=v.host.received_at,
                position=v.host.position,
            )
        )
        samples: dict[str, Telemetry] = {}
        bare: Telemetry | None = None  # the host sample's, one object as the fold makes it
        for u, t in zip(rest.accelerators, v.accelerators, strict=True):
            if isinstance(t, int):
                if host is None:
                    raise ValueError("a checkpoint's GPU sample names a host sample it lacks")
                if bare is None:
                    bare = Telemetry({}, host.observed_at, host.received_at, host.position)
                t = bare
            if t is not None:
                samples[u] = t
        return msgspec.structs.replace(
            rest,
            stream_version=v.stream_version,
            position=v.position,
            last_received_at=v.last_received_at,
            last_observed_at=v.last_observed_at,
            clock_skew_seconds=v.clock_skew_seconds,
            last_seen_at=v.last_seen_at,
            host_telemetry=host,
            storage=[StorageObservation(m, _unpacked(u), _unpacked(t)) for m, u, t in v.storage],
            accelerator_telemetry=samples,
        )

    def rows_after(self, before: NodeState, before_rows: Rows, after: NodeState) -> Rows:
        # The accelerator rows are of the node's id and its accelerators alone: where the fold
        # left the accelerators the very dict they were (a steady report), so are their rows.
        same = (
            before.accelerators is after.accelerators
            and before.node_id == after.node_id
            and before.discovered
            and after.discovered
        )
        return self._rows(after, before_rows.get(ACCELERATORS.name) if same else None)

    def rows(self, state: NodeState) -> Rows:
        return self._rows(state, None)

    def _rows(self, state: NodeState, accelerator_rows: Sequence[Row] | None) -> Rows:
        s = state
        out: dict[str, Sequence[Row]] = agent_rows(s)  # credentials exist before the first report
        if s.leases:
            out["hw_work_leases"] = [
                (x.lease_id, s.node_id, x.owner, x.reason, x.acquired_at, x.expires_at, x.actor, x.position)
                for x in s.leases.values()
            ]
        if s.last_run is not None:
            r = s.last_run
            out["hw_inventory_runs"] = [
                (s.node_id, r.outcome, r.status, r.reasons, r.nvml_status, r.at, r.position)
            ]
        if not s.discovered:
            return out
        out["hw_nodes"] = [
            (
                s.node_id,
                s.identity_key,
                s.identity_source,
                s.hostname,
                s.display_name,
                s.status,
                s.inventory_status,
                s.inventory_reasons,
                s.accelerator_capability,
                s.fingerprint,
                s.fingerprint_position,
                s.os,
                s.cpu,
                s.memory_total_bytes,
                s.driver_version,
                s.cuda_driver_version,
                s.source,
                s.first_seen_at,
                s.decommissioned_at,
                s.lifecycle_version,
                s.last_received_at if s.status == "decommissioned" else None,
            )
        ]
        out["hw_accelerators"] = (
            accelerator_rows
            if accelerator_rows is not None
            else [
                (
                    a.accelerator_id,
                    s.node_id,
                    a.uuid,
                    a.status,
                    a.index,
                    a.pci_bus_id,
                    a.name,
                    a.memory_total_bytes,
                    a.compute_capability,
                    a.mig_mode,
                    a.driver_version,
                    a.cuda_driver_version,
                    a.first_seen_at,
                    a.last_seen_at,
                    a.missing_since,
                    a.position,
                    a.health.status,
                    a.health.action,
                    a.health.reasons,
                    a.xids,
                )
                for a in s.accelerators.values()
            ]
        )
        # Rows that change with every report are kept to the telemetry tables, so a steady report
        # rewrites two tables (plus the folded state) and never the inventory rows.
        out["hw_node_storage"] = [(s.node_id, m.mount, m.used_bytes, m.total_bytes) for m in s.storage]
        if s.host_telemetry is not None:
            t = s.host_telemetry
            out["hw_host_telemetry"] = [
                (s.node_id, t.metrics, t.observed_at, t.received_at, s.clock_skew_seconds, t.position)
            ]
        # A GPU sampled by the node's latest snapshot has its sample there: readers take the host's
        # row (its times and position) for it. Only a GPU whose latest sample is older (left out
        # of the latest scan, missing, or sampled by an event of its own in an older log) has a
        # row, so a steady report rewrites none of these.
        latest = s.host_telemetry.position if s.host_telemetry is not None else None
        samples = s.accelerator_telemetry
        out["hw_accelerator_telemetry"] = [
            (a.accelerator_id, s.node_id, g.observed_at, g.received_at, g.position)
            for u, a in s.accelerators.items()
            if (g := samples.get(u)) is not None and g.position != latest
        ]
        if s.fingerprint is not None and s.fingerprint_position is not None:
            out["hw_fingerprints"] = [(s.node_id, s.fingerprint, s.fingerprint_position)]
        return out


INVENTORY = InventoryProjection()
ALL_PROJECTIONS: tuple[Projection[Any], ...] = (INVENTORY, ENROLLMENT_TOKEN_PROJECTION)
