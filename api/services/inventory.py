"""HardwareInventoryService: runs one refresh (local collectors) or one report (an agent's
observation) as one unit of work on the node's stream (`ledger.unit_of_work`).

Routes and the CLI call this; it never lets them touch NVML or SQL. Local refreshes and agent
reports take the same decision (`reconcile_in`: the pure `reconcile` on the unit's state), so
there is one code path for both.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Literal

import asyncpg
import msgspec
import structlog

from api.services.errors import NodeIsDecommissioned
from api.services.health_policy import HealthPolicies
from collectors.collector import HostCollector, NvmlCollector, observe
from collectors.identity import NodeIdentity
from collectors.observations import HardwareObservation, HostCollectionError
from domain.health_policy import DEFAULT_POLICY, HealthPolicy
from domain.node import NodeState, node_id_for
from domain.reconcile import reconcile
from ledger.events import (
    EventMetadata,
    InventoryFailed,
    NewEvent,
    NodeRevivalRefused,
    RecordedEvent,
    Source,
    decommission_audit_stream,
)
from ledger.store import EventStore, StreamTombstoned, StreamVersionConflict, deterministic_event_id
from ledger.unit_of_work import Committed, OpenStream, UnitOfWork
from projections.inventory import INVENTORY

log = structlog.get_logger(__name__)
_ROOT_LOGGER = logging.getLogger()


class EventSummary(msgspec.Struct, frozen=True):
    global_position: int
    stream_version: int
    event_type: str
    event_class: str


class RefreshOutcome(msgspec.Struct, frozen=True):
    """What one refresh or report did."""

    node_id: str
    outcome: Literal["succeeded", "failed"]
    inventory_status: str
    reasons: list[str]
    events: list[EventSummary]
    duration_seconds: float
    nvml_status: str | None = None


class IngestCounters:
    """This process's ingest counters, exported on /metrics."""

    def __init__(self) -> None:
        self.refreshes = 0
        self.failures = 0
        self.events = 0


def _summaries(events: Sequence[RecordedEvent]) -> list[EventSummary]:
    return [EventSummary(e.global_position, e.stream_version, e.event_type, e.event_class) for e in events]


@asynccontextmanager
async def open_node(
    nodes: UnitOfWork[NodeState], node_id: str, *, conn: asyncpg.Connection | None = None
) -> AsyncIterator[OpenStream[NodeState]]:
    """The node's stream as a unit of work; a tombstone (found at the lock, or refused by
    `mf_append`) becomes the one domain error `NodeIsDecommissioned`."""
    try:
        async with nodes.open(node_id, conn=conn) as stream:
            yield stream
    except StreamTombstoned as exc:
        raise NodeIsDecommissioned(node_id, exc.tombstoned_at) from None


def reconcile_decision(
    identity: NodeIdentity,
    observation: HardwareObservation,
    metadata: EventMetadata,
    policy: HealthPolicy = DEFAULT_POLICY,
) -> Callable[[NodeState], list[NewEvent]]:
    """The pure decision of a refresh or a report: the reconciler's events, with their metadata;
    GPU verdicts by `policy`, the health policy in force."""

    def decide(state: NodeState) -> list[NewEvent]:
        return [
            NewEvent(payload=p, metadata=metadata) for p in reconcile(observation, state, identity, policy)
        ]

    return decide


class HardwareInventoryService:
    def __init__(
        self,
        store: EventStore,
        *,
        identity: NodeIdentity | None = None,
        host_collector: HostCollector | None = None,
        nvml_collector: NvmlCollector | None = None,
    ) -> None:
        self.store = store
        self.nodes: UnitOfWork[NodeState] = UnitOfWork(store, INVENTORY)
        self.identity = identity
        self.host_collector = host_collector
        self.nvml_collector = nvml_collector
        # The seed: refresh is process-serialized. The stream lock serializes across processes.
        self._refresh_lock = asyncio.Lock()
        self.counters = IngestCounters()
        # The GPU health policy in force, for every decision of this process.
        self.health_policies = HealthPolicies(store)

    @property
    def pool(self) -> asyncpg.Pool:
        return self.store.pool

    @property
    def local_refresh_enabled(self) -> bool:
        return not (self.identity is None or self.host_collector is None or self.nvml_collector is None)

    async def refresh(self) -> RefreshOutcome:
        """Observe this host with the local collectors and reconcile it into the ledger."""
        if self.identity is None or self.host_collector is None or self.nvml_collector is None:
            raise RuntimeError("this server has no local collectors configured")
        async with self._refresh_lock:
            started = time.perf_counter()
            received_at = datetime.now(UTC)
            node_id = node_id_for(self.identity.key)
            try:
                try:
                    observation = await observe(self.host_collector, self.nvml_collector, received_at)
                except HostCollectionError as exc:
                    return await self.record_failure(
                        node_id, "host", str(exc), received_at, source="local", started=started
                    )
                metadata = EventMetadata(received_at=received_at, source="local", observed_at=received_at)
                return await self.reconcile_observation(self.identity, observation, metadata, started=started)
            except NodeIsDecommissioned as exc:
                await self.record_revival_refused(node_id, "local_refresh", "local-refresh", exc.detail)
                raise

    async def reconcile_observation(
        self,
        identity: NodeIdentity,
        observation: HardwareObservation,
        metadata: EventMetadata,
        *,
        started: float | None = None,
    ) -> RefreshOutcome:
        """Reconcile one observation of a node in a unit of work of its own. A failure inside
        records INVENTORY_FAILED in a separate transaction and returns that outcome."""
        t0 = started if started is not None else time.perf_counter()
        node_id = node_id_for(identity.key)
        await self.health_policies.fresh()
        try:
            async with open_node(self.nodes, node_id) as stream:
                committed = await self.reconcile_in(stream, identity, observation, metadata)
        except StreamVersionConflict:
            raise  # cannot happen under the stream lock; surfaced rather than hidden
        except (asyncpg.PostgresError, OSError, ValueError) as exc:
            log.error("refresh.failed", node_id=node_id, error=str(exc))
            return await self.record_failure(
                node_id, "reconcile", str(exc), metadata.received_at, source=metadata.source, started=t0
            )
        state = committed.state
        return RefreshOutcome(
            node_id=node_id,
            outcome="succeeded",
            inventory_status=state.inventory_status,
            reasons=list(state.inventory_reasons),
            events=_summaries(committed.events),
            duration_seconds=time.perf_counter() - t0,
            nvml_status=observation.nvml.status,
        )

    async def reconcile_in(
        self,
        stream: OpenStream[NodeState],
        identity: NodeIdentity,
        observation: HardwareObservation,
        metadata: EventMetadata,
    ) -> Committed[NodeState]:
        """Reconcile an observation inside an open unit of work (a refresh's own, or an agent
        report's, which also checks and advances its sequence under the same lock)."""
        policy = self.health_policies.current
        committed = await stream.decide(reconcile_decision(identity, observation, metadata, policy))
        self.reconciled(stream.stream_id, committed, metadata.source)
        return committed

    def reconciled(self, node_id: str, committed: Committed[NodeState], source: str) -> None:
        """Count and log one reconciled refresh or report (a group commit appends several)."""
        self.counters.refreshes += 1
        self.counters.events += len(committed.events)
        lifecycle = [e.event_type for e in committed.events if e.event_class == "lifecycle"]
        # Telemetry-only runs are the steady state of a fleet: debug, not a log line per report.
        # Asked first of the level the logs were configured at (runtime/logs.py sets the standard
        # library's root to it too): structlog's proxy binds a logger on every call, even to drop it.
        if lifecycle or _ROOT_LOGGER.isEnabledFor(logging.DEBUG):
            (log.info if lifecycle else log.debug)(
                "inventory.reconciled",
                node_id=node_id,
                source=source,
                lifecycle_events=lifecycle,
                status=committed.state.inventory_status,
            )

    async def record_revival_refused(
        self,
        node_id: str,
        attempt: Literal["local_refresh", "agent_report", "enrollment"],
        actor: str,
        detail: str,
    ) -> None:
        """Audit a refused attempt to bring a decommissioned node back (docs/NODE_DECOMMISSION.md):
        NODE_REVIVAL_REFUSED in the stream `decommission-audit-<node id>` (the node's own stream
        takes no event after its tombstone). At most one per node, attempt and actor per hour (the
        event id is derived from them, so a repeat is an idempotent no-op); every attempt is logged.
        Best effort: a failure to record is logged and never changes the refusal."""
        now = datetime.now(UTC)
        log.warning("node.revival_refused", node_id=node_id, attempt=attempt, actor=actor)
        hour = now.strftime("%Y-%m-%dT%H")
        event = NewEvent(
            payload=NodeRevivalRefused(node_id=node_id, attempt=attempt, detail=detail[:500]),
            metadata=EventMetadata(received_at=now, source="system", actor=actor),
            event_id=deterministic_event_id("node-revival-refused", node_id, attempt, actor, hour),
        )
        try:
            await self.store.append(decommission_audit_stream(node_id), None, [event])
        except (asyncpg.PostgresError, OSError) as exc:
            log.error("node.revival_refused_not_recorded", node_id=node_id, error=str(exc))

    async def record_failure(
        self,
        node_id: str,
        stage: str,
        reason: str,
        received_at: datetime,
        *,
        source: Source,
        started: float,
    ) -> RefreshOutcome:
        """A failed run is persisted (INVENTORY_FAILED, its own transaction) and leaves the last
        good inventory as it was."""
        metadata = EventMetadata(received_at=received_at, source=source)
        async with open_node(self.nodes, node_id) as stream:
            committed = await stream.append(
                [NewEvent(payload=InventoryFailed(stage=stage, reason=reason), metadata=metadata)]
            )
        self.counters.failures += 1
        self.counters.events += len(committed.events)
        log.warning("refresh.failed", node_id=node_id, stage=stage, reason=reason)
        return RefreshOutcome(
            node_id=node_id,
            outcome="failed",
            inventory_status="failed",
            reasons=[f"{stage}: {reason}"],
            events=_summaries(committed.events),
            duration_seconds=time.perf_counter() - started,
        )
