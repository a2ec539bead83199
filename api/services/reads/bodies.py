"""The read side's bodies (msgspec Structs): the JSON shapes of docs/architecture.md ("HTTP
shapes") that the reads answer with."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

import msgspec

from collectors.facts import Fact
from collectors.gpu_health import XidOccurrence
from ledger.events import EventMetadata, EventPayload, HealthAction, HealthReason, HealthStatus


class OsBody(msgspec.Struct):
    name: str | None
    version: str | None
    kernel: str | None
    architecture: str | None


class CpuBody(msgspec.Struct):
    model: str | None
    sockets: int | None
    physical_cores: int | None
    logical_cores: int | None


class StorageBody(msgspec.Struct):
    mount: str
    used_bytes: Fact
    total_bytes: Fact


class NodeHealthBody(msgspec.Struct):
    """The node's GPUs by verdict (decommissioned GPUs left out) and the worst of them: a node
    without GPUs is `healthy`."""

    status: HealthStatus
    healthy: int
    degraded: int
    failed: int


class NodeBody(msgspec.Struct):
    id: str
    identity_key: str | None
    identity_source: str | None
    hostname: str | None
    display_name: str | None
    status: Literal["active", "decommissioned"]
    liveness: Literal["online", "stale", "offline", "local"]
    inventory_status: Literal["pending", "ok", "degraded", "failed"]
    inventory_reasons: list[str]
    accelerator_capability: str
    fingerprint: str | None
    fingerprint_position: int | None
    os: OsBody
    cpu: CpuBody
    memory_total_bytes: int | None
    driver_version: str | None
    cuda_driver_version: str | None
    storage: list[StorageBody]
    telemetry: dict[str, Fact]
    telemetry_observed_at: datetime | None
    # Every inventory fact with its availability state (the plain fields above carry known values).
    facts: dict[str, Fact]
    source: str | None
    first_seen_at: datetime | None
    last_seen_at: datetime | None
    last_observed_at: datetime | None
    last_received_at: datetime | None
    clock_skew_seconds: float | None
    decommissioned_at: datetime | None
    generation: int
    health: NodeHealthBody
    as_of_position: int | None = None


class HealthSignalsBody(msgspec.Struct):
    """The health signals of the GPU's latest sample (docs/gpu-health.md), each a fact in the
    availability form; the XIDs are in `AcceleratorHealthBody.recent_xids`, not here."""

    clock_event_reasons: dict[str, Fact]
    ecc_mode: Fact
    ecc_errors: dict[str, Fact]
    remapped_rows: dict[str, Fact]
    retired_pages: dict[str, Fact]
    pcie_replay_count: Fact
    xid_events: Fact


class AcceleratorHealthBody(msgspec.Struct):
    status: HealthStatus
    action: HealthAction
    reasons: list[HealthReason]
    # The XIDs the ledger remembers for this GPU (within 24 hours of the newest, at most 64),
    # oldest first; the verdict counts those within 24 hours of its own observation.
    recent_xids: list[XidOccurrence]
    # null when the node's agent sends no health signals (an older agent) or no sample yet.
    signals: HealthSignalsBody | None


class AcceleratorBody(msgspec.Struct):
    id: str
    node_id: str
    uuid: str
    status: Literal["active", "missing", "decommissioned"]
    index: int | None
    pci_bus_id: str | None
    name: str | None
    memory_total_bytes: int | None
    compute_capability: str | None
    mig_mode: Fact
    driver_version: str | None
    cuda_driver_version: str | None
    telemetry: dict[str, Fact]
    telemetry_observed_at: datetime | None
    facts: dict[str, Fact]
    first_seen_at: datetime
    last_seen_at: datetime
    missing_since: datetime | None
    health: AcceleratorHealthBody


# The most items one page of any list holds (the routes' `limit`, and the fast path's parse).
MAX_LIMIT = 1000


class NodePage(msgspec.Struct):
    items: list[NodeBody]
    next_cursor: str | None
    as_of_position: int | None = None


class AcceleratorPage(msgspec.Struct):
    items: list[AcceleratorBody]
    next_cursor: str | None
    as_of_position: int | None = None


class UndecodableBody(msgspec.Struct):
    """An event the catalog no longer accepts (edited in the database, or schema drift), shown as
    stored so an audit read never fails a whole page for it."""

    error: str
    stored_data: Any
    stored_metadata: Any


class EventBody(msgspec.Struct):
    global_position: int
    stream_id: str
    stream_version: int
    event_type: str
    event_class: Literal["lifecycle", "observation"] = msgspec.field(name="class")
    node_id: str = ""
    data: EventPayload | None = None
    metadata: EventMetadata | None = None
    recorded_at: datetime | None = None
    # Set only for an event that cannot be decoded; then `data` and `metadata` are null.
    undecodable: UndecodableBody | None = None


class EventPage(msgspec.Struct):
    items: list[EventBody]
    # Where to resume: after the last event of this page, or the cursor given when the page is
    # empty. Polling with it later delivers exactly the events committed since, once each.
    next_cursor: str
    # The page was cut by its limit: read again at once for more.
    has_more: bool = False


class InventoryHealth(msgspec.Struct):
    status: Literal["pending", "ok", "degraded", "failed"]
    reasons: list[str]
    nodes: int


class ReplicaHealth(msgspec.Struct):
    """The hot standby that serves reads (`MODELFORGE_READ_DATABASE_URL`): reachable, and how far
    behind its primary its reads are (seconds since the last transaction it replayed was committed
    on the primary; 0 when it has replayed everything it received)."""

    status: Literal["ok", "unavailable"]
    replay_lag_seconds: float | None


class HealthBody(msgspec.Struct):
    status: Literal["ok", "degraded"]
    database: Literal["ok", "unavailable"]
    inventory: InventoryHealth
    version: str
    # Only where reads are served from a standby.
    replica: ReplicaHealth | None = None
