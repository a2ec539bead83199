"""The wire protocol between the compute-node agent and the central API (docs/NODE_AGENT_PROTOCOL.md).

Both sides use these Structs: the agent encodes them, the server decodes and validates them with
the same types, so the contract cannot drift between the two.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from types import UnionType
from typing import Annotated, Any, Generic, Literal, TypeAlias, TypeVar, Union, get_args, get_origin

import msgspec

from collectors.contract import (
    ACCELERATOR_METRIC_TYPES,
    HOST_METRIC_TYPES,
    MAX_ACCELERATORS,
    MAX_CLOCK_EVENT_REASONS,
    MAX_COLLECTORS,
    MAX_DURATION_SECONDS,
    MAX_HEALTH_COUNTERS,
    MAX_HOSTNAME,
    MAX_IDENTITY,
    MAX_MOUNTS,
    MAX_SEQUENCE,
    MAX_XIDS,
    NUL_FREE,
    AwareDatetime,
    Count,
    CountOrFlag,
    EccMode,
    ErrorCount,
    GpuIndex,
    GpuUuid,
    Hostname,
    MemoryBytes,
    MigMode,
    ObservedShortText,
    ShortText,
    StorageBytes,
    Text,
    XidCode,
    without_nul_pattern,
)
from collectors.observations import HardwareObservation

PROTOCOL_VERSION = 1

# The report streams. Each has its own sequence. Every report carries a full observation (the
# server reconciles it through the one code path); the stream says why it was sent:
#   inventory: at agent start, when the inventory facts changed, and every N reports;
#   telemetry: the periodic heartbeat in between. A full spool drops telemetry first.
STREAMS: tuple[str, ...] = ("inventory", "telemetry")
Stream: TypeAlias = Literal["inventory", "telemetry"]

ENROLL_PATH = "/api/v1/agent/enroll"
REPORTS_PATH = "/api/v1/agent/reports"
# The agent's clock when it sent this attempt (RFC 3339). Not in the body: a retry must be
# byte-identical to the first attempt, and the send time differs per attempt.
SENT_AT_HEADER = "Modelforge-Agent-Sent-At"


def sent_at_of(value: str | None) -> datetime | None:
    """The send time a SENT_AT_HEADER value says; None when absent or malformed (advisory only:
    a malformed clock reading does not cost the report)."""
    if not value:
        return None
    try:  # read on every report: a try costs a third of contextlib.suppress here
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


ENROLLMENT_TOKEN_PREFIX = "mfe"
CREDENTIAL_PREFIX = "mfc"

# --- the bounds of the wire contract (docs/NODE_AGENT_PROTOCOL.md, section 6 "Bounds"), with those
# of the observation's values (collectors/contract.py) ----------------------------------------------
# Times: years 2000 to 2100 and a UTC offset PostgreSQL accepts (under 16 hours).
EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
LATEST = datetime(2101, 1, 1, tzinfo=UTC)
MAX_UTC_OFFSET = timedelta(hours=16)

IdentityKey: TypeAlias = Annotated[str, msgspec.Meta(pattern=NUL_FREE, min_length=1, max_length=MAX_IDENTITY)]
IdentitySource: TypeAlias = Literal["configured", "state_file", "machine_id"]
Sequence: TypeAlias = Annotated[int, msgspec.Meta(ge=1, le=MAX_SEQUENCE)]


class EnrollRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """POST /api/v1/agent/enroll, with `Authorization: Bearer <enrollment token>`."""

    identity_key: IdentityKey
    identity_source: IdentitySource
    # Not blank (the server refuses a hostname that strips to nothing), no NUL.
    hostname: Annotated[str, msgspec.Meta(pattern=r"\A[^\x00]*[^\x00\s][^\x00]*\Z", max_length=MAX_HOSTNAME)]
    agent_version: ShortText = ""


class EnrollResponse(msgspec.Struct, frozen=True):
    """The node credential, shown once. `streams`: the last accepted sequence per stream, so an
    agent that lost its state directory continues above them instead of being refused."""

    node_id: str
    identity_key: str
    credential_id: str
    credential: str
    streams: dict[str, int]
    superseded_credentials: list[str] = []


class Report(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """POST /api/v1/agent/reports, with `Authorization: Bearer <node credential>`."""

    protocol: int
    node_id: ObservedShortText
    identity_key: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_IDENTITY)]
    identity_source: IdentitySource
    stream: ObservedShortText
    sequence: Sequence
    observed_at: AwareDatetime  # the agent's clock when it observed
    observation: HardwareObservation


class ReportAck(msgspec.Struct, frozen=True):
    """200: `accepted` (appended) or `duplicate` (an unchanged retry of an accepted report;
    nothing appended). `gap`: sequences skipped since the previous accepted one."""

    status: Literal["accepted", "duplicate"]
    node_id: str
    stream: str
    sequence: int
    previous_sequence: int | None
    gap: int
    received_at: datetime
    events: int
    lifecycle_events: list[str] = []


# --- the wire contract of an observation: typed per fact and per metric -------------------------------
# Report.observation is decoded into the collectors' HardwareObservation (what the server
# reconciles), whose fields carry the same bounds (collectors/contract.py). These mirror Structs
# publish the contract (the OpenAPI document's schema), check what an agent is about to send, and
# answer every body decode_report refuses, in their words, so a value outside the contract never
# reaches the ledger. What they decode is dropped as soon as that check is done, trees nothing
# refers back into: untracked by the garbage collector (gc=False), as the observations are.

T = TypeVar("T")


class _Known(msgspec.Struct, Generic[T], frozen=True, tag_field="state", tag="known", gc=False):
    value: T


class _Unknown(msgspec.Struct, frozen=True, tag_field="state", tag="unknown", gc=False):
    pass


class _Unsupported(msgspec.Struct, frozen=True, tag_field="state", tag="unsupported", gc=False):
    pass


class _Unavailable(msgspec.Struct, frozen=True, tag_field="state", tag="unavailable", gc=False):
    reason: Text


class _TemporarilyFailed(msgspec.Struct, frozen=True, tag_field="state", tag="temporarily_failed", gc=False):
    reason: Text


def _fact_of(value_type: Any) -> Any:
    return _Known[value_type] | _Unknown | _Unsupported | _Unavailable | _TemporarilyFailed


def _telemetry_struct(name: str, metrics: dict[str, Any]) -> Any:
    return msgspec.defstruct(
        name,
        [
            (metric, _fact_of(value_type) | msgspec.UnsetType, msgspec.UNSET)
            for metric, value_type in metrics.items()
        ],
        frozen=True,
        forbid_unknown_fields=True,
        gc=False,
    )


_HostTelemetry = _telemetry_struct("HostTelemetry", HOST_METRIC_TYPES)
_AcceleratorTelemetry = _telemetry_struct("AcceleratorTelemetry", ACCELERATOR_METRIC_TYPES)


class _OsInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    name: _fact_of(Text)  # type: ignore[valid-type]
    version: _fact_of(Text)  # type: ignore[valid-type]
    kernel: _fact_of(Text)  # type: ignore[valid-type]
    architecture: _fact_of(Text)  # type: ignore[valid-type]


class _CpuInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    model: _fact_of(Text)  # type: ignore[valid-type]
    sockets: _fact_of(Count)  # type: ignore[valid-type]
    physical_cores: _fact_of(Count)  # type: ignore[valid-type]
    logical_cores: _fact_of(Count)  # type: ignore[valid-type]


class _Storage(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    mount: Text
    used_bytes: _fact_of(StorageBytes)  # type: ignore[valid-type]
    total_bytes: _fact_of(StorageBytes)  # type: ignore[valid-type]


class _Host(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    hostname: Hostname
    os: _OsInfo
    cpu: _CpuInfo
    memory_total_bytes: _fact_of(MemoryBytes)  # type: ignore[valid-type]
    telemetry: _HostTelemetry  # type: ignore[valid-type]
    storage: Annotated[list[_Storage], msgspec.Meta(max_length=MAX_MOUNTS)]


class _XidOccurrence(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    code: XidCode
    at: AwareDatetime


Xids: TypeAlias = Annotated[list[_XidOccurrence], msgspec.Meta(max_length=MAX_XIDS)]


class _HealthSignals(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    clock_event_reasons: Annotated[
        dict[ShortText, _fact_of(bool)],  # type: ignore[valid-type]
        msgspec.Meta(max_length=MAX_CLOCK_EVENT_REASONS),
    ]
    ecc_mode: _fact_of(EccMode)  # type: ignore[valid-type]
    ecc_errors: Annotated[
        dict[ShortText, _fact_of(ErrorCount)],  # type: ignore[valid-type]
        msgspec.Meta(max_length=MAX_HEALTH_COUNTERS),
    ]
    remapped_rows: Annotated[
        dict[ShortText, _fact_of(CountOrFlag)],  # type: ignore[valid-type]
        msgspec.Meta(max_length=MAX_HEALTH_COUNTERS),
    ]
    retired_pages: Annotated[
        dict[ShortText, _fact_of(CountOrFlag)],  # type: ignore[valid-type]
        msgspec.Meta(max_length=MAX_HEALTH_COUNTERS),
    ]
    pcie_replay_count: _fact_of(ErrorCount)  # type: ignore[valid-type]
    xid_events: _fact_of(bool)  # type: ignore[valid-type]
    xids: Xids = []


class _Accelerator(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    uuid: GpuUuid
    index: _fact_of(GpuIndex)  # type: ignore[valid-type]
    name: _fact_of(Text)  # type: ignore[valid-type]
    pci_bus_id: _fact_of(Text)  # type: ignore[valid-type]
    memory_total_bytes: _fact_of(MemoryBytes)  # type: ignore[valid-type]
    compute_capability: _fact_of(ShortText)  # type: ignore[valid-type]
    mig_mode: _fact_of(MigMode)  # type: ignore[valid-type]
    telemetry: _AcceleratorTelemetry  # type: ignore[valid-type]
    health: _HealthSignals | None = None


class _Nvml(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    status: Literal["complete", "incomplete", "unavailable"]
    reason: Text | None
    driver_version: _fact_of(ShortText)  # type: ignore[valid-type]
    cuda_driver_version: _fact_of(ShortText)  # type: ignore[valid-type]
    accelerators: Annotated[list[_Accelerator], msgspec.Meta(max_length=MAX_ACCELERATORS)]
    unlisted_xids: Annotated[dict[GpuUuid, Xids], msgspec.Meta(max_length=MAX_ACCELERATORS)] = {}


class _CollectorRun(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    collector: ShortText
    ok: bool
    duration_seconds: Annotated[float, msgspec.Meta(ge=0, le=MAX_DURATION_SECONDS)]
    error: Text | None = None


class _Observation(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    observed_at: AwareDatetime
    host: _Host
    nvml: _Nvml
    collectors: Annotated[list[_CollectorRun], msgspec.Meta(max_length=MAX_COLLECTORS)] = []


class _Report(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    protocol: int
    node_id: ShortText
    identity_key: IdentityKey
    identity_source: IdentitySource
    stream: ShortText
    sequence: Sequence
    observed_at: AwareDatetime
    observation: _Observation


# What a report may look like on the wire (the API's OpenAPI document publishes its schema), and
# the observation inside it (the agent checks what it is about to send against it).
WIRE_REPORT = _Report
WIRE_OBSERVATION = _Observation
_wire_report_decoder = msgspec.json.Decoder(_Report)
_report_decoder = msgspec.json.Decoder(Report)


# --- the same contract without the NUL patterns, for a body that cannot hold a NUL -------------------
# Every string of the wire types refuses a NUL by a regex, checked string by string (a fifth of
# the report's decode). A decoded string can only hold a NUL that the body wrote as a raw byte or as
# the escape `\u0000`; a body with neither passes every one of those patterns, so its decode
# against the same Structs with the patterns left out refuses exactly what the full one refuses,
# with the same words. Any other body is decoded against the full types.

_NUL_FREE_TWINS: dict[Any, Any] = {}


def _default(f: msgspec.structs.FieldInfo) -> Any:
    if f.default_factory is not msgspec.NODEFAULT:
        return msgspec.field(default_factory=f.default_factory)
    return f.default  # NODEFAULT: required


def _without_nul_patterns(t: Any) -> Any:
    """`t` with every `NUL_FREE` pattern left out (its Structs rebuilt, the rest as it is)."""
    if t in _NUL_FREE_TWINS:
        return _NUL_FREE_TWINS[t]
    origin, args = get_origin(t), get_args(t)
    twin: Any
    if origin is Annotated:
        base, *metas = get_args(without_nul_pattern(t))
        twin = Annotated[(_without_nul_patterns(base), *metas)]
    elif isinstance(origin or t, type) and issubclass(origin or t, msgspec.Struct):
        config = (origin or t).__struct_config__
        twin = msgspec.defstruct(
            (origin or t).__name__,
            [(f.name, _without_nul_patterns(f.type), _default(f)) for f in msgspec.structs.fields(t)],
            frozen=config.frozen,
            forbid_unknown_fields=config.forbid_unknown_fields,
            tag_field=config.tag_field,
            tag=config.tag,
            gc=config.gc,
        )
    elif origin is Union or origin is UnionType:
        twin = Union[tuple(_without_nul_patterns(a) for a in args)]  # noqa: UP007 - built from a tuple
    elif origin in (list, dict):
        twin = origin[tuple(_without_nul_patterns(a) for a in args)]
    else:
        twin = t
    _NUL_FREE_TWINS[t] = twin
    return twin


_nul_free_report_decoder = msgspec.json.Decoder(_without_nul_patterns(_Report))
_encoder = msgspec.json.Encoder()


def encode_report(report: Report) -> bytes:
    return _encoder.encode(report)


def time_problem(moment: datetime) -> str | None:
    """Why a time is outside the contract's range, or None."""
    offset = moment.utcoffset()
    if offset is None:
        return "a time needs a UTC offset"
    if abs(offset) >= MAX_UTC_OFFSET:
        minutes = int(abs(offset).total_seconds()) // 60
        sign = "-" if offset < timedelta(0) else "+"
        return f"the UTC offset {sign}{minutes // 60:02d}:{minutes % 60:02d} is beyond ±15:59"
    if not EARLIEST <= moment < LATEST:
        return "a time must lie in the years 2000 to 2100"
    return None


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> int:
    if len(pairs) > 1 and len({key for key, _ in pairs}) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise msgspec.ValidationError(f"the key {key[:64]!r} appears twice in one object")
            seen.add(key)
    return 0  # nothing is kept: this pass only looks at the keys


def refuse_duplicate_keys(raw: bytes) -> None:
    """msgspec keeps the last of duplicate keys without a word (upstream:
    https://github.com/msgspec/msgspec/issues/648), so a body could mean one thing to us and another
    to any other reader. The standard library's parser hands each object's key list to a hook;
    this runs only on a body that already decoded into the typed Structs, so its size and depth
    are bounded by the schema."""
    try:
        json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except msgspec.ValidationError:
        raise
    except ValueError as exc:  # cannot happen after msgspec accepted the body; be safe anyway
        raise msgspec.DecodeError(str(exc)) from exc


def decode_report(raw: bytes) -> Report:
    """Raises msgspec.DecodeError (malformed JSON) or msgspec.ValidationError (outside the
    contract: wrong shape, a value out of bounds, a NUL in a string, a duplicate key)."""
    # An escaped NUL needs a backslash, which most bodies lack: one memchr spares the search.
    may_hold_nul = b"\x00" in raw or (b"\\" in raw and b"\\u0000" in raw)
    if not may_hold_nul:
        # The observation's Structs carry every bound of the wire's but the NUL patterns
        # (collectors/contract.py), so one decode yields the report and checks it. An agent's
        # body is msgspec's encoding of a Report: when encoding the decoded report gives the
        # same bytes back, nothing of the body was left out of the decode (an unknown metric, a
        # duplicate key: the encoding has neither). Any other body, and any refusal, goes the
        # whole way below, whose answer is the wire types' and the full duplicate-key check's.
        try:
            report = _report_decoder.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass
        else:
            if (
                _times_within(report.observed_at, report.observation.observed_at)
                and _encoder.encode(report) == raw
            ):
                return report
    wire = (_wire_report_decoder if may_hold_nul else _nul_free_report_decoder).decode(raw)
    for where, moment in (
        ("$.observed_at", wire.observed_at),
        ("$.observation.observed_at", wire.observation.observed_at),
    ):
        problem = time_problem(moment)
        if problem is not None:
            raise msgspec.ValidationError(f"{problem} - at `{where}`")
    report = _report_decoder.decode(raw)
    if _encoder.encode(report) != raw:
        refuse_duplicate_keys(raw)
    return report


def _times_within(*moments: datetime) -> bool:
    return all(time_problem(m) is None for m in moments)


def observation_problems_after_decode(obs: HardwareObservation) -> list[str]:
    """What the wire types cannot say about an observation that decode_report accepted (empty:
    valid): every value's type and bound was decided by that decode, so only what relates
    values remains. The agent's full check before it sends is `agent.sanitize.validate_observation`."""
    uuids = [a.uuid for a in obs.nvml.accelerators]
    if len(set(uuids)) != len(uuids):
        return ["nvml.accelerators: the same GPU UUID appears twice"]
    return []
