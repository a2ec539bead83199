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

What these mean given the node's state (dependencies, blockers, the digest, staleness, the events
to append) is decided in domain/decommission.py, without I/O; this service reads and writes.
Nothing here runs SQL on behalf of a route except through this service; the routes
(api/http/decommission.py) and the CLI (api/cli/decommission.py) both call it.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Annotated, Literal

import asyncpg
import msgspec
import structlog

from api.services.clock import central_now
from api.services.errors import Conflict, NodeIsDecommissioned, NotFound, invalid_parameter
from api.services.inventory import EventSummary, HardwareInventoryService, open_node
from domain.decommission import (
    LeaseBody,
    LifecycleChange,
    PreviewBody,
    TelemetryDependency,
    blocked_detail,
    decommission_events,
    lease_status,
    preview_is_stale,
    preview_of,
    stale_detail,
)
from domain.node import NodeState, node_id_for
from ledger.events import EventMetadata, NewEvent, WorkLeaseAcquired, WorkLeaseReleased
from ledger.store import EventStore
from ledger.unit_of_work import OpenStream
from projections.inventory import INVENTORY

log = structlog.get_logger(__name__)

MAX_LEASE_TTL = timedelta(days=365)
MAX_OWNER = 200
MAX_REASON = 500
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


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


def _text(value: str, what: str, limit: int) -> str:
    text = value.strip()
    if not text:
        raise invalid_parameter(f"{what} is empty")
    if len(text) > limit:
        raise invalid_parameter(f"{what} is longer than {limit} characters")
    return text


# --- the service -----------------------------------------------------------------------------------


class DecommissionService:
    def __init__(
        self, inventory: HardwareInventoryService, *, clock: Callable[[], datetime] = central_now
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
            raise invalid_parameter(f"ttl must be between 1 second and {MAX_LEASE_TTL.days} days")
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
                status=lease_status(r["expires_at"], now),
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
    ) -> list[LifecycleChange]:
        """The node's lifecycle events after its first `generation` ones (what moved it)."""
        rows = await conn.fetch(
            "SELECT stream_version, event_type, recorded_at, metadata->>'actor' AS actor FROM events "
            # (every lifecycle event is in the permanent segment: the day segments' telemetry is left out)
            "WHERE stream_id = $1 AND segment = 'infinity' AND event_class = 'lifecycle' "
            "ORDER BY stream_version OFFSET $2 LIMIT 50",
            node_id,
            max(0, generation),
        )
        return [
            LifecycleChange(
                stream_version=r["stream_version"],
                event_type=r["event_type"],
                recorded_at=r["recorded_at"],
                actor=r["actor"],
            )
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
            raise invalid_parameter("digest must be the 64 hex digits of the preview's digest")
        if generation < 0:
            raise invalid_parameter("generation must be a non-negative integer")
        async with self._node(node_id) as node:
            now = self.clock()
            current = preview_of(node.state, now)
            if preview_is_stale(current, generation, digest):
                changes = (
                    await self._changes_since(node.conn, node_id, generation)
                    if generation < current.generation
                    else []
                )
                raise Conflict(
                    "decommission-preview-stale",
                    "Node changed since the preview",
                    stale_detail(node_id, generation, digest, current, changes),
                    previewed_generation=generation,
                    current_generation=current.generation,
                    previewed_digest=digest,
                    current_digest=current.digest,
                    changes=changes,
                    blockers=current.blockers,
                )
            if current.blockers:
                raise Conflict(
                    "decommission-blocked",
                    "Active work blocks the decommission",
                    blocked_detail(node_id, current.blockers),
                    leases=current.dependencies.leases,
                    blockers=current.blockers,
                )
            revoked = [c.credential_id for c in current.dependencies.credentials]
            payloads = decommission_events(current, generation, digest, reason, actor, now)
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
