"""Compact observation bodies: a node's telemetry snapshot stored as bytes instead of jsonb.

Every steady agent report appends one NODE_TELEMETRY_OBSERVED: as jsonb about 6 KB of JSON that
PostgreSQL parses and compresses on every append, most of it the same names again and again
(`{"state": "known", "value": ...}` under `utilization_memory_percent`, eight times over). Stored
compact, the event is one msgpack document of positions instead of names: each group of facts
(a GPU's telemetry, its health signals, the host's telemetry) is a list of values in the order of
a fixed codebook, a fact's availability state told by the value's shape, GPU UUIDs and ids as 16
raw bytes, or (format 3) each GPU as its index in the snapshot's stored GPU set. About 0.4 KB for
eight GPUs, small enough that PostgreSQL stores the row as it is, never compresses it and never
parses it. Lifecycle events stay jsonb, readable in SQL and
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

Format 2, `[2, metadata, payload]`, what an append writes without a stored GPU set: format 1
(same codebooks, health, storage and facts) but for
  metadata  [observed_at, source, received_at as microseconds after it, ...] where observed_at
            has a zone (what a history reads first), else format 1's [received_at, source,
            observed_at, ...]; agent_sent_at as microseconds after the first time where it has a
            zone; source and agent_stream as their index in SOURCES_2 and STREAMS_2 (text if
            neither); an actor `credential:<32 lowercase hex>` as its 16 bytes
  accelerator [uuid, telemetry, health or nil, accelerator_id or nil]   (trailing nils left out):
            nil where the id is the one derived from the stream (the node id) and the GPU UUID
  a unit    a fact at a position with a unit (GPU_UNITS_2, HOST_UNITS_2, STORAGE_UNIT_2): a
            known int that is a whole number of units as that number (bytes: KiB for the host's
            memory as /proc/meminfo counts it, MiB for a GPU's as NVML does, 4 KiB blocks for
            storage), a known float of watts that is a whole number of milliwatts (NVML's unit)
            as that int; any other known int there as [4, value]; the rest as in format 1
Format 3, `[3, metadata, payload]`, read with the snapshot's stored GPU set (table `gpu_sets`,
ledger/gpu_sets.py): format 2 but for
  accelerator [index, telemetry, health or nil, accelerator_id or nil]: the GPU's index in its
            set, the snapshot's distinct GPU UUIDs in byte order (what `sampled` digests, the
            row's column naming the set), instead of its UUID; written where the snapshot lists
            each GPU once
Format 4, `[4, metadata, payload]`, what an append writes where the snapshot's GPU set is stored:
format 3 but for
  a GPU's telemetry  the codebook GPU_TELEMETRY_4 (format 2's names and units, those a node's GPUs
            most often share last); in a GPU's entry after the first, where its values from some
            position to the end are the first GPU's (the same types and values, its map of other
            names included), those values as one `[]` (an empty array, which no fact is)
  health    `[]` in an entry after the first: the first GPU's health as stored
A released format never changes: a new encoding takes a new format number and the old ones stay
readable, so every stored body decodes. Round trips are exact (tests/test_compact.py). Here the
encoding; ledger/compact_decode.py decodes a body whole, ledger/compact_views.py the parts of many
a telemetry history reads.
"""

from __future__ import annotations

import hashlib
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any, TypeAlias

import msgspec

from collectors.facts import (
    Fact,
    Known,
    TemporarilyFailed,
    Unavailable,
    Unknown,
    Unsupported,
)
from collectors.gpu_health import AcceleratorHealthSignals
from collectors.identity import accelerator_id_for
from ledger.events import (
    AcceleratorSample,
    EventMetadata,
    EventPayload,
    EventValidationError,
    NodeTelemetryObserved,
)

# The event types stored compact: observations only (not hash-chained, not meant for SQL).
COMPACT_EVENT_TYPES: frozenset[str] = frozenset({"NODE_TELEMETRY_OBSERVED"})

FORMAT_1, FORMAT_2, FORMAT_3, FORMAT_4 = 1, 2, 3, 4
# The formats that list GPUs by their index in a stored set (the row's `sampled` names it).
SET_FORMATS: frozenset[int] = frozenset({FORMAT_3, FORMAT_4})

# Format 1's codebooks, format 2's too. Frozen: a name is only ever appended in a new format.
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

# Format 2's units, one per codebook position: NONE, MILLI (a float of thousandths) or bytes in
# units of 2^bits bytes (KIB, BLOCKS of 4 KiB, MIB), so that a shift scales them.
NONE, MILLI, KIB, BLOCKS, MIB = 0, -1, 10, 12, 20
GPU_UNITS_2: tuple[int, ...] = (MIB, MIB, NONE, NONE, NONE, MILLI, NONE, NONE, NONE, NONE, NONE)
HOST_UNITS_2: tuple[int, ...] = (KIB, KIB)
STORAGE_UNIT_2 = BLOCKS
SOURCES_2: tuple[str, ...] = ("local", "agent", "operator", "system")
STREAMS_2: tuple[str, ...] = ("inventory", "telemetry")

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

POSITIONS: dict[Sequence[str], dict[str, int]] = {c: {n: i for i, n in enumerate(c)} for c in _NAMES}

UNAVAILABLE, TEMPORARILY_FAILED, UNSUPPORTED_KIND, ABSENT, VERBATIM = 0, 1, 2, 3, 4
ABSENT_FACT = [ABSENT]
_UNSUPPORTED_FACT = [UNSUPPORTED_KIND]
_GPU_UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CREDENTIAL = re.compile(r"credential:[0-9a-f]{32}")
CREDENTIAL_PREFIX = "credential:"
_MICROSECOND = timedelta(microseconds=1)
# Floats of watts stored as milliwatts: below 10^15 W, so that they fit a msgpack int.
_MILLI_RANGE = 1e15

Dense: TypeAlias = list[Any]

ENCODER = msgspec.msgpack.Encoder()


class UndecodableBody(ValueError):
    """Stored bytes that are not a compact body this release can read."""


def is_compact(payload: object) -> bool:
    return type(payload) is NodeTelemetryObserved


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------


def fact(f: Fact) -> Any:
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
        return [UNAVAILABLE, f.reason]  # type: ignore[union-attr]
    if t is TemporarilyFailed:
        return [TEMPORARILY_FAILED, f.reason]  # type: ignore[union-attr]
    raise EventValidationError(f"{t.__name__} is not a fact")


_SCALARS = frozenset({bool, int, float, str})


def group(facts: Mapping[str, Fact], codebook: Sequence[str]) -> Dense:
    out: Dense = []
    append = out.append
    absent = 0
    for n in codebook:
        f = facts.get(n)
        if f is None:
            append(ABSENT_FACT)
            absent += 1
        elif type(f) is Known and type(f.value) in _SCALARS:
            append(f.value)
        else:
            append(fact(f))
    return _closed(out, facts, codebook, len(codebook) - absent)


def _closed(out: Dense, facts: Mapping[str, Fact], codebook: Sequence[str], found: int) -> Dense:
    """A group's values with its trailing ABSENTs left out and the names the codebook lacks after.
    `found`: how many of the codebook's names `facts` gave a fact for; where that is all of its
    entries (most groups), none is a name the codebook lacks, and the names need no other look."""
    while out and out[-1] is ABSENT_FACT:
        out.pop()
    if len(facts) > found and (len(facts) > len(codebook) or not _NAMES[codebook].issuperset(facts)):
        names = _NAMES[codebook]
        for n in facts:
            if type(n) is not str:
                raise EventValidationError(f"a fact's name is a {type(n).__name__}")
        out.append({n: fact(f) for n, f in facts.items() if n not in names})
    return out


def in_units(f: Fact, unit: int) -> Any:
    """A fact at a position with a unit (format 2)."""
    if type(f) is Known:
        v: Any = f.value
        t = type(v)
        if t is int:
            if unit > 0 and not v & ((1 << unit) - 1):
                return v >> unit
            return [VERBATIM, v]
        if t is float and unit == MILLI and -_MILLI_RANGE < v < _MILLI_RANGE:
            m = round(v * 1000)
            # -0.0 stays a float: 0 would come back as 0.0
            if m / 1000 == v and (m or math.copysign(1.0, v) > 0):
                return m
    return fact(f)


# Of each codebook with units: its names, their units and the masks of the bits a whole number
# of a unit of bytes has clear.
Layout: TypeAlias = tuple[tuple[str, int, int], ...]


def _layout(codebook: Sequence[str], units: Sequence[int]) -> Layout:
    return tuple((n, u, (1 << u) - 1 if u > 0 else 0) for n, u in zip(codebook, units, strict=True))


GPU_LAYOUT_2 = _layout(GPU_TELEMETRY_1, GPU_UNITS_2)
HOST_LAYOUT_2 = _layout(HOST_TELEMETRY_1, HOST_UNITS_2)
# Format 4's GPU codebook: format 2's names and units, those a node's GPUs most often share last
# (each GPU after the first refers to the first's values from where they are the same). Frozen
# with GPU_TELEMETRY_1 (the pinned bodies of tests/test_compact.py hold both).
_SHARED_LAST_4 = ("fan_speed_percent", "clock_memory_mhz", "memory_total_bytes", "performance_state")
GPU_TELEMETRY_4: tuple[str, ...] = (
    *(n for n in GPU_TELEMETRY_1 if n not in _SHARED_LAST_4),
    *_SHARED_LAST_4,
)
GPU_UNITS_4: tuple[int, ...] = tuple(GPU_UNITS_2[GPU_TELEMETRY_1.index(n)] for n in GPU_TELEMETRY_4)
GPU_LAYOUT_4 = _layout(GPU_TELEMETRY_4, GPU_UNITS_4)
GPU_GROUP_2 = (GPU_TELEMETRY_1, GPU_LAYOUT_2)
GPU_GROUP_4 = (GPU_TELEMETRY_4, GPU_LAYOUT_4)
_NAMES[GPU_TELEMETRY_4] = frozenset(GPU_TELEMETRY_4)
POSITIONS[GPU_TELEMETRY_4] = {n: i for i, n in enumerate(GPU_TELEMETRY_4)}


def _group_2(facts: Mapping[str, Fact], codebook: Sequence[str], layout: Layout) -> Dense:
    """`group` with units (`in_units`, inlined for the common cases: it runs on every report)."""
    out: Dense = []
    append = out.append
    get = facts.get
    absent = 0
    for n, unit, mask in layout:
        f = get(n)
        if type(f) is Known:
            v: Any = f.value
            t = type(v)
            if unit == NONE:
                append(v if t in _SCALARS else fact(f))
            elif mask and t is int and not v & mask:
                append(v >> unit)
            elif (
                unit == MILLI
                and t is float
                and -_MILLI_RANGE < v < _MILLI_RANGE
                and (k := round(v * 1000))
                and k / 1000 == v
            ):
                append(k)
            else:
                append(in_units(f, unit))
        elif f is None:
            append(ABSENT_FACT)
            absent += 1
        else:
            append(fact(f))
    return _closed(out, facts, codebook, len(layout) - absent)


def as_id(value: str, pattern: re.Pattern[str], prefix: int) -> str | bytes:
    """A canonical UUID string as its 16 bytes (after `prefix` characters), anything else as is."""
    if pattern.fullmatch(value):
        return bytes.fromhex(value[prefix:].replace("-", ""))
    return value


# Cached: every report of a node has its GPUs' UUIDs again; the cache holds a 10,000-node fleet
# of eight-GPU nodes.
@lru_cache(maxsize=131_072)
def gpu_id(gpu_uuid: str) -> str | bytes:
    """A GPU UUID as a compact body holds it."""
    return as_id(gpu_uuid, _GPU_UUID, 4)


def health(h: AcceleratorHealthSignals) -> Dense:
    out: Dense = [
        group(h.clock_event_reasons, CLOCK_EVENT_REASONS_1),
        fact(h.ecc_mode),
        group(h.ecc_errors, ECC_COUNTERS_1),
        group(h.remapped_rows, REMAPPED_ROWS_1),
        group(h.retired_pages, RETIRED_PAGES_1),
        fact(h.pcie_replay_count),
        fact(h.xid_events),
    ]
    if h.xids:
        out.append([[x.code, x.at] for x in h.xids])
    return out


def report_sha256(sha: str | None) -> str | bytes | None:
    return bytes.fromhex(sha) if sha is not None and _SHA256.fullmatch(sha) else sha


def _after(first: datetime, at: datetime | None) -> datetime | int | None:
    """A time as microseconds after the metadata's first, where it has a zone."""
    if type(at) is datetime and at.utcoffset() is not None:
        return (at - first) // _MICROSECOND
    return at


# Cached: a node reports with one credential at a time.
@lru_cache(maxsize=16_384)
def _actor(actor: str) -> str | bytes:
    return bytes.fromhex(actor[len(CREDENTIAL_PREFIX) :]) if _CREDENTIAL.fullmatch(actor) else actor


def _coded(value: str | None, codes: dict[str, int]) -> str | int | None:
    return value if value is None else codes.get(value, value)


_SOURCE_CODES = {s: i for i, s in enumerate(SOURCES_2)}
_STREAM_CODES = {s: i for i, s in enumerate(STREAMS_2)}


def _metadata_2(m: EventMetadata) -> Dense:
    received, observed = m.received_at, m.observed_at
    if type(received) is not datetime or received.utcoffset() is None:
        raise EventValidationError("metadata: received_at is not a time with a zone")
    # The observed time first where it has a zone (what a history reads), the received one after it
    second: datetime | int | None
    if type(observed) is datetime and observed.utcoffset() is not None:
        first, second = observed, (received - observed) // _MICROSECOND
    else:
        first, second = received, observed
    actor = m.actor
    out: Dense = [
        first,
        _coded(m.source, _SOURCE_CODES),
        second,
        _coded(m.agent_stream, _STREAM_CODES),
        m.agent_sequence,
        _after(first, m.agent_sent_at),
        report_sha256(m.agent_report_sha256),
        m.agent_sequence_gap,
        None if actor is None else _actor(actor),
        m.correlation_id,
    ]
    while out and out[-1] is None:
        out.pop()
    return out


def _accelerator_2(
    a: AcceleratorSample, node_id: str, gpus: GpuSet | None, group: tuple[Sequence[str], Layout]
) -> Dense:
    out: Dense = [
        gpu_id(a.uuid) if gpus is None else gpus.index[a.uuid],
        _group_2(a.telemetry, *group),
        None if a.health is None else health(a.health),
    ]
    if a.accelerator_id != accelerator_id_for(node_id, a.uuid):
        out.append(as_id(a.accelerator_id, _UUID, 0))
    elif out[2] is None:
        out.pop()
    return out


def _payload_2(p: NodeTelemetryObserved, node_id: str, gpus: GpuSet | None, form: int) -> Dense:
    layout = GPU_GROUP_4 if form == FORMAT_4 else GPU_GROUP_2
    accelerators = [_accelerator_2(a, node_id, gpus, layout) for a in p.accelerators]
    if form == FORMAT_4 and len(accelerators) > 1:
        _refer_to_first(accelerators)
    return [
        _group_2(p.telemetry, HOST_TELEMETRY_1, HOST_LAYOUT_2),
        [
            [s.mount, in_units(s.used_bytes, STORAGE_UNIT_2), in_units(s.total_bytes, STORAGE_UNIT_2)]
            for s in p.storage
        ],
        accelerators,
    ]


# Format 4's reference to the first GPU: an empty array, which no fact is.
AS_FIRST: Dense = []


# Types whose equal values of the same type are stored alike (bool is a type of its own).
_STORED_AS_EQUAL = frozenset({int, str})


def _same(v: Any, first: Any) -> bool:
    """Whether `v` is stored as `first` is (the same type and value, -0.0 told from 0.0)."""
    if v is first:  # one object (an int, or the shared unsupported and absent facts) is stored one way
        return True
    t = type(v)
    if t is not type(first):
        return False
    if t is float:
        return v == first and math.copysign(1.0, v) == math.copysign(1.0, first)
    if t is list or t is dict:
        return bool(ENCODER.encode(v) == ENCODER.encode(first))
    return bool(v == first)


def _refer_to_first(entries: list[Dense]) -> None:
    """Format 4: in the entries after the first, the telemetry values from where they are the
    first entry's to the end as one reference, and health that is the first entry's as one."""
    first = entries[0]
    values = first[1]
    n = len(values)
    signals = first[2] if len(first) > 2 else None
    packed = None if signals is None else ENCODER.encode(signals)
    for entry in entries[1:]:
        telemetry = entry[1]
        if len(telemetry) == n:
            i = n
            while i > 0:
                v, f = telemetry[i - 1], values[i - 1]
                # `_same`, its commonest answers first (it runs for most values of every report)
                if v is f or (type(v) is type(f) and type(v) in _STORED_AS_EQUAL and v == f) or _same(v, f):
                    i -= 1
                else:
                    break
            # worth it where the rest takes more than the reference's byte
            if n - i > 1 or (n - i == 1 and len(ENCODER.encode(telemetry[i])) > 1):
                del telemetry[i:]
                telemetry.append(AS_FIRST)
        if (
            packed is not None
            and len(entry) > 2
            and entry[2] is not None
            and ENCODER.encode(entry[2]) == packed
        ):
            entry[2] = AS_FIRST


def encode_body(
    payload: EventPayload, metadata: EventMetadata, stream_id: str, gpus: GpuSet | None = None
) -> tuple[bytes, EventPayload, EventMetadata]:
    """The stored body of an event of stream `stream_id` (a node's: its id), and the payload and
    metadata the log gives back for it: the ones given, which the body holds exactly
    (tests/test_compact.py proves the round trip over arbitrary snapshots; times come back in
    UTC, the same instants). Format 4 with `gpus`, the snapshot's GPU set (`gpu_set`) as stored,
    else format 2. Decoding the body again here would cost an append more than the encoding
    itself."""
    return encode_body_of(FORMAT_2 if gpus is None else FORMAT_4, payload, metadata, stream_id, gpus)


def encode_body_of(
    form: int, payload: EventPayload, metadata: EventMetadata, stream_id: str, gpus: GpuSet | None
) -> tuple[bytes, EventPayload, EventMetadata]:
    """`encode_body` in format 2, 3 or 4 (3 and 4 need `gpus`; a snapshot they cannot hold is
    written in format 2). Every release reads the formats earlier ones wrote: the upgrade tests
    write them with this."""
    if not isinstance(payload, NodeTelemetryObserved):
        raise EventValidationError(f"{type(payload).__name__} is not stored compact")
    if form not in (FORMAT_2, FORMAT_3, FORMAT_4):
        raise ValueError(f"format {form} is not written by this release")
    if form == FORMAT_2 or (gpus is not None and len(payload.accelerators) != len(gpus.index)):
        gpus = None  # a GPU listed twice (or a set of other GPUs): a set's formats list each GPU once
    if gpus is None:
        form = FORMAT_2
    try:
        body = ENCODER.encode(
            [
                form,
                _metadata_2(metadata),
                _payload_2(payload, stream_id, gpus, form),
            ]
        )
    except (msgspec.EncodeError, TypeError, AttributeError, ValueError, OverflowError) as exc:
        if isinstance(exc, EventValidationError):
            raise
        raise EventValidationError(f"{type(payload).__name__}: {exc}") from exc
    return body, payload, metadata


class GpuSet(msgspec.Struct, frozen=True):
    """The GPUs a snapshot samples: their UUIDs distinct, in byte order, `joined` by ',' (what
    `sampled`, the md5 of it as a uuid, digests), and each UUID's index among them. Format 3
    lists a GPU by that index; the set is stored once (ledger/gpu_sets.py)."""

    sampled: uuid.UUID
    joined: str
    index: dict[str, int]
    # Whether format 3 can name it: some GPUs, none with a ',' (the separator) or a NUL (which
    # PostgreSQL text cannot hold) in its UUID.
    storable: bool


# Cached: a node's snapshots sample the same GPUs report after report.
@lru_cache(maxsize=16_384)
def _gpu_set(joined: str, count: int) -> GpuSet:
    digest = uuid.UUID(bytes=hashlib.md5(joined.encode(), usedforsecurity=False).digest())
    parts = joined.split(",")
    storable = count > 0 and len(parts) == count and "\x00" not in joined
    return GpuSet(digest, joined, {u: i for i, u in enumerate(parts)} if storable else {}, storable)


def gpu_set(payload: NodeTelemetryObserved) -> GpuSet:
    """The set of GPUs a snapshot samples."""
    distinct = sorted({a.uuid for a in payload.accelerators})
    return _gpu_set(",".join(distinct), len(distinct))


def sampled_digest(payload: EventPayload) -> uuid.UUID | None:
    """Of a node's telemetry snapshot, the digest of the GPUs it samples, as mf_sampled computes
    it from a jsonb snapshot (ledger/sql/functions/mf_sampled.sql); None for any other event."""
    if not isinstance(payload, NodeTelemetryObserved):
        return None
    return gpu_set(payload).sampled
