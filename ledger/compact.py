"""Compact observation bodies: a node's telemetry snapshot stored as bytes instead of jsonb.

Every steady agent report appends one NODE_TELEMETRY_OBSERVED: as jsonb about 6 KB of JSON that
PostgreSQL parses and compresses on every append, most of it the same names again and again
(`{"state": "known", "value": ...}` under `utilization_memory_percent`, eight times over). Stored
compact, the event is one msgpack document of positions instead of names: each group of facts
(a GPU's telemetry, its health signals, the host's telemetry) is a list of values in the order of
a fixed codebook, a fact's availability state told by the value's shape, GPU UUIDs and ids as 16
raw bytes. About 0.8 KB for eight GPUs, small enough that PostgreSQL stores the row as it is,
never compresses it and never parses it. Lifecycle events stay jsonb, readable in SQL and
hash-chained (docs/storage.md).

Format 1, a msgpack array `[1, metadata, payload]`:
  metadata  [received_at, source, observed_at, agent_stream, agent_sequence, agent_sent_at,
             agent_report_sha256 (32 bytes where it is lowercase hex), agent_sequence_gap,
             actor, correlation_id]                     (trailing nils left out)
  payload   [host telemetry, storage, accelerators]
  storage   [[mount, used_bytes, total_bytes], ...]
  accelerator [uuid, accelerator_id, telemetry, health or nil]
  health    [clock_event_reasons, ecc_mode, ecc_errors, remapped_rows, retired_pages,
             pcie_replay_count, xid_events, xids]       (xids: [[xid, at], ...] or left out)
  a group   the facts of the codebook's names in its order, then, if any, a map of the names
            the codebook lacks; a name the group lacks is ABSENT; trailing ABSENTs left out
  a fact    a scalar (bool, int, float, str): known; nil: unknown; [2]: unsupported;
            [0, reason]: unavailable; [1, reason]: temporarily failed; [3]: absent
A released format never changes: a new encoding takes a new format number and this one stays
readable, so every stored body decodes. Round trips are exact (tests/test_compact.py).
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal, TypeAlias

import msgspec

from collectors.facts import (
    UNKNOWN,
    UNSUPPORTED,
    Fact,
    Known,
    TemporarilyFailed,
    Unavailable,
    Unknown,
    Unsupported,
)
from collectors.gpu_health import AcceleratorHealthSignals, XidOccurrence
from collectors.observations import StorageObservation
from ledger.events import (
    AcceleratorSample,
    EventMetadata,
    EventPayload,
    EventValidationError,
    NodeTelemetryObserved,
)

# The event types stored compact: observations only (not hash-chained, not meant for SQL).
COMPACT_EVENT_TYPES: frozenset[str] = frozenset({"NODE_TELEMETRY_OBSERVED"})

FORMAT_1 = 1

# Format 1's codebooks. Frozen: a name is only ever appended in a new format.
GPU_TELEMETRY_1: tuple[str, ...] = (
    "memory_used_bytes",
    "memory_total_bytes",
    "utilization_gpu_percent",
    "utilization_memory_percent",
    "temperature_celsius",
    "power_watts",
    "clock_graphics_mhz",
    "clock_sm_mhz",
    "clock_memory_mhz",
    "fan_speed_percent",
    "performance_state",
)
HOST_TELEMETRY_1: tuple[str, ...] = ("memory_available_bytes", "memory_total_bytes")
CLOCK_EVENT_REASONS_1: tuple[str, ...] = (
    "gpu_idle",
    "applications_clocks_setting",
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "display_clock_setting",
)
ECC_COUNTERS_1: tuple[str, ...] = (
    "corrected_volatile",
    "uncorrected_volatile",
    "corrected_aggregate",
    "uncorrected_aggregate",
)
REMAPPED_ROWS_1: tuple[str, ...] = ("correctable", "uncorrectable", "pending", "failure")
RETIRED_PAGES_1: tuple[str, ...] = ("single_bit", "double_bit", "pending")

_NAMES: dict[Sequence[str], frozenset[str]] = {
    c: frozenset(c)
    for c in (
        GPU_TELEMETRY_1,
        HOST_TELEMETRY_1,
        CLOCK_EVENT_REASONS_1,
        ECC_COUNTERS_1,
        REMAPPED_ROWS_1,
        RETIRED_PAGES_1,
    )
}

_POSITIONS: dict[Sequence[str], dict[str, int]] = {c: {n: i for i, n in enumerate(c)} for c in _NAMES}

_UNAVAILABLE, _TEMPORARILY_FAILED, _UNSUPPORTED, _ABSENT = 0, 1, 2, 3
_ABSENT_FACT = [_ABSENT]
_UNSUPPORTED_FACT = [_UNSUPPORTED]
_GPU_UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_SHA256 = re.compile(r"[0-9a-f]{64}")

Dense: TypeAlias = list[Any]

_encoder = msgspec.msgpack.Encoder()


class UndecodableBody(ValueError):
    """Stored bytes that are not a compact body this release can read."""


def is_compact(payload: object) -> bool:
    return type(payload) is NodeTelemetryObserved


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------


def _fact(f: Fact) -> Any:
    t = type(f)
    if t is Known:
        v = f.value  # type: ignore[union-attr]
        if type(v) not in (bool, int, float, str):
            raise EventValidationError(f"a known fact's value is a {type(v).__name__}")
        return v
    if t is Unknown:
        return None
    if t is Unsupported:
        return _UNSUPPORTED_FACT
    if t is Unavailable:
        return [_UNAVAILABLE, f.reason]  # type: ignore[union-attr]
    if t is TemporarilyFailed:
        return [_TEMPORARILY_FAILED, f.reason]  # type: ignore[union-attr]
    raise EventValidationError(f"{t.__name__} is not a fact")


_SCALARS = frozenset({bool, int, float, str})


def _group(facts: Mapping[str, Fact], codebook: Sequence[str]) -> Dense:
    out: Dense = []
    append = out.append
    for n in codebook:
        f = facts.get(n)
        if f is None:
            append(_ABSENT_FACT)
        elif type(f) is Known and type(f.value) in _SCALARS:
            append(f.value)
        else:
            append(_fact(f))
    while out and out[-1] is _ABSENT_FACT:
        out.pop()
    if len(facts) > len(codebook) or not _NAMES[codebook].issuperset(facts):
        names = _NAMES[codebook]
        for n in facts:
            if type(n) is not str:
                raise EventValidationError(f"a fact's name is a {type(n).__name__}")
        out.append({n: _fact(f) for n, f in facts.items() if n not in names})
    return out


def _id(value: str, pattern: re.Pattern[str], prefix: int) -> str | bytes:
    """A canonical UUID string as its 16 bytes (after `prefix` characters), anything else as is."""
    if pattern.fullmatch(value):
        return bytes.fromhex(value[prefix:].replace("-", ""))
    return value


def _health(h: AcceleratorHealthSignals) -> Dense:
    out: Dense = [
        _group(h.clock_event_reasons, CLOCK_EVENT_REASONS_1),
        _fact(h.ecc_mode),
        _group(h.ecc_errors, ECC_COUNTERS_1),
        _group(h.remapped_rows, REMAPPED_ROWS_1),
        _group(h.retired_pages, RETIRED_PAGES_1),
        _fact(h.pcie_replay_count),
        _fact(h.xid_events),
    ]
    if h.xids:
        out.append([[x.code, x.at] for x in h.xids])
    return out


def _metadata(m: EventMetadata) -> Dense:
    sha = m.agent_report_sha256
    out: Dense = [
        m.received_at,
        m.source,
        m.observed_at,
        m.agent_stream,
        m.agent_sequence,
        m.agent_sent_at,
        bytes.fromhex(sha) if sha is not None and _SHA256.fullmatch(sha) else sha,
        m.agent_sequence_gap,
        m.actor,
        m.correlation_id,
    ]
    while out and out[-1] is None:
        out.pop()
    return out


def _payload(p: NodeTelemetryObserved) -> Dense:
    return [
        _group(p.telemetry, HOST_TELEMETRY_1),
        [[s.mount, _fact(s.used_bytes), _fact(s.total_bytes)] for s in p.storage],
        [
            [
                _id(a.uuid, _GPU_UUID, 4),
                _id(a.accelerator_id, _UUID, 0),
                _group(a.telemetry, GPU_TELEMETRY_1),
                None if a.health is None else _health(a.health),
            ]
            for a in p.accelerators
        ],
    ]


def encode_body(payload: EventPayload, metadata: EventMetadata) -> tuple[bytes, EventPayload, EventMetadata]:
    """The stored body of an event, and the payload and metadata the log gives back for it: the
    ones given, which the body holds exactly (tests/test_compact.py proves the round trip over
    arbitrary snapshots; times come back in UTC, the same instants). Decoding the body again here
    would cost an append more than the encoding itself."""
    if not isinstance(payload, NodeTelemetryObserved):
        raise EventValidationError(f"{type(payload).__name__} is not stored compact")
    try:
        body = _encoder.encode([FORMAT_1, _metadata(metadata), _payload(payload)])
    except (msgspec.EncodeError, TypeError, AttributeError, ValueError) as exc:
        raise EventValidationError(f"{type(payload).__name__}: {exc}") from exc
    if type(metadata.received_at) is not datetime:
        raise EventValidationError("metadata: received_at is not a time")
    return body, payload, metadata


def sampled_digest(payload: EventPayload) -> uuid.UUID | None:
    """Of a node's telemetry snapshot, the digest of the GPUs it samples, as mf_sampled computes
    it from a jsonb snapshot (ledger/sql/functions/mf_sampled.sql); None for any other event."""
    if not isinstance(payload, NodeTelemetryObserved):
        return None
    joined = ",".join(sorted({a.uuid for a in payload.accelerators}))
    return uuid.UUID(bytes=hashlib.md5(joined.encode(), usedforsecurity=False).digest())


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


def _unfact(v: Any) -> Fact:
    if v is None:
        return UNKNOWN
    if type(v) is list:
        kind = v[0]
        if kind == _UNSUPPORTED:
            return UNSUPPORTED
        if kind == _UNAVAILABLE:
            return Unavailable(v[1])
        if kind == _TEMPORARILY_FAILED:
            return TemporarilyFailed(v[1])
        raise UndecodableBody(f"unknown fact kind {kind!r}")
    return Known(v)


def _ungroup(dense: Dense, codebook: Sequence[str]) -> dict[str, Fact]:
    out: dict[str, Fact] = {}
    extra: dict[str, Any] | None = None
    for i, v in enumerate(dense):
        if type(v) is dict:
            extra = v
            break
        if type(v) is list and v[0] == _ABSENT:
            continue
        out[codebook[i]] = _unfact(v)
    if extra:
        for n, v in extra.items():
            out[n] = _unfact(v)
    return out


def _unid(value: str | bytes, prefix: str) -> str:
    if type(value) is not bytes:
        return str(value)
    if len(value) != 16:
        raise UndecodableBody(f"an id of {len(value)} bytes")
    h = value.hex()
    return f"{prefix}{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _unhealth(d: Dense) -> AcceleratorHealthSignals:
    return AcceleratorHealthSignals(
        clock_event_reasons=_ungroup(d[0], CLOCK_EVENT_REASONS_1),
        ecc_mode=_unfact(d[1]),
        ecc_errors=_ungroup(d[2], ECC_COUNTERS_1),
        remapped_rows=_ungroup(d[3], REMAPPED_ROWS_1),
        retired_pages=_ungroup(d[4], RETIRED_PAGES_1),
        pcie_replay_count=_unfact(d[5]),
        xid_events=_unfact(d[6]),
        xids=[XidOccurrence(code=x[0], at=_at(x[1])) for x in d[7]] if len(d) > 7 else [],
    )


def _at(v: Any) -> datetime:
    if type(v) is not datetime:
        raise UndecodableBody(f"expected a time, got {type(v).__name__}")
    return v


_METADATA_FIELDS = 10


def _maybe(v: Any, kind: type) -> Any:
    if v is not None and type(v) is not kind:
        raise UndecodableBody(f"expected a {kind.__name__}, got {type(v).__name__}")
    return v


_SOURCES = frozenset({"local", "agent", "operator", "system"})


def _unmetadata(d: Dense) -> EventMetadata:
    v = list(d) + [None] * (_METADATA_FIELDS - len(d))
    sha = v[6]
    if v[1] not in _SOURCES:
        raise UndecodableBody(f"unknown source {v[1]!r}")
    return EventMetadata(
        received_at=_at(v[0]),
        source=v[1],
        observed_at=_maybe(v[2], datetime),
        agent_stream=_maybe(v[3], str),
        agent_sequence=_maybe(v[4], int),
        agent_sent_at=_maybe(v[5], datetime),
        agent_report_sha256=sha.hex() if type(sha) is bytes else sha,
        agent_sequence_gap=_maybe(v[7], int),
        actor=_maybe(v[8], str),
        correlation_id=_maybe(v[9], str),
    )


def decode_body(body: bytes) -> tuple[NodeTelemetryObserved, EventMetadata]:
    """The payload and metadata of a stored compact body."""
    try:
        doc = msgspec.msgpack.decode(body)
        if type(doc) is not list or len(doc) != 3 or doc[0] != FORMAT_1:
            raise UndecodableBody("not a compact body of format 1")
        _, m, p = doc
        host, storage, gpus = p
        payload = NodeTelemetryObserved(
            telemetry=_ungroup(host, HOST_TELEMETRY_1),
            storage=[StorageObservation(s[0], _unfact(s[1]), _unfact(s[2])) for s in storage],
            accelerators=[
                AcceleratorSample(
                    accelerator_id=_unid(g[1], ""),
                    uuid=_unid(g[0], "GPU-"),
                    telemetry=_ungroup(g[2], GPU_TELEMETRY_1),
                    health=None if g[3] is None else _unhealth(g[3]),
                )
                for g in gpus
            ],
        )
        metadata = _unmetadata(m)
    except UndecodableBody:
        raise
    except (msgspec.DecodeError, ValueError, TypeError, IndexError, KeyError) as exc:
        raise UndecodableBody(f"compact body: {exc}") from exc
    return payload, metadata


# ---------------------------------------------------------------------------------------------
# What a telemetry history reads of thousands of snapshots
# ---------------------------------------------------------------------------------------------
# Typed views of format 1 that decode the times and the one group of facts a history counts: the
# parts in between stay undecoded (msgspec.Raw: no object for what they hold), the parts after it
# are not looked at (an array_like Struct skips trailing elements), and the groups of every
# snapshot are decoded together in one call.


class _Times1(msgspec.Struct, array_like=True):
    received_at: msgspec.Raw  # decoded only where observed_at is missing
    source: msgspec.Raw = msgspec.Raw(b"\xc0")
    observed_at: datetime | None = None


class _Entry1(msgspec.Struct, array_like=True):
    uuid: msgspec.Raw
    accelerator_id: msgspec.Raw
    telemetry: msgspec.Raw


class _Gpus1(msgspec.Struct, array_like=True):
    host: msgspec.Raw
    storage: msgspec.Raw
    accelerators: list[_Entry1]


class _GpusView1(msgspec.Struct, array_like=True):
    format: Literal[1]
    metadata: _Times1
    payload: _Gpus1


class _Host1(msgspec.Struct, array_like=True):
    host: msgspec.Raw


class _HostView1(msgspec.Struct, array_like=True):
    format: Literal[1]
    metadata: _Times1
    payload: _Host1


_gpus_view = msgspec.msgpack.Decoder(_GpusView1)
_host_view = msgspec.msgpack.Decoder(_HostView1)
_time = msgspec.msgpack.Decoder(datetime)
_groups = msgspec.msgpack.Decoder(list[list[Any]])
_BAD_VIEW = (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, IndexError)


def _at_of(times: _Times1) -> datetime:
    return times.observed_at or _time.decode(times.received_at)


def _decoded(groups: list[msgspec.Raw]) -> list[Dense]:
    """Many groups at once: one msgpack array of them (array 32: a marker, the count, big-endian)."""
    return _groups.decode(b"".join([b"\xdd", len(groups).to_bytes(4, "big"), *groups]))


def _spread(dense: Dense, codebook: Sequence[str], names: Sequence[str]) -> Dense:
    extra = dense[-1] if dense and type(dense[-1]) is dict else None
    positions = _POSITIONS[codebook]
    n = len(dense) - (0 if extra is None else 1)
    out: Dense = []
    for name in names:
        i = positions.get(name)
        if i is not None and i < n:
            out.append(dense[i])
        elif extra is not None and name in extra:
            out.append(extra[name])
        else:
            out.append(_ABSENT_FACT)
    return out


def _values(groups: list[Dense], codebook: Sequence[str], names: Sequence[str]) -> list[Dense]:
    """Each group as its values of `names`, one each in that order: the group itself where it
    holds the whole codebook and nothing else and `names` is the codebook."""
    if tuple(names) != codebook:
        return [_spread(d, codebook, names) for d in groups]
    whole = len(codebook)
    return [d if len(d) == whole and type(d[-1]) is not dict else _spread(d, codebook, names) for d in groups]


Values: TypeAlias = list[tuple[int, datetime, Dense]]


def gpu_key(gpu_uuid: str) -> bytes:
    """A GPU UUID as a compact body holds it, encoded."""
    return _encoder.encode(_id(gpu_uuid, _GPU_UUID, 4))


def gpu_values(bodies: Sequence[bytes], gpu_uuid: str, names: Sequence[str]) -> Values:
    """Of each compact snapshot in `bodies` that samples the GPU: its index in `bodies`, its time
    (observed, else received) and the GPU's telemetry (its last entry, as the fold takes it) as
    values of `names`, one each in that order: each fact as stored (a scalar known, nil unknown,
    else what `value_state` tells; ABSENT where the GPU lacks the name)."""
    key = msgspec.Raw(gpu_key(gpu_uuid))
    found: list[tuple[int, datetime]] = []
    groups: list[msgspec.Raw] = []
    decode = _gpus_view.decode
    try:
        for i, body in enumerate(bodies):
            view = decode(body)
            group = None
            for g in view.payload.accelerators:
                if g.uuid == key:
                    group = g.telemetry
            if group is not None:
                found.append((i, _at_of(view.metadata)))
                groups.append(group)
        dense = _values(_decoded(groups), GPU_TELEMETRY_1, names)
    except _BAD_VIEW as exc:
        raise UndecodableBody(f"compact body: {exc}") from exc
    return [(i, at, d) for (i, at), d in zip(found, dense, strict=True)]


def host_values(bodies: Sequence[bytes], names: Sequence[str]) -> Values:
    """`gpu_values` of the host's telemetry, which every snapshot holds."""
    times: list[datetime] = []
    groups: list[msgspec.Raw] = []
    decode = _host_view.decode
    try:
        for body in bodies:
            view = decode(body)
            times.append(_at_of(view.metadata))
            groups.append(view.payload.host)
        dense = _values(_decoded(groups), HOST_TELEMETRY_1, names)
    except _BAD_VIEW as exc:
        raise UndecodableBody(f"compact body: {exc}") from exc
    return [(i, at, d) for i, (at, d) in enumerate(zip(times, dense, strict=True))]


_STATE_NAMES = {
    _UNAVAILABLE: "unavailable",
    _TEMPORARILY_FAILED: "temporarily_failed",
    _UNSUPPORTED: "unsupported",
}


def value_state(value: object) -> str | None:
    """The availability state of a fact as stored that is not a scalar nor nil (`[kind, ...]`),
    None where it is ABSENT (the group lacks the name)."""
    if type(value) is list and value and type(kind := value[0]) is int:
        if kind == _ABSENT:
            return None
        state = _STATE_NAMES.get(kind)
        if state is not None:
            return state
    raise UndecodableBody(f"not a fact of format 1: {value!r}")
