"""What a decommission means given a node's folded state (docs/NODE_DECOMMISSION.md): its
dependencies, what blocks it, the digest a preview binds, whether an execution still matches its
preview, and the events that tombstone the node.

No I/O and no clock: api/services/decommission.py reads the state under the node's stream lock,
passes it and the time in, and turns a refusal into its typed error.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from typing import Any, Literal

import msgspec

from domain.node import NodeState
from ledger.events import CredentialRevoked, EventPayload, NodeDecommissioned

# The reason recorded on every credential the tombstone revokes.
REVOKED_REASON = "decommissioned"

# How many of the changes since a stale preview its refusal names in its detail.
NAMED_CHANGES = 10

LeaseStatus = Literal["active", "expired", "released"]


class LeaseBody(msgspec.Struct, frozen=True):
    lease_id: str
    node_id: str
    owner: str
    reason: str
    status: LeaseStatus
    acquired_at: datetime
    expires_at: datetime | None
    actor: str | None
    released_at: datetime | None = None


class CredentialDependency(msgspec.Struct, frozen=True):
    credential_id: str
    hostname: str
    enrollment_token_id: str
    issued_at: datetime


class AcceleratorDependency(msgspec.Struct, frozen=True):
    accelerator_id: str
    uuid: str
    status: str
    index: Any
    name: Any


class TelemetryDependency(msgspec.Struct, frozen=True):
    """A row of current telemetry that the decommission clears. `received_at` is shown, but not
    bound by the digest: it changes with every report."""

    table: str
    key: str
    accelerator_uuid: str | None = None
    received_at: datetime | None = None


class Dependencies(msgspec.Struct, frozen=True):
    leases: list[LeaseBody]
    credentials: list[CredentialDependency]
    accelerators: list[AcceleratorDependency]
    telemetry: list[TelemetryDependency]


class Blocker(msgspec.Struct, frozen=True):
    kind: Literal["lease"]
    lease_id: str
    owner: str
    reason: str
    expires_at: datetime | None
    detail: str


class PreviewBody(msgspec.Struct, frozen=True):
    node_id: str
    identity_key: str | None
    hostname: str | None
    status: str
    generation: int
    dependencies: Dependencies
    blockers: list[Blocker]
    can_execute: bool
    digest: str
    previewed_at: datetime


class LifecycleChange(msgspec.Struct, frozen=True):
    """A lifecycle event of the node after a preview's generation: what moved it."""

    stream_version: int
    event_type: str
    recorded_at: datetime
    actor: str | None


def lease_status(expires_at: datetime | None, now: datetime) -> LeaseStatus:
    """An unreleased lease's status by the given clock."""
    return "active" if expires_at is None or expires_at > now else "expired"


def _plain(fact: Any) -> Any:
    return getattr(fact, "value", None)


def active_leases(state: NodeState, now: datetime) -> list[LeaseBody]:
    return sorted(
        (
            LeaseBody(
                lease_id=x.lease_id,
                node_id=state.node_id,
                owner=x.owner,
                reason=x.reason,
                status="active",
                acquired_at=x.acquired_at,
                expires_at=x.expires_at,
                actor=x.actor,
            )
            for x in state.leases.values()
            if x.active_at(now)
        ),
        key=lambda b: (b.acquired_at, b.lease_id),
    )


def dependencies_of(state: NodeState, now: datetime) -> Dependencies:
    telemetry: list[TelemetryDependency] = []
    if state.host_telemetry is not None:
        telemetry.append(
            TelemetryDependency("hw_host_telemetry", state.node_id, None, state.host_telemetry.received_at)
        )
    for mount in sorted(m.mount for m in state.storage):
        telemetry.append(TelemetryDependency("hw_node_storage", f"{state.node_id}:{mount}"))
    accelerators = sorted(state.accelerators.values(), key=lambda a: a.uuid)
    for a in accelerators:
        sample = state.accelerator_telemetry.get(a.uuid)
        if sample is not None:
            telemetry.append(
                TelemetryDependency("hw_accelerator_telemetry", a.accelerator_id, a.uuid, sample.received_at)
            )
    return Dependencies(
        leases=active_leases(state, now),
        credentials=[
            CredentialDependency(c.credential_id, c.hostname, c.enrollment_token_id, c.issued_at)
            for c in sorted(state.credentials.values(), key=lambda c: c.credential_id)
            if c.revoked_at is None
        ],
        accelerators=[
            AcceleratorDependency(a.accelerator_id, a.uuid, a.status, _plain(a.index), _plain(a.name))
            for a in accelerators
        ],
        telemetry=telemetry,
    )


def blockers_of(dependencies: Dependencies) -> list[Blocker]:
    out = []
    for x in dependencies.leases:
        until = f", expires {x.expires_at.isoformat()}" if x.expires_at else ""
        out.append(
            Blocker(
                kind="lease",
                lease_id=x.lease_id,
                owner=x.owner,
                reason=x.reason,
                expires_at=x.expires_at,
                detail=f"active work lease {x.lease_id} (owner {x.owner!r}: {x.reason!r}{until})",
            )
        )
    return out


def digest_of(
    node_id: str, status: str, generation: int, dependencies: Dependencies, blockers: list[Blocker]
) -> str:
    """SHA-256 (hex) of the canonical JSON (sorted keys, no whitespace, UTF-8) of what a preview
    binds: the node, its status and generation, every dependency and every blocker, without the
    receive times of telemetry rows (they move with every report; the rows themselves are bound)."""
    deps = msgspec.to_builtins(dependencies)
    for row in deps["telemetry"]:
        row.pop("received_at", None)
    doc = {
        "node_id": node_id,
        "status": status,
        "generation": generation,
        "dependencies": deps,
        "blockers": msgspec.to_builtins(blockers),
    }
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def preview_of(state: NodeState, now: datetime) -> PreviewBody:
    dependencies = dependencies_of(state, now)
    blockers = blockers_of(dependencies)
    return PreviewBody(
        node_id=state.node_id,
        identity_key=state.identity_key,
        hostname=state.hostname,
        status=state.status,
        generation=state.lifecycle_version,
        dependencies=dependencies,
        blockers=blockers,
        can_execute=state.status == "active" and not blockers,
        digest=digest_of(state.node_id, state.status, state.lifecycle_version, dependencies, blockers),
        previewed_at=now,
    )


def preview_is_stale(current: PreviewBody, generation: int, digest: str) -> bool:
    """Whether the node is no longer what a preview of `generation` and `digest` showed: an
    execution proceeds only on the very state its operator confirmed."""
    return current.generation != generation or current.digest != digest


def stale_detail(
    node_id: str, generation: int, digest: str, current: PreviewBody, changes: list[LifecycleChange]
) -> str:
    """Why an execution's preview is stale: the lifecycle events that moved the node (the first
    `NAMED_CHANGES` of `changes`), or the dependencies that changed under the same generation."""
    if current.generation != generation:
        named = ", ".join(f"{c.event_type} (v{c.stream_version})" for c in changes[:NAMED_CHANGES])
        detail = (
            f"node {node_id} changed since the preview: generation {generation} -> "
            f"{current.generation}" + (f" ({named})" if named else "")
        )
    else:
        detail = (
            f"the dependencies of node {node_id} changed since the preview (generation "
            f"{generation} unchanged, digest {digest[:12]}… -> {current.digest[:12]}…)"
        )
    return detail + "; nothing was changed: preview again"


def blocked_detail(node_id: str, blockers: list[Blocker]) -> str:
    names = "; ".join(b.detail for b in blockers)
    return (
        f"node {node_id} has {len(blockers)} active work lease(s): {names}; "
        "release them (or let them expire), then preview again"
    )


def decommission_events(
    current: PreviewBody, generation: int, digest: str, reason: str, actor: str, now: datetime
) -> list[EventPayload]:
    """The one append that ends the node's stream: every active credential revoked, then the
    tombstone, which records the confirmed preview (generation, digest) and the revocations."""
    revoked = [c.credential_id for c in current.dependencies.credentials]
    payloads: list[EventPayload] = [
        CredentialRevoked(credential_id=c, reason=REVOKED_REASON) for c in revoked
    ]
    payloads.append(
        NodeDecommissioned(
            node_id=current.node_id,
            actor=actor,
            reason=reason,
            decommissioned_at=now,
            generation=generation,
            digest=digest,
            revoked_credentials=revoked,
        )
    )
    return payloads
