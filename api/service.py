"""HardwareInventoryService: runs one refresh (local collectors) or one report (an agent's
observation) as one serialized, idempotent unit per node.

Routes and the CLI call this; it never lets them touch NVML or SQL. Local refreshes and agent
reports take the same path (`reconcile_observation`), so there is one code path for both.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Literal, Protocol

import asyncpg
import msgspec
import structlog

from collectors.observations import HardwareObservation, HostCollectionError, HostObservation, NvmlScan
from ledger.events import (
    EventMetadata,
    InventoryFailed,
    NewEvent,
    NodeRevivalRefused,
    RecordedEvent,
    Source,
    decommission_audit_stream,
)
from ledger.node import NodeState, node_id_for
from ledger.reconcile import NodeIdentity, reconcile
from ledger.store import EventStore, StreamTombstoned, StreamVersionConflict, deterministic_event_id
from projections.inventory import INVENTORY

log = structlog.get_logger(__name__)


class HostCollector(Protocol):
    async def collect_async(self) -> HostObservation: ...


class NvmlCollector(Protocol):
    async def collect_async(self) -> NvmlScan: ...


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


class NodeTombstoned(Exception):
    """The node was permanently decommissioned; nothing may revive it."""

    def __init__(self, node_id: str) -> None:
        super().__init__(f"node {node_id} is decommissioned (tombstoned); it cannot report or refresh")
        self.node_id = node_id


def _summaries(events: Sequence[RecordedEvent]) -> list[EventSummary]:
    return [EventSummary(e.global_position, e.stream_version, e.event_type, e.event_class) for e in events]


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
        self.identity = identity
        self.host_collector = host_collector
        self.nvml_collector = nvml_collector
        # The seed: refresh is process-serialized. The stream lock serializes across processes.
        self._refresh_lock = asyncio.Lock()
        self.counters = IngestCounters()

    @property
    def pool(self) -> asyncpg.Pool:
        return self.store.pool

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
                    host, nvml = await asyncio.gather(
                        self.host_collector.collect_async(), self.nvml_collector.collect_async()
                    )
                except HostCollectionError as exc:
                    return await self.record_failure(
                        node_id, "host", str(exc), received_at, source="local", started=started
                    )
                observation = HardwareObservation(observed_at=received_at, host=host, nvml=nvml)
                metadata = EventMetadata(received_at=received_at, source="local", observed_at=received_at)
                return await self.reconcile_observation(self.identity, observation, metadata, started=started)
            except NodeTombstoned as exc:
                await self.record_revival_refused(node_id, "local_refresh", "local-refresh", str(exc))
                raise

    async def reconcile_observation(
        self,
        identity: NodeIdentity,
        observation: HardwareObservation,
        metadata: EventMetadata,
        *,
        started: float | None = None,
        conn: asyncpg.Connection | None = None,
    ) -> RefreshOutcome:
        """Reconcile one observation of a node: lock its stream, fold its state, decide, append.

        With `conn` the work joins the caller's transaction (an agent report also records its
        sequence there); otherwise it runs in its own. A failure inside records INVENTORY_FAILED
        in a separate transaction and re-raises nothing but the outcome.
        """
        t0 = started if started is not None else time.perf_counter()
        node_id = node_id_for(identity.key)
        try:
            if conn is None:
                async with self.pool.acquire() as own, own.transaction():
                    recorded, state = await self._reconcile_locked(
                        own, node_id, identity, observation, metadata
                    )
            else:
                recorded, state = await self._reconcile_locked(conn, node_id, identity, observation, metadata)
        except (StreamTombstoned, NodeTombstoned):
            raise NodeTombstoned(node_id) from None
        except StreamVersionConflict:
            raise  # cannot happen under the stream lock; surfaced rather than hidden
        except (asyncpg.PostgresError, OSError, ValueError) as exc:
            if conn is not None:
                raise
            log.error("refresh.failed", node_id=node_id, error=str(exc))
            return await self.record_failure(
                node_id, "reconcile", str(exc), metadata.received_at, source=metadata.source, started=t0
            )
        self.counters.refreshes += 1
        self.counters.events += len(recorded)
        outcome = RefreshOutcome(
            node_id=node_id,
            outcome="succeeded",
            inventory_status=state.inventory_status,
            reasons=list(state.inventory_reasons),
            events=_summaries(recorded),
            duration_seconds=time.perf_counter() - t0,
            nvml_status=observation.nvml.status,
        )
        lifecycle = [e.event_type for e in recorded if e.event_class == "lifecycle"]
        # Telemetry-only runs are the steady state of a fleet: debug, not a log line per report.
        (log.info if lifecycle else log.debug)(
            "refresh.succeeded", node_id=node_id, lifecycle_events=lifecycle, status=state.inventory_status
        )
        return outcome

    async def _reconcile_locked(
        self,
        conn: asyncpg.Connection,
        node_id: str,
        identity: NodeIdentity,
        observation: HardwareObservation,
        metadata: EventMetadata,
    ) -> tuple[list[RecordedEvent], NodeState]:
        info = await self.store.lock_stream(conn, node_id)
        if info.tombstoned_at is not None:
            raise NodeTombstoned(node_id)
        state = await INVENTORY.load_state(conn, node_id)
        payloads = reconcile(observation, state, identity)
        events = [NewEvent(payload=p, metadata=metadata) for p in payloads]
        result = await self.store.append(
            node_id, info.version, events, conn=conn, locked=True, prior_states={INVENTORY.name: state}
        )
        return result.events, INVENTORY.fold_all(state, result.events)

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
        async with self.pool.acquire() as conn, conn.transaction():
            info = await self.store.lock_stream(conn, node_id)
            if info.tombstoned_at is not None:
                raise NodeTombstoned(node_id)
            result = await self.store.append(
                node_id,
                info.version,
                [NewEvent(payload=InventoryFailed(stage=stage, reason=reason), metadata=metadata)],
                conn=conn,
                locked=True,
            )
        self.counters.failures += 1
        self.counters.events += len(result.events)
        log.warning("refresh.failed", node_id=node_id, stage=stage, reason=reason)
        return RefreshOutcome(
            node_id=node_id,
            outcome="failed",
            inventory_status="failed",
            reasons=[f"{stage}: {reason}"],
            events=_summaries(result.events),
            duration_seconds=time.perf_counter() - started,
        )
