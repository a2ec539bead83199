"""What an observed value may be: the bounds of the agent protocol's contract
(docs/NODE_AGENT_PROTOCOL.md, section 6 "Bounds"), and the observation's fields as the server
decodes them.

The agent protocol (agent/protocol.py) publishes and checks these bounds with its own wire
Structs; the observation Structs (collectors/observations.py, collectors/gpu_health.py) carry
the same bounds in their fields, so that the server's one decode of a report yields the
observation and checks it at once (`decode_report`). Those field types are the contract's only
where msgspec decodes: code that builds an observation builds plain facts (the type checker sees
`Fact`), and what the ledger stored is read back with the generic classes' defaults, whatever an
earlier release accepted.
"""

from __future__ import annotations

from datetime import datetime
from types import UnionType
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias, TypedDict, Union, get_args, get_origin

import msgspec

from collectors.facts import Fact, Known, TemporarilyFailed, Unavailable, Unknown, Unsupported

# Every integer a JSON consumer may read stays within 2^53, where every JSON implementation
# (JavaScript's included) is still exact.
MAX_SEQUENCE = 2**53 - 1
MAX_HOSTNAME = 255
MAX_STRING = 1024
MAX_SHORT = 64
MAX_GPU_UUID = 128
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

# PostgreSQL refuses NUL in text and jsonb, so no string on the wire may carry one.
NUL_FREE = r"\A[^\x00]*\Z"
Text: TypeAlias = Annotated[str, msgspec.Meta(pattern=NUL_FREE, max_length=MAX_STRING)]
ShortText: TypeAlias = Annotated[str, msgspec.Meta(pattern=NUL_FREE, max_length=MAX_SHORT)]
Hostname: TypeAlias = Annotated[str, msgspec.Meta(pattern=NUL_FREE, min_length=1, max_length=MAX_HOSTNAME)]
IdentityKey: TypeAlias = Annotated[str, msgspec.Meta(pattern=NUL_FREE, min_length=1, max_length=MAX_IDENTITY)]
GpuUuid: TypeAlias = Annotated[str, msgspec.Meta(pattern=NUL_FREE, min_length=1, max_length=MAX_GPU_UUID)]
AwareDatetime: TypeAlias = Annotated[datetime, msgspec.Meta(tz=True)]

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

# GPU health signals (collectors/gpu_health.py, docs/gpu-health.md).
MAX_XIDS = 256  # per GPU per report: the collector drains at most this many per collection
MAX_CLOCK_EVENT_REASONS = 32
MAX_HEALTH_COUNTERS = 8  # per group: ECC counters, remapped rows, retired pages
ErrorCount: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # int64: msgspec bounds
CountOrFlag: TypeAlias = ErrorCount | bool
EccMode: TypeAlias = Literal["enabled", "disabled"]
XidCode: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]


# --- the observation's fields as the server's decode reads them -----------------------------------------
# The wire checks every string against NUL_FREE, string by string (a fifth of a report's decode);
# a body that holds no NUL, raw or escaped, passes every one of those patterns, and the server
# decodes the observation Structs only from such a body or from one the wire types accepted
# (`decode_report`), so their fields leave the pattern out and keep every other bound.


_META_ATTRIBUTES = ("gt", "ge", "lt", "le", "multiple_of", "min_length", "max_length", "tz")


def without_nul_pattern(t: Any) -> Any:
    """`t`, a value type of this module, with its NUL_FREE pattern left out."""
    if get_origin(t) in (Union, UnionType):
        return Union[tuple(without_nul_pattern(a) for a in get_args(t))]  # noqa: UP007 - built from a tuple
    if get_origin(t) is not Annotated:
        return t
    base, *metas = get_args(t)
    kept = [
        msgspec.Meta(**{a: getattr(m, a) for a in _META_ATTRIBUTES if getattr(m, a) is not None})
        if isinstance(m, msgspec.Meta) and m.pattern == NUL_FREE
        else m
        for m in metas
    ]
    return Annotated[(base, *kept)]


def fact_of(value_type: Any) -> Any:
    """A fact whose known value is of `value_type` and whose reason is bounded text."""
    generic: tuple[Any, ...] = (Known, Unavailable, TemporarilyFailed)  # parameterized at run time
    known, unavailable, failed = generic
    reason = without_nul_pattern(Text)
    return (
        known[without_nul_pattern(value_type)] | Unknown | Unsupported | unavailable[reason] | failed[reason]
    )


def _telemetry(name: str, metrics: dict[str, Any]) -> Any:
    # A dict, as the observation holds it, with a value type per metric. A name not listed is
    # left out of the decoded dict (not refused): such a body does not encode back to itself, and
    # `decode_report` then refuses it with the wire types' words.
    return TypedDict(name, {m: fact_of(t) for m, t in metrics.items()}, total=False)  # type: ignore[operator]


# The type checker sees what code may build (any fact, any dict of them); msgspec, the bounds.
if TYPE_CHECKING:
    TextFact: TypeAlias = Fact
    ShortTextFact: TypeAlias = Fact
    CountFact: TypeAlias = Fact
    MemoryFact: TypeAlias = Fact
    StorageFact: TypeAlias = Fact
    IndexFact: TypeAlias = Fact
    MigModeFact: TypeAlias = Fact
    FlagFact: TypeAlias = Fact
    EccModeFact: TypeAlias = Fact
    ErrorCountFact: TypeAlias = Fact
    CountOrFlagFact: TypeAlias = Fact
    HostTelemetry: TypeAlias = dict[str, Fact]
    AcceleratorTelemetry: TypeAlias = dict[str, Fact]
else:
    TextFact = fact_of(Text)
    ShortTextFact = fact_of(ShortText)
    CountFact = fact_of(Count)
    MemoryFact = fact_of(MemoryBytes)
    StorageFact = fact_of(StorageBytes)
    IndexFact = fact_of(GpuIndex)
    MigModeFact = fact_of(MigMode)
    FlagFact = fact_of(bool)
    EccModeFact = fact_of(EccMode)
    ErrorCountFact = fact_of(ErrorCount)
    CountOrFlagFact = fact_of(CountOrFlag)
    HostTelemetry = _telemetry("HostTelemetry", HOST_METRIC_TYPES)
    AcceleratorTelemetry = _telemetry("AcceleratorTelemetry", ACCELERATOR_METRIC_TYPES)

# Strings of the observation, their NUL pattern left out (Annotated: the type checker sees str).
ObservedText: TypeAlias = Annotated[str, msgspec.Meta(max_length=MAX_STRING)]
ObservedShortText: TypeAlias = Annotated[str, msgspec.Meta(max_length=MAX_SHORT)]
ObservedHostname: TypeAlias = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HOSTNAME)]
ObservedGpuUuid: TypeAlias = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_GPU_UUID)]
