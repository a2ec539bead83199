"""The wire protocol between the compute-node agent and the central API (docs/NODE_AGENT_PROTOCOL.md).

Both sides use these Structs: the agent encodes them, the server decodes and validates them with
the same types, so the contract cannot drift between the two.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Generic, Literal, TypeAlias, TypeVar

import msgspec

from collectors.facts import Fact, Known, TemporarilyFailed, Unavailable
from collectors.observations import (
    ACCELERATOR_INVENTORY_FACTS,
    AcceleratorObservation,
    CollectorRun,
    HardwareObservation,
    HostObservation,
    StorageObservation,
)

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

ENROLLMENT_TOKEN_PREFIX = "mfe"
CREDENTIAL_PREFIX = "mfc"

# --- the bounds of the wire contract (docs/NODE_AGENT_PROTOCOL.md, section 6 "Bounds") ---------------
# Every integer a JSON consumer may read stays within 2^53, where every JSON implementation
# (JavaScript's included) is still exact.
MAX_SEQUENCE = 2**53 - 1
MAX_HOSTNAME = 255
MAX_STRING = 1024
MAX_SHORT = 64
MAX_IDENTITY = 256  # the key itself is at most 128 characters once trimmed (collectors.identity)
MAX_ACCELERATORS = 256
MAX_MOUNTS = 64
MAX_COLLECTORS = 16
MAX_MEMORY_BYTES = 2**53  # 8 PiB: far beyond any host's or GPU's memory
MAX_STORAGE_BYTES = 2**60  # 1 EiB: a parallel filesystem mounted on a node can pass 2^53
MAX_COUNT = 2**20  # CPU sockets and cores
MAX_CELSIUS = 200.0
MIN_CELSIUS = -50.0
MAX_WATTS = 10_000.0  # one device; today's largest draw about 1.2 kW
MAX_MHZ = 100_000
MAX_FAN_PERCENT = 200  # NVML: a fan "may exceed 100%" of its rated speed
MAX_DURATION_SECONDS = 86_400.0
# Times: years 2000 to 2100 and a UTC offset PostgreSQL accepts (under 16 hours).
EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
LATEST = datetime(2101, 1, 1, tzinfo=UTC)
MAX_UTC_OFFSET = timedelta(hours=16)

# PostgreSQL refuses NUL in text and jsonb, so no string on the wire may carry one.
NUL_FREE = r"\A[^\x00]*\Z"
Text: TypeAlias = Annotated[str, msgspec.Meta(pattern=NUL_FREE, max_length=MAX_STRING)]
ShortText: TypeAlias = Annotated[str, msgspec.Meta(pattern=NUL_FREE, max_length=MAX_SHORT)]
Hostname: TypeAlias = Annotated[str, msgspec.Meta(pattern=NUL_FREE, min_length=1, max_length=MAX_HOSTNAME)]
IdentityKey: TypeAlias = Annotated[str, msgspec.Meta(pattern=NUL_FREE, min_length=1, max_length=MAX_IDENTITY)]
GpuUuid: TypeAlias = Annotated[str, msgspec.Meta(pattern=NUL_FREE, min_length=1, max_length=128)]

IdentitySource: TypeAlias = Literal["configured", "state_file", "machine_id"]
Sequence: TypeAlias = Annotated[int, msgspec.Meta(ge=1, le=MAX_SEQUENCE)]
AwareDatetime: TypeAlias = Annotated[datetime, msgspec.Meta(tz=True)]


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


class Report(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """POST /api/v1/agent/reports, with `Authorization: Bearer <node credential>`."""

    protocol: int
    node_id: str
    identity_key: str
    identity_source: IdentitySource
    stream: str
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
# reconciles); these mirror Structs say what its values may be. decode_report checks a body
# against them first, so a value outside the contract never reaches the ledger.

T = TypeVar("T")


class _Known(msgspec.Struct, Generic[T], frozen=True, tag_field="state", tag="known"):
    value: T


class _Unknown(msgspec.Struct, frozen=True, tag_field="state", tag="unknown"):
    pass


class _Unsupported(msgspec.Struct, frozen=True, tag_field="state", tag="unsupported"):
    pass


class _Unavailable(msgspec.Struct, frozen=True, tag_field="state", tag="unavailable"):
    reason: Text


class _TemporarilyFailed(msgspec.Struct, frozen=True, tag_field="state", tag="temporarily_failed"):
    reason: Text


# The value types a known fact may have. msgspec's strict decoding refuses a bool where an int
# is meant and a string where a number is meant.
MemoryBytes: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=MAX_MEMORY_BYTES)]
StorageBytes: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=MAX_STORAGE_BYTES)]
Count: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
GpuIndex: TypeAlias = Annotated[int, msgspec.Meta(ge=0, lt=MAX_ACCELERATORS)]
Percent: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=100)] | Annotated[float, msgspec.Meta(ge=0, le=100)]
FanPercent: TypeAlias = (
    Annotated[int, msgspec.Meta(ge=0, le=MAX_FAN_PERCENT)]
    | Annotated[float, msgspec.Meta(ge=0, le=MAX_FAN_PERCENT)]
)
Celsius: TypeAlias = (
    Annotated[int, msgspec.Meta(ge=int(MIN_CELSIUS), le=int(MAX_CELSIUS))]
    | Annotated[float, msgspec.Meta(ge=MIN_CELSIUS, le=MAX_CELSIUS)]
)
Watts: TypeAlias = (
    Annotated[int, msgspec.Meta(ge=0, le=int(MAX_WATTS))] | Annotated[float, msgspec.Meta(ge=0, le=MAX_WATTS)]
)
Mhz: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=MAX_MHZ)]
PerformanceState: TypeAlias = Annotated[str, msgspec.Meta(pattern=r"\AP([0-9]|1[0-5])\Z")]
MigMode: TypeAlias = Literal["enabled", "disabled"]

# Every metric the protocol knows, with the type of its value. A name not listed is refused.
HOST_METRIC_TYPES: dict[str, Any] = {
    "memory_available_bytes": MemoryBytes,
    "memory_total_bytes": MemoryBytes,
}
ACCELERATOR_METRIC_TYPES: dict[str, Any] = {
    "memory_used_bytes": MemoryBytes,
    "memory_total_bytes": MemoryBytes,
    "utilization_gpu_percent": Percent,
    "utilization_memory_percent": Percent,
    "temperature_celsius": Celsius,
    "power_watts": Watts,
    "clock_graphics_mhz": Mhz,
    "clock_sm_mhz": Mhz,
    "clock_memory_mhz": Mhz,
    "fan_speed_percent": FanPercent,
    "performance_state": PerformanceState,
}


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
    )


_HostTelemetry = _telemetry_struct("HostTelemetry", HOST_METRIC_TYPES)
_AcceleratorTelemetry = _telemetry_struct("AcceleratorTelemetry", ACCELERATOR_METRIC_TYPES)


class _OsInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: _fact_of(Text)  # type: ignore[valid-type]
    version: _fact_of(Text)  # type: ignore[valid-type]
    kernel: _fact_of(Text)  # type: ignore[valid-type]
    architecture: _fact_of(Text)  # type: ignore[valid-type]


class _CpuInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: _fact_of(Text)  # type: ignore[valid-type]
    sockets: _fact_of(Count)  # type: ignore[valid-type]
    physical_cores: _fact_of(Count)  # type: ignore[valid-type]
    logical_cores: _fact_of(Count)  # type: ignore[valid-type]


class _Storage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    mount: Text
    used_bytes: _fact_of(StorageBytes)  # type: ignore[valid-type]
    total_bytes: _fact_of(StorageBytes)  # type: ignore[valid-type]


class _Host(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    hostname: Hostname
    os: _OsInfo
    cpu: _CpuInfo
    memory_total_bytes: _fact_of(MemoryBytes)  # type: ignore[valid-type]
    telemetry: _HostTelemetry  # type: ignore[valid-type]
    storage: Annotated[list[_Storage], msgspec.Meta(max_length=MAX_MOUNTS)]


# GPU health signals (collectors/gpu_health.py, docs/gpu-health.md); optional, so reports of agents
# that do not collect them stay valid.
MAX_XIDS = 256  # per GPU per report: the collector drains at most this many per collection
ErrorCount: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # int64: msgspec bounds
CountOrFlag: TypeAlias = ErrorCount | bool


class _XidOccurrence(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    code: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
    at: AwareDatetime


Xids: TypeAlias = Annotated[list[_XidOccurrence], msgspec.Meta(max_length=MAX_XIDS)]


class _HealthSignals(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    clock_event_reasons: Annotated[dict[ShortText, _fact_of(bool)], msgspec.Meta(max_length=32)]  # type: ignore[valid-type]
    ecc_mode: _fact_of(Literal["enabled", "disabled"])  # type: ignore[valid-type]
    ecc_errors: Annotated[dict[ShortText, _fact_of(ErrorCount)], msgspec.Meta(max_length=8)]  # type: ignore[valid-type]
    remapped_rows: Annotated[dict[ShortText, _fact_of(CountOrFlag)], msgspec.Meta(max_length=8)]  # type: ignore[valid-type]
    retired_pages: Annotated[dict[ShortText, _fact_of(CountOrFlag)], msgspec.Meta(max_length=8)]  # type: ignore[valid-type]
    pcie_replay_count: _fact_of(ErrorCount)  # type: ignore[valid-type]
    xid_events: _fact_of(bool)  # type: ignore[valid-type]
    xids: Xids = []


class _Accelerator(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    uuid: GpuUuid
    index: _fact_of(GpuIndex)  # type: ignore[valid-type]
    name: _fact_of(Text)  # type: ignore[valid-type]
    pci_bus_id: _fact_of(Text)  # type: ignore[valid-type]
    memory_total_bytes: _fact_of(MemoryBytes)  # type: ignore[valid-type]
    compute_capability: _fact_of(ShortText)  # type: ignore[valid-type]
    mig_mode: _fact_of(MigMode)  # type: ignore[valid-type]
    telemetry: _AcceleratorTelemetry  # type: ignore[valid-type]
    health: _HealthSignals | None = None


class _Nvml(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    status: Literal["complete", "incomplete", "unavailable"]
    reason: Text | None
    driver_version: _fact_of(ShortText)  # type: ignore[valid-type]
    cuda_driver_version: _fact_of(ShortText)  # type: ignore[valid-type]
    accelerators: Annotated[list[_Accelerator], msgspec.Meta(max_length=MAX_ACCELERATORS)]
    unlisted_xids: Annotated[dict[GpuUuid, Xids], msgspec.Meta(max_length=MAX_ACCELERATORS)] = {}


class _CollectorRun(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    collector: ShortText
    ok: bool
    duration_seconds: Annotated[float, msgspec.Meta(ge=0, le=MAX_DURATION_SECONDS)]
    error: Text | None = None


class _Observation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    observed_at: AwareDatetime
    host: _Host
    nvml: _Nvml
    collectors: Annotated[list[_CollectorRun], msgspec.Meta(max_length=MAX_COLLECTORS)] = []


class _Report(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    protocol: int
    node_id: ShortText
    identity_key: IdentityKey
    identity_source: IdentitySource
    stream: ShortText
    sequence: Sequence
    observed_at: AwareDatetime
    observation: _Observation


# What a report may look like on the wire (the API's OpenAPI document publishes its schema).
WIRE_REPORT = _Report
_wire_report_decoder = msgspec.json.Decoder(_Report)
_wire_observation_decoder = msgspec.json.Decoder(_Observation)
_report_decoder = msgspec.json.Decoder(Report)
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
    """msgspec keeps the last of duplicate keys without a word (msgspec issue 648), so a body could
    mean one thing to us and another to any other reader. The standard library's parser hands
    each object's key list to a hook; this runs only on a body that already decoded into the
    typed Structs, so its size and depth are bounded by the schema."""
    try:
        json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except msgspec.ValidationError:
        raise
    except ValueError as exc:  # cannot happen after msgspec accepted the body; be safe anyway
        raise msgspec.DecodeError(str(exc)) from exc


def decode_report(raw: bytes) -> Report:
    """Raises msgspec.DecodeError (malformed JSON) or msgspec.ValidationError (outside the
    contract: wrong shape, a value out of bounds, a NUL in a string, a duplicate key)."""
    wire = _wire_report_decoder.decode(raw)
    for where, moment in (
        ("$.observed_at", wire.observed_at),
        ("$.observation.observed_at", wire.observation.observed_at),
    ):
        problem = time_problem(moment)
        if problem is not None:
            raise msgspec.ValidationError(f"{problem} - at `{where}`")
    report = _report_decoder.decode(raw)
    # An agent's body is msgspec's encoding of a Report: when encoding the decoded report gives
    # the same bytes back, the body cannot hold a duplicate key (the encoding has none), and the
    # full check (about four times the cost of both decodes) is spared. Any other body, a
    # duplicate's included, gets it.
    if _encoder.encode(report) != raw:
        refuse_duplicate_keys(raw)
    return report


def observation_problems_after_decode(obs: HardwareObservation) -> list[str]:
    """What the wire types cannot say about an observation that decode_report accepted (empty:
    valid): every value's type and bound was decided by that decode, so only what relates
    values remains. `validate_observation` is the agent's full check before it sends."""
    uuids = [a.uuid for a in obs.nvml.accelerators]
    if len(set(uuids)) != len(uuids):
        return ["nvml.accelerators: the same GPU UUID appears twice"]
    return []


# --- validation of an observation's values (both sides) ------------------------------------------


# The bound each accelerator inventory fact's value must hold (one entry per inventory fact).
ACCELERATOR_FACT_TYPES: dict[str, Any] = {
    "index": GpuIndex,
    "name": Text,
    "pci_bus_id": Text,
    "memory_total_bytes": MemoryBytes,
    "compute_capability": ShortText,
    "mig_mode": MigMode,
}
assert set(ACCELERATOR_FACT_TYPES) == set(ACCELERATOR_INVENTORY_FACTS)


def _named_facts(obs: HardwareObservation) -> Iterator[tuple[str, Fact, Any]]:
    """Every fact of an observation, where it is and the type its value must have."""
    host = obs.host
    for name in ("name", "version", "kernel", "architecture"):
        yield f"host.os.{name}", getattr(host.os, name), Text
    yield "host.cpu.model", host.cpu.model, Text
    for name in ("sockets", "physical_cores", "logical_cores"):
        yield f"host.cpu.{name}", getattr(host.cpu, name), Count
    yield "host.memory_total_bytes", host.memory_total_bytes, MemoryBytes
    for metric, fact in host.telemetry.items():
        if metric in HOST_METRIC_TYPES:
            yield f"host.telemetry.{metric}", fact, HOST_METRIC_TYPES[metric]
    for m in host.storage:
        yield f"host.storage[{m.mount!r}].used_bytes", m.used_bytes, StorageBytes
        yield f"host.storage[{m.mount!r}].total_bytes", m.total_bytes, StorageBytes
    yield "nvml.driver_version", obs.nvml.driver_version, ShortText
    yield "nvml.cuda_driver_version", obs.nvml.cuda_driver_version, ShortText
    for a in obs.nvml.accelerators:
        prefix = f"nvml.accelerators[{a.uuid!r}]"
        for name in ACCELERATOR_INVENTORY_FACTS:
            yield f"{prefix}.{name}", getattr(a, name), ACCELERATOR_FACT_TYPES[name]
        for metric, fact in a.telemetry.items():
            if metric in ACCELERATOR_METRIC_TYPES:
                yield f"{prefix}.telemetry.{metric}", fact, ACCELERATOR_METRIC_TYPES[metric]


def _convert_problem(value: Any, value_type: Any) -> str | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # e.g. a non-UTF-8 mount path that Python decoded with surrogateescape
            return "not valid UTF-8 (a lone surrogate)"
    try:
        msgspec.convert(value, value_type)
    except msgspec.ValidationError as exc:
        return f"{value!r:.80}: {exc}"
    return None


def fact_problem(fact: Fact, value_type: Any = None) -> str | None:
    """Why a fact is outside the contract, or None. `value_type`: what a known value must be."""
    if isinstance(fact, Known):
        return None if value_type is None else _convert_problem(fact.value, value_type)
    reason = getattr(fact, "reason", None)
    return None if reason is None else _convert_problem(reason, Text)


def _metric_names(where: str, telemetry: dict[str, Fact], known: dict[str, Any]) -> list[str]:
    return [f"{where}.{name[:64]!r}: not a metric of the protocol" for name in telemetry if name not in known]


def validate_observation(obs: HardwareObservation) -> list[str]:
    """Everything wrong with an observation (empty: valid). The server has already decoded the
    report against the wire types (decode_report); the agent checks what it is about to send."""
    uuids = [a.uuid for a in obs.nvml.accelerators]
    if len(set(uuids)) == len(uuids) and time_problem(obs.observed_at) is None:
        try:
            _wire_observation_decoder.decode(_encoder.encode(obs))
            return []  # the common case, in one pass; the walk below says what is wrong
        except (msgspec.ValidationError, UnicodeEncodeError):
            pass
    errors: list[str] = []
    host = obs.host
    problem = time_problem(obs.observed_at)
    if problem is not None:
        errors.append(f"observed_at: {problem}")
    if _convert_problem(host.hostname, Hostname):
        errors.append(f"host.hostname: must be 1 to {MAX_HOSTNAME} characters without NUL")
    if len(host.storage) > MAX_MOUNTS:
        errors.append(f"host.storage: more than {MAX_MOUNTS} mounts")
    if any(_convert_problem(m.mount, Text) for m in host.storage):
        errors.append(f"host.storage: a mount path is longer than {MAX_STRING} characters or has a NUL")
    errors += _metric_names("host.telemetry", host.telemetry, HOST_METRIC_TYPES)
    nvml = obs.nvml
    if nvml.reason is not None and _convert_problem(nvml.reason, Text):
        errors.append(f"nvml.reason: longer than {MAX_STRING} characters or has a NUL")
    if len(nvml.accelerators) > MAX_ACCELERATORS:
        errors.append(f"nvml.accelerators: more than {MAX_ACCELERATORS}")
    errors += observation_problems_after_decode(obs)
    for a in nvml.accelerators:
        if _convert_problem(a.uuid, GpuUuid):
            errors.append("nvml.accelerators: uuid must be 1 to 128 characters without NUL")
        errors += _metric_names(
            f"nvml.accelerators[{a.uuid[:64]!r}].telemetry", a.telemetry, ACCELERATOR_METRIC_TYPES
        )
    if len(obs.collectors) > MAX_COLLECTORS:
        errors.append(f"collectors: more than {MAX_COLLECTORS}")
    for run in obs.collectors:
        if (
            _convert_problem(run.collector, ShortText)
            or (run.error is not None and _convert_problem(run.error, Text))
            or not 0 <= run.duration_seconds <= MAX_DURATION_SECONDS
        ):
            errors.append(f"collectors: {_without_nul(run.collector[:64])!r} is outside the contract")
    for where, fact, value_type in _named_facts(obs):
        problem = fact_problem(fact, value_type)
        if problem is not None:
            errors.append(f"{where}: {problem}")
    return errors


def _without_nul(text: str) -> str:
    """NUL and lone surrogates (neither storable by PostgreSQL) become U+FFFD."""
    return text.replace("\x00", "\ufffd").encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def _clean(fact: Fact, value_type: Any) -> Fact:
    if isinstance(fact, Unavailable | TemporarilyFailed) and fact_problem(fact) is not None:
        return type(fact)(_without_nul(fact.reason)[:MAX_STRING])
    if isinstance(fact, Known) and isinstance(fact.value, str) and fact_problem(fact, value_type) is not None:
        repaired = Known(_without_nul(fact.value))
        if fact_problem(repaired, value_type) is None:
            return repaired
    problem = fact_problem(fact, value_type)
    if problem is None:
        return fact
    return TemporarilyFailed(_without_nul(f"invalid reading ({problem})")[:MAX_STRING])


def _clean_metrics(telemetry: dict[str, Fact], known: dict[str, Any]) -> dict[str, Fact]:
    # A metric the protocol does not know would cost the report: it stays on this side.
    return {name: _clean(fact, known[name]) for name, fact in telemetry.items() if name in known}


def sanitize_observation(obs: HardwareObservation) -> HardwareObservation:
    """The agent's side: a reading the server would refuse (a negative, non-finite or impossible
    number from a confused sensor, a value of the wrong type) becomes `temporarily_failed` with
    the reason, rather than costing the whole report; a NUL in a name becomes U+FFFD."""
    if not validate_observation(obs):
        return obs
    host = obs.host
    clean_host = HostObservation(
        hostname=_without_nul(host.hostname)[:MAX_HOSTNAME] or "unknown",
        os=type(host.os)(**{f: _clean(getattr(host.os, f), Text) for f in host.os.__struct_fields__}),
        cpu=type(host.cpu)(
            model=_clean(host.cpu.model, Text),
            sockets=_clean(host.cpu.sockets, Count),
            physical_cores=_clean(host.cpu.physical_cores, Count),
            logical_cores=_clean(host.cpu.logical_cores, Count),
        ),
        memory_total_bytes=_clean(host.memory_total_bytes, MemoryBytes),
        telemetry=_clean_metrics(host.telemetry, HOST_METRIC_TYPES),
        storage=[
            StorageObservation(
                mount=_without_nul(m.mount)[:MAX_STRING],
                used_bytes=_clean(m.used_bytes, StorageBytes),
                total_bytes=_clean(m.total_bytes, StorageBytes),
            )
            for m in host.storage[:MAX_MOUNTS]
        ],
    )
    accelerators = [
        AcceleratorObservation(
            uuid=_without_nul(a.uuid)[:128],
            index=_clean(a.index, GpuIndex),
            name=_clean(a.name, Text),
            pci_bus_id=_clean(a.pci_bus_id, Text),
            memory_total_bytes=_clean(a.memory_total_bytes, MemoryBytes),
            compute_capability=_clean(a.compute_capability, ShortText),
            mig_mode=_clean(a.mig_mode, MigMode),
            telemetry=_clean_metrics(a.telemetry, ACCELERATOR_METRIC_TYPES),
        )
        for a in obs.nvml.accelerators
    ]
    reason = obs.nvml.reason
    nvml = msgspec.structs.replace(
        obs.nvml,
        reason=None if reason is None else _without_nul(reason)[:MAX_STRING],
        driver_version=_clean(obs.nvml.driver_version, ShortText),
        cuda_driver_version=_clean(obs.nvml.cuda_driver_version, ShortText),
        accelerators=accelerators,
    )
    collectors = [
        CollectorRun(
            collector=_without_nul(run.collector)[:MAX_SHORT],
            ok=run.ok,
            duration_seconds=min(max(run.duration_seconds, 0.0), MAX_DURATION_SECONDS)
            if math.isfinite(run.duration_seconds)
            else MAX_DURATION_SECONDS,
            error=None if run.error is None else _without_nul(run.error)[:MAX_STRING],
        )
        for run in obs.collectors[:MAX_COLLECTORS]
    ]
    return msgspec.structs.replace(obs, host=clean_host, nvml=nvml, collectors=collectors)
