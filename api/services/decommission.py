"""Work leases and permanent node decommission (docs/NODE_DECOMMISSION.md).

* **Work leases** record work that depends on a node (the plane has no scheduler; other components
  and operators say so explicitly). `WORK_LEASE_ACQUIRED` / `WORK_LEASE_RELEASED` are lifecycle
  events of the node's stream, so they are audited, move the node's generation and are rebuilt
  with it (read model `hw_work_leases`). An active lease (unreleased, not expired) blocks
  decommission.
* **Preview** reads the node's folded state and returns its generation (the number of lifecycle
  events of its stream), its dependencies (active leases, active credentials, accelerators, the
  rows of current telemetry), the blockers, and a digest binding all of that.
* **Execute** takes the node's stream lock, folds its state again and proceeds only if the
  generation and the digest are still the preview's and nothing blocks; then it appends, in one
  append (one transaction): `CREDENTIAL_REVOKED` for every active credential and the terminal
  `NODE_DECOMMISSIONED` tombstone. The inline projection clears the node's current truth in the
  same transaction. The stream takes no event after it (`mf_append`: SQLSTATE MF410).

Nothing here runs SQL on behalf of a route except through this service; the routes
(api/http/decommission.py) and the CLI (api/cli/decommission.py) both call it.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

import asyncpg
import msgspec
import structlog

from api.services.errors import Conflict, InvalidRequest, NodeIsDecommissioned, NotFound
from api.services.inventory import EventSummary, HardwareInventoryService, open_node
from domain.node import NodeState, node_id_for
from ledger.events import (
    CredentialRevoked,
    EventMetadata,
    EventPayload,
    NewEvent,
    NodeDecommissioned,
    WorkLeaseAcquired,
    WorkLeaseReleased,
)
from ledger.store import EventStore
from ledger.unit_of_work import OpenStream
from projections.inventory import INVENTORY

log = structlog.get_logger(__name__)

MAX_LEASE_TTL = timedelta(days=365)
MAX_OWNER = 200
MAX_REASON = 500
REVOKED_REASON = "decommissioned"
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def _invalid(detail: str) -> InvalidRequest:
    return InvalidRequest("invalid-parameter", "Invalid parameter", detail)


def _not_found(node_id: str) -> NotFound:
    return NotFound("node-not-found", "Unknown node", f"no node with id {node_id!r}")


def _gone(node_id: str, at: datetime | None) -> NodeIsDecommissioned:
    detail = f"node {node_id} is decommissioned"
    if at is not None:
        detail += f" (since {at.isoformat()})"
    return NodeIsDecommissioned(node_id, at, detail + "; a decommissioned node can never be used again")


# --- bodies ----------------------------------------------------------------------------------------


# Stated in the types too, so the API's schema says what `_text` enforces: not blank, bounded.
Owner = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_OWNER, pattern=r"\S")]
Reason = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REASON, pattern=r"\S")]


class LeaseRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    owner: Owner
    reason: Reason
    ttl_seconds: Annotated[float, msgspec.Meta(ge=1, le=MAX_LEASE_TTL.total_seconds())] | None = None
    actor: str | None = None


class LeaseReleaseRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    reason: Reason = "released"
    actor: str | None = None


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


class ExecuteRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    generation: Annotated[int, msgspec.Meta(ge=0)]
    # The preview's digest; upper case and surrounding blanks are forgiven by `execute`.
    digest: Annotated[str, msgspec.Meta(pattern=r"\A\s*[0-9a-fA-F]{64}\s*\Z")]
    reason: Reason
    actor: str | None = None


class DecommissionBody(msgspec.Struct, frozen=True):
    node_id: str
    status: Literal["decommissioned"]
    decommissioned_at: datetime
    actor: str
    reason: str
    previewed_generation: int
    generation: int
    digest: str
    revoked_credentials: list[str]
    decommissioned_accelerators: list[str]
    cleared_telemetry: list[TelemetryDependency]
    events: list[EventSummary]


# --- the pure part ---------------------------------------------------------------------------------


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
        if a.telemetry is not None:
            telemetry.append(
                TelemetryDependency(
                    "hw_accelerator_telemetry", a.accelerator_id, a.uuid, a.telemetry.received_at
                )
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


def _text(value: str, what: str, limit: int) -> str:
    text = value.strip()
    if not text:
        raise _invalid(f"{what} is empty")
    if len(text) > limit:
        raise _invalid(f"{what} is longer than {limit} characters")
    return text


def _utcnow() -> datetime:
    return datetime.now(UTC)


# --- the service -----------------------------------------------------------------------------------


class DecommissionService:
    def __init__(
        self, inventory: HardwareInventoryService, *, clock: Callable[[], datetime] = _utcnow
    ) -> None:
        self.inventory = inventory
        self.store: EventStore = inventory.store
        self.clock = clock

    @property
    def pool(self) -> asyncpg.Pool:
        return self.store.pool

    def _meta(self, actor: str, now: datetime) -> EventMetadata:
        return EventMetadata(received_at=now, source="operator", actor=actor)

    async def resolve_node(self, ref: str) -> str:
        """A node id, or the identity key of a node (the CLI accepts both)."""
        async with self.pool.acquire() as conn:
            for candidate in (ref, node_id_for(ref)):
                if await conn.fetchval("SELECT 1 FROM hw_nodes WHERE node_id = $1", candidate):
                    return candidate
        raise _not_found(ref)

    @asynccontextmanager
    async def _node(self, node_id: str) -> AsyncIterator[OpenStream[NodeState]]:
        """The node's stream as a unit of work: gone for a tombstone, 404 for a node that was
        never discovered."""
        try:
            async with open_node(self.inventory.nodes, node_id) as node:
                if node.version == 0 or not node.state.discovered:
                    raise _not_found(node_id)
                yield node
        except NodeIsDecommissioned as exc:
            raise _gone(node_id, exc.decommissioned_at) from None

    # --- leases --------------------------------------------------------------------------------

    async def acquire_lease(
        self,
        node_id: str,
        owner: str,
        reason: str,
        ttl_seconds: float | None = None,
        *,
        actor: str = "operator",
    ) -> LeaseBody:
        owner = _text(owner, "owner", MAX_OWNER)
        reason = _text(reason, "reason", MAX_REASON)
        if ttl_seconds is not None and not 1 <= ttl_seconds <= MAX_LEASE_TTL.total_seconds():
            raise _invalid(f"ttl must be between 1 second and {MAX_LEASE_TTL.days} days")
        lease_id = uuid.uuid4().hex
        async with self._node(node_id) as node:
            now = self.clock()
            expires_at = now + timedelta(seconds=ttl_seconds) if ttl_seconds is not None else None
            event = WorkLeaseAcquired(lease_id=lease_id, owner=owner, reason=reason, expires_at=expires_at)
            await node.append([NewEvent(payload=event, metadata=self._meta(actor, now))])
        log.info("lease.acquired", node_id=node_id, lease_id=lease_id, owner=owner, actor=actor)
        return LeaseBody(
            lease_id=lease_id,
            node_id=node_id,
            owner=owner,
            reason=reason,
            status="active",
            acquired_at=now,
            expires_at=expires_at,
            actor=actor,
        )

    async def release_lease(
        self, node_id: str, lease_id: str, reason: str = "released", *, actor: str = "operator"
    ) -> LeaseBody:
        reason = reason.strip()[:MAX_REASON]
        async with self._node(node_id) as node:
            lease = node.state.leases.get(lease_id)
            if lease is None:
                raise NotFound(
                    "lease-not-found",
                    "Unknown work lease",
                    f"node {node_id} holds no unreleased lease {lease_id!r} (released leases are in "
                    "GET /api/v1/hardware/events?type=WORK_LEASE_RELEASED)",
                )
            now = self.clock()
            await node.append(
                [
                    NewEvent(
                        payload=WorkLeaseReleased(lease_id=lease_id, reason=reason),
                        metadata=self._meta(actor, now),
                    )
                ]
            )
        log.info("lease.released", node_id=node_id, lease_id=lease_id, actor=actor)
        return LeaseBody(
            lease_id=lease.lease_id,
            node_id=node_id,
            owner=lease.owner,
            reason=lease.reason,
            status="released",
            acquired_at=lease.acquired_at,
            expires_at=lease.expires_at,
            actor=lease.actor,
            released_at=now,
        )

    async def list_leases(self, node_id: str) -> list[LeaseBody]:
        """The node's unreleased leases, `active` or `expired` by this server's clock."""
        async with self.pool.acquire() as conn:
            known = await conn.fetchval("SELECT 1 FROM hw_nodes WHERE node_id = $1", node_id)
            if not known:
                raise _not_found(node_id)
            rows = await conn.fetch(
                "SELECT * FROM hw_work_leases WHERE node_id = $1 ORDER BY acquired_at, lease_id", node_id
            )
        now = self.clock()
        return [
            LeaseBody(
                lease_id=r["lease_id"],
                node_id=r["node_id"],
                owner=r["owner"],
                reason=r["reason"],
                status="active" if r["expires_at"] is None or r["expires_at"] > now else "expired",
                acquired_at=r["acquired_at"],
                expires_at=r["expires_at"],
                actor=r["actor"],
            )
            for r in rows
        ]

    # --- decommission --------------------------------------------------------------------------

    async def preview(self, node_id: str) -> PreviewBody:
        async with self.pool.acquire() as conn:
            state = await INVENTORY.load_state(conn, node_id)
        if state.status == "decommissioned":
            raise _gone(node_id, state.decommissioned_at)
        if not state.discovered:
            raise _not_found(node_id)
        return preview_of(state, self.clock())

    async def _changes_since(
        self, conn: asyncpg.Connection, node_id: str, generation: int
    ) -> list[dict[str, Any]]:
        """The node's lifecycle events after its first `generation` ones (what moved it)."""
        rows = await conn.fetch(
            "SELECT stream_version, event_type, recorded_at, metadata->>'actor' AS actor FROM events "
            "WHERE stream_id = $1 AND event_class = 'lifecycle' ORDER BY stream_version OFFSET $2 LIMIT 50",
            node_id,
            max(0, generation),
        )
        return [
            {
                "stream_version": r["stream_version"],
                "event_type": r["event_type"],
                "recorded_at": r["recorded_at"],
                "actor": r["actor"],
            }
            for r in rows
        ]

    async def execute(
        self, node_id: str, generation: int, digest: str, reason: str, *, actor: str = "operator"
    ) -> DecommissionBody:
        """Decommission the node if it is still what the preview showed (generation and digest)
        and nothing blocks. One transaction under the node's stream lock: of two executions of the
        same preview, the second finds the tombstone (410) or a moved generation (409)."""
        reason = _text(reason, "reason", MAX_REASON)
        digest = digest.strip().lower()
        if not _DIGEST.match(digest):
            raise _invalid("digest must be the 64 hex digits of the preview's digest")
        if generation < 0:
            raise _invalid("generation must be a non-negative integer")
        async with self._node(node_id) as node:
            now = self.clock()
            current = preview_of(node.state, now)
            if current.generation != generation or current.digest != digest:
                changes = (
                    await self._changes_since(node.conn, node_id, generation)
                    if generation < current.generation
                    else []
                )
                if current.generation != generation:
                    named = ", ".join(f"{c['event_type']} (v{c['stream_version']})" for c in changes[:10])
                    detail = (
                        f"node {node_id} changed since the preview: generation {generation} -> "
                        f"{current.generation}" + (f" ({named})" if named else "")
                    )
                else:
                    detail = (
                        f"the dependencies of node {node_id} changed since the preview (generation "
                        f"{generation} unchanged, digest {digest[:12]}… -> {current.digest[:12]}…)"
                    )
                raise Conflict(
                    "decommission-preview-stale",
                    "Node changed since the preview",
                    detail + "; nothing was changed: preview again",
                    previewed_generation=generation,
                    current_generation=current.generation,
                    previewed_digest=digest,
                    current_digest=current.digest,
                    changes=changes,
                    blockers=current.blockers,
                )
            if current.blockers:
                names = "; ".join(b.detail for b in current.blockers)
                raise Conflict(
                    "decommission-blocked",
                    "Active work blocks the decommission",
                    f"node {node_id} has {len(current.blockers)} active work lease(s): {names}; "
                    "release them (or let them expire), then preview again",
                    leases=current.dependencies.leases,
                    blockers=current.blockers,
                )
            revoked = [c.credential_id for c in current.dependencies.credentials]
            payloads: list[EventPayload] = [
                CredentialRevoked(credential_id=c, reason=REVOKED_REASON) for c in revoked
            ]
            payloads.append(
                NodeDecommissioned(
                    node_id=node_id,
                    actor=actor,
                    reason=reason,
                    decommissioned_at=now,
                    generation=generation,
                    digest=digest,
                    revoked_credentials=revoked,
                )
            )
            meta = self._meta(actor, now)
            committed = await node.append([NewEvent(payload=p, metadata=meta) for p in payloads])
        log.warning(
            "node.decommissioned",
            node_id=node_id,
            actor=actor,
            reason=reason,
            generation=generation,
            revoked_credentials=len(revoked),
        )
        return DecommissionBody(
            node_id=node_id,
            status="decommissioned",
            decommissioned_at=now,
            actor=actor,
            reason=reason,
            previewed_generation=generation,
            generation=generation + len(committed.events),
            digest=digest,
            revoked_credentials=revoked,
            decommissioned_accelerators=[a.accelerator_id for a in current.dependencies.accelerators],
            cleared_telemetry=current.dependencies.telemetry,
            events=[
                EventSummary(e.global_position, e.stream_version, e.event_type, e.event_class)
                for e in committed.events
            ],
        )
