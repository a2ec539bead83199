"""The event catalog: every fact the ledger records, as msgspec Structs in one tagged union.

The tag (`event_type`) is stored beside the data, and the data itself carries it too, so a row's
jsonb is self-describing to an auditor reading SQL. `SCHEMA_VERSION` is stored per event; a
change to a payload's shape bumps it and adds an upcaster (none needed yet).

Two classes (docs/architecture.md, "The event log"): lifecycle events are permanent and
hash-chained; observation events (telemetry samples) are retention-bounded.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import datetime
from typing import Literal, TypeAlias

import msgspec

from collectors.facts import Fact, FactValue
from collectors.gpu_health import AcceleratorHealthSignals
from collectors.observations import CpuInfo, OsInfo, StorageObservation

SCHEMA_VERSION = 1

EventClass: TypeAlias = Literal["lifecycle", "observation"]
Source: TypeAlias = Literal["local", "agent", "operator", "system"]

# A GPU's health verdict as the log records it; domain.health decides it.
HealthStatus: TypeAlias = Literal["healthy", "degraded", "failed"]
HealthAction: TypeAlias = Literal["none", "monitor", "inspect_host", "reset_gpu", "service"]


class HealthReason(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    code: str
    status: HealthStatus
    action: HealthAction
    detail: str


class _Event(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="event_type"):
    """Base of every event payload; subclasses set their tag."""


class FactChange(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    before: Fact | FactValue | None
    after: Fact | FactValue | None


# --- lifecycle: inventory --------------------------------------------------------------------


class NodeDiscovered(_Event, frozen=True, tag="NODE_DISCOVERED"):
    node_id: str
    identity_key: str
    identity_source: str
    hostname: str
    os: OsInfo
    cpu: CpuInfo
    memory_total_bytes: Fact
    driver_version: Fact
    cuda_driver_version: Fact


class NodeMetadataChanged(_Event, frozen=True, tag="NODE_METADATA_CHANGED"):
    """Hostname or display name changed: mutable metadata, never identity."""

    changes: dict[str, FactChange]


class AcceleratorDiscovered(_Event, frozen=True, tag="ACCELERATOR_DISCOVERED"):
    accelerator_id: str
    uuid: str
    index: Fact
    name: Fact
    pci_bus_id: Fact
    memory_total_bytes: Fact
    compute_capability: Fact
    mig_mode: Fact
    driver_version: Fact
    cuda_driver_version: Fact
    # True when a `missing` accelerator reappeared in a complete enumeration.
    rediscovered: bool = False


class AcceleratorMissing(_Event, frozen=True, tag="ACCELERATOR_MISSING"):
    accelerator_id: str
    uuid: str
    reason: str


class HardwareChanged(_Event, frozen=True, tag="HARDWARE_CHANGED"):
    """Changed inventory facts of the node (`accelerator_uuid` None) or of one accelerator."""

    subject: Literal["node", "accelerator"]
    changes: dict[str, FactChange]
    accelerator_id: str | None = None
    accelerator_uuid: str | None = None


class AcceleratorHealthChanged(_Event, frozen=True, tag="ACCELERATOR_HEALTH_CHANGED"):
    """The accelerator's health verdict (domain/health.py, docs/gpu-health.md) changed: `before`
    -> `after`, with the reasons and the recommended action of the new verdict."""

    accelerator_id: str
    uuid: str
    before: HealthStatus
    after: HealthStatus
    action: HealthAction
    reasons: list[HealthReason]
    before_reasons: list[str] = []  # the previous verdict's reason codes
    # The SHA-256 of the health policy that decided it (HEALTH_POLICY_APPLIED; None: the rules
    # shipped before policies were data) and the node stream versions of the events that caused
    # it: the XIDs its rules counted and the telemetry snapshot whose signals it judged.
    policy_digest: str | None = None
    evidence: list[int] = []


class AcceleratorXidObserved(_Event, frozen=True, tag="ACCELERATOR_XID_OBSERVED"):
    """One XID error the driver reported for the GPU, recorded once: `at` is when the collector
    drained it from NVML's event API (the observer's clock)."""

    accelerator_id: str
    uuid: str
    code: int
    at: datetime


class InventoryStatusChanged(_Event, frozen=True, tag="INVENTORY_STATUS_CHANGED"):
    """The node's inventory became ok or degraded (with the reasons), e.g. NVML unavailable."""

    status: Literal["ok", "degraded"]
    reasons: list[str]
    nvml_status: str
    accelerator_capability: Literal["present", "absent", "unknown"]


class InventoryFailed(_Event, frozen=True, tag="INVENTORY_FAILED"):
    """A refresh failed; the last successful inventory stays as it was."""

    stage: str
    reason: str


# --- lifecycle: enrollment and agent credentials (docs/NODE_AGENT_PROTOCOL.md) ----------------
# Enrollment tokens live in streams of their own (one per token); a node's credentials live in the
# node's stream. Events carry a credential's SHA-256 (of a 256-bit random secret), never a secret.

ENROLLMENT_TOKEN_STREAM_PREFIX = "enrollment-token-"


def enrollment_token_stream(token_id: str) -> str:
    return ENROLLMENT_TOKEN_STREAM_PREFIX + token_id


def is_enrollment_token_stream(stream_id: str) -> bool:
    return stream_id.startswith(ENROLLMENT_TOKEN_STREAM_PREFIX)


class EnrollmentTokenCreated(_Event, frozen=True, tag="ENROLLMENT_TOKEN_CREATED"):
    token_id: str
    secret_sha256: str
    expires_at: datetime
    uses: int
    description: str = ""


class EnrollmentTokenUsed(_Event, frozen=True, tag="ENROLLMENT_TOKEN_USED"):
    """One use of a token: it was exchanged for the credential `credential_id` of `node_id`."""

    token_id: str
    node_id: str
    credential_id: str


class EnrollmentTokenRevoked(_Event, frozen=True, tag="ENROLLMENT_TOKEN_REVOKED"):
    token_id: str
    reason: str


class CredentialIssued(_Event, frozen=True, tag="CREDENTIAL_ISSUED"):
    """A node credential, bound to the node (and its identity key), issued at enrollment."""

    credential_id: str
    node_id: str
    identity_key: str
    identity_source: str
    hostname: str
    secret_sha256: str
    enrollment_token_id: str


class CredentialRevoked(_Event, frozen=True, tag="CREDENTIAL_REVOKED"):
    credential_id: str
    reason: str


# --- lifecycle: the GPU health policy (docs/health-policy.md) -------------------------------
# One stream holds every policy an operator applied; the newest is in force.

HEALTH_POLICY_STREAM = "health-policy"


def is_health_policy_stream(stream_id: str) -> bool:
    return stream_id == HEALTH_POLICY_STREAM


class HealthPolicyApplied(_Event, frozen=True, tag="HEALTH_POLICY_APPLIED"):
    """An operator put a GPU health policy in force: its name, the SHA-256 of its text (what every
    later ACCELERATOR_HEALTH_CHANGED names) and the text itself, exactly as applied."""

    name: str
    digest: str
    policy: str


# --- lifecycle: work leases and permanent decommission (docs/NODE_DECOMMISSION.md) -------------
# Leases and the tombstone live in the node's stream; a refused attempt to revive a decommissioned
# node is recorded in a stream of its own (the node's stream takes no event after its tombstone).

DECOMMISSION_AUDIT_STREAM_PREFIX = "decommission-audit-"


def decommission_audit_stream(node_id: str) -> str:
    return DECOMMISSION_AUDIT_STREAM_PREFIX + node_id


def is_decommission_audit_stream(stream_id: str) -> bool:
    return stream_id.startswith(DECOMMISSION_AUDIT_STREAM_PREFIX)


class WorkLeaseAcquired(_Event, frozen=True, tag="WORK_LEASE_ACQUIRED"):
    """Work that depends on the node (recorded by an operator or another component); while the lease
    is active (not released, not expired) the node cannot be decommissioned."""

    lease_id: str
    owner: str
    reason: str
    expires_at: datetime | None = None


class WorkLeaseReleased(_Event, frozen=True, tag="WORK_LEASE_RELEASED"):
    lease_id: str
    reason: str = ""


class NodeDecommissioned(_Event, frozen=True, tag="NODE_DECOMMISSIONED"):
    """The terminal tombstone of a node's stream: the stream takes no event after it. `generation`
    and `digest` are those of the preview the operator executed; `actor` is who, `reason` why."""

    node_id: str
    actor: str
    reason: str
    decommissioned_at: datetime
    generation: int
    digest: str
    revoked_credentials: list[str] = []


class NodeRevivalRefused(_Event, frozen=True, tag="NODE_REVIVAL_REFUSED"):
    """An attempt to bring a decommissioned node back (a local refresh, an agent report, an
    enrollment) was refused. Stored in the stream `decommission-audit-<node id>`, at most one per
    node, attempt and actor per hour."""

    node_id: str
    attempt: Literal["local_refresh", "agent_report", "enrollment"]
    detail: str


# --- lifecycle: webhook subscriptions (docs/integrations.md) ------------------------------------
# Every subscription's creation, removal and operator resume is recorded in the one stream
# `webhooks`. The events carry where deliveries go and what they select, never the signing secret
# (kept in a table of its own so the server can sign with it).

WEBHOOKS_STREAM = "webhooks"


def is_webhook_stream(stream_id: str) -> bool:
    return stream_id == WEBHOOKS_STREAM


class WebhookSubscribed(_Event, frozen=True, tag="WEBHOOK_SUBSCRIBED"):
    """A subscription: matching events committed after this one are delivered to its URL. The log
    (readable with a viewer token) keeps the URL's origin and its SHA-256 only, since a receiver's
    URL may hold a token of its own in its path or query."""

    subscription_id: str
    destination: str  # scheme://host:port
    url_sha256: str
    event_types: list[str]
    event_classes: list[EventClass]
    node_id: str | None = None
    description: str = ""


class WebhookUnsubscribed(_Event, frozen=True, tag="WEBHOOK_UNSUBSCRIBED"):
    subscription_id: str
    reason: str = ""


class WebhookResumed(_Event, frozen=True, tag="WEBHOOK_RESUMED"):
    """An operator resumed a failing subscription: delivery starts again at its cursor."""

    subscription_id: str
    at_position: int


# --- observation: telemetry ------------------------------------------------------------------


class HostTelemetryObserved(_Event, frozen=True, tag="HOST_TELEMETRY_OBSERVED"):
    """The host's part of a snapshot, as releases before NODE_TELEMETRY_OBSERVED wrote it (one
    event per kind and accelerator); logs holding it fold as before, nothing appends it now."""

    telemetry: dict[str, Fact]
    storage: list[StorageObservation]


class AcceleratorTelemetryObserved(_Event, frozen=True, tag="ACCELERATOR_TELEMETRY_OBSERVED"):
    """One accelerator's sample, as releases before NODE_TELEMETRY_OBSERVED wrote it; logs
    holding it fold as before, nothing appends it now."""

    accelerator_id: str
    uuid: str
    telemetry: dict[str, Fact]
    # The health signals of the same collection (counters that only grow are telemetry); its XIDs
    # are recorded as ACCELERATOR_XID_OBSERVED instead, so `xids` is empty here.
    health: AcceleratorHealthSignals | None = None


class AcceleratorSample(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One accelerator's part of a node's telemetry snapshot."""

    accelerator_id: str
    uuid: str
    telemetry: dict[str, Fact]
    # As in ACCELERATOR_TELEMETRY_OBSERVED: the collection's health signals, its XIDs left out.
    health: AcceleratorHealthSignals | None = None


class NodeTelemetryObserved(_Event, frozen=True, tag="NODE_TELEMETRY_OBSERVED"):
    """A node's whole telemetry snapshot of one refresh or report: the host's metrics and storage
    and every accelerator the scan listed, each sample `{accelerator_id, uuid, telemetry, health}`,
    in one event (one row, one index entry each, one metadata per report). What refreshes and
    reports append; the per-kind HOST_/ACCELERATOR_TELEMETRY_OBSERVED of earlier releases still
    fold."""

    telemetry: dict[str, Fact]
    storage: list[StorageObservation]
    accelerators: list[AcceleratorSample] = []


EventPayload: TypeAlias = (
    NodeDiscovered
    | NodeMetadataChanged
    | AcceleratorDiscovered
    | AcceleratorMissing
    | HardwareChanged
    | AcceleratorHealthChanged
    | AcceleratorXidObserved
    | InventoryStatusChanged
    | InventoryFailed
    | HostTelemetryObserved
    | AcceleratorTelemetryObserved
    | NodeTelemetryObserved
    | EnrollmentTokenCreated
    | EnrollmentTokenUsed
    | EnrollmentTokenRevoked
    | CredentialIssued
    | CredentialRevoked
    | WorkLeaseAcquired
    | WorkLeaseReleased
    | NodeDecommissioned
    | NodeRevivalRefused
    | HealthPolicyApplied
    | WebhookSubscribed
    | WebhookUnsubscribed
    | WebhookResumed
)

OBSERVATION_TYPES: frozenset[type[_Event]] = frozenset(
    {HostTelemetryObserved, AcceleratorTelemetryObserved, NodeTelemetryObserved}
)


def _tag(cls: type[_Event]) -> str:
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


EVENT_TYPES: dict[str, type[_Event]] = {_tag(c): c for c in EventPayload.__args__}
OBSERVATION_EVENT_TYPES: frozenset[str] = frozenset(_tag(c) for c in OBSERVATION_TYPES)
LIFECYCLE_EVENT_TYPES: frozenset[str] = frozenset(EVENT_TYPES) - OBSERVATION_EVENT_TYPES


def event_type_of(payload: EventPayload) -> str:
    return _tag(type(payload))


def event_class_of(payload: EventPayload) -> EventClass:
    return "observation" if type(payload) in OBSERVATION_TYPES else "lifecycle"


class EventMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Who saw what, when, by whose clock (docs/event-catalog.md)."""

    received_at: datetime  # the central clock
    source: Source
    observed_at: datetime | None = None  # the observer's clock (agent or local host)
    agent_stream: str | None = None
    agent_sequence: int | None = None
    # Agent reports (docs/NODE_AGENT_PROTOCOL.md): the agent's clock when it sent the report (the
    # clock skew is measured against it), the SHA-256 of the exact report body (replays of an
    # accepted sequence are recognized by it), and how many sequences were skipped before it.
    agent_sent_at: datetime | None = None
    agent_report_sha256: str | None = None
    agent_sequence_gap: int | None = None
    actor: str | None = None
    correlation_id: str | None = None


def new_event_id() -> uuid.UUID:
    """A fresh event id, ordered by the time it was made: a UUID of version 7 (RFC 9562), the Unix
    time in milliseconds in its first 48 bits, 74 random bits after. The log's unique index of
    event ids then grows at its right edge, as its index of positions does, instead of taking each
    new id on a random page of a day's index (about two thirds full and, at a fleet's size, far
    larger than the server's memory); docs/storage.md."""
    return event_id_at(time.time_ns() // 1_000_000)


def event_id_at(unix_ms: int) -> uuid.UUID:
    """A version 7 UUID of this Unix time in milliseconds, its other bits random."""
    return uuid.UUID(int=unix_ms << 80 | _random_74() | _VERSION_7_VARIANT_RFC)


# Version 7 in bits 76-79 of the 128, the RFC variant (0b10) in bits 62-63; the 74 bits between.
_RANDOM_74 = (0xFFF << 64) | (2**62 - 1)
_VERSION_7_VARIANT_RFC = (0x7 << 76) | (0b10 << 62)

# The random bits of the next event ids, read from the operating system's generator 256 ids at a
# time: one system call per event cost the server more than the rest of the id (a report makes
# one). Taken with list.pop, which hands each to one caller only, threads included; a forked
# child drops what its parent read.
_RANDOM_BATCH = 256
_random_bits: list[int] = []
os.register_at_fork(after_in_child=_random_bits.clear)


def _random_74() -> int:
    try:
        return _random_bits.pop()
    except IndexError:
        raw = os.urandom(10 * _RANDOM_BATCH)
        _random_bits.extend(int.from_bytes(raw[i : i + 10]) & _RANDOM_74 for i in range(0, len(raw), 10))
        return _random_bits.pop()


class NewEvent(msgspec.Struct, frozen=True):
    """An event about to be appended. `event_id` is the idempotency key."""

    payload: EventPayload
    metadata: EventMetadata
    event_id: uuid.UUID = msgspec.field(default_factory=new_event_id)

    @property
    def event_type(self) -> str:
        return event_type_of(self.payload)

    @property
    def event_class(self) -> EventClass:
        return event_class_of(self.payload)


class RecordedEvent(msgspec.Struct, frozen=True):
    """An event as the log holds it."""

    global_position: int
    stream_id: str
    stream_version: int
    event_id: uuid.UUID
    event_type: str
    event_class: EventClass
    schema_version: int
    payload: EventPayload
    metadata: EventMetadata
    recorded_at: datetime


_payload_decoder = msgspec.json.Decoder(EventPayload)
_metadata_decoder = msgspec.json.Decoder(EventMetadata)


class EventValidationError(ValueError):
    """An event does not match the catalog; nothing was written."""


def validate_payload(payload: object) -> tuple[bytes, EventPayload]:
    """Encode a payload and prove it decodes as the catalog says (Structs are not validated when
    constructed in Python, so a wrongly typed field would otherwise reach the log). Returns the
    bytes to store and the decoded payload: what the log will give back on rebuild, so the inline
    projections fold exactly that, and nothing decodes the same bytes twice."""
    if type(payload) not in EVENT_TYPES.values():
        raise EventValidationError(f"{type(payload).__name__} is not an event of the catalog")
    try:
        raw = msgspec.json.encode(payload)
        decoded = _payload_decoder.decode(raw)
    except (msgspec.ValidationError, msgspec.EncodeError, TypeError) as exc:
        raise EventValidationError(f"{type(payload).__name__}: {exc}") from exc
    return raw, decoded


def validate_metadata(metadata: object) -> tuple[bytes, EventMetadata]:
    try:
        raw = msgspec.json.encode(metadata)
        decoded = _metadata_decoder.decode(raw)
    except (msgspec.ValidationError, msgspec.EncodeError, TypeError) as exc:
        raise EventValidationError(f"metadata: {exc}") from exc
    return raw, decoded


def decode_payload(raw: str | bytes) -> EventPayload:
    return _payload_decoder.decode(raw)


def decode_metadata(raw: str | bytes) -> EventMetadata:
    return _metadata_decoder.decode(raw)
