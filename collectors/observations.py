"""The typed observations the collectors produce and the ledger reconciles.

These Structs are the contract between collection (local or agent) and reconciliation: the agent
sends exactly these over the wire, and the server decodes them with the contract's bounds
(collectors/contract.py).
"""

from __future__ import annotations

from typing import Annotated, Generic, Literal, TypeAlias

import msgspec
from typing_extensions import TypeVar

from collectors.contract import (
    MAX_ACCELERATORS,
    MAX_COLLECTORS,
    MAX_DURATION_SECONDS,
    MAX_MOUNTS,
    AcceleratorTelemetry,
    AwareDatetime,
    CountFact,
    HostTelemetry,
    IndexFact,
    MemoryFact,
    MigModeFact,
    ObservedGpuUuid,
    ObservedHostname,
    ObservedShortText,
    ObservedText,
    ShortTextFact,
    StorageFact,
    TextFact,
)
from collectors.facts import Fact
from collectors.gpu_health import ObservedHealthSignals, ObservedXids

ScanStatus: TypeAlias = Literal["complete", "incomplete", "unavailable"]

# Metric names carry their unit (docs/architecture.md, "Availability of a fact").
ACCELERATOR_METRICS: tuple[str, ...] = (
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
HOST_METRICS: tuple[str, ...] = ("memory_available_bytes", "memory_total_bytes")


# Observations are trees of frozen Structs: by their types, a list or dict in one holds only facts
# and the observations below it, so none can be part of a reference cycle, and the garbage
# collector does not track them (gc=False), as with the facts (collectors/facts.py).
#
# Their fields name the agent protocol's bounds (collectors/contract.py), which the server's
# decode of a report checks. The OS, CPU and storage facts are stored in the ledger too and read
# back with these classes, their type parameters at their defaults: whatever any release stored.
_Text = TypeVar("_Text", bound=Fact, default=Fact, covariant=True)
_Count = TypeVar("_Count", bound=Fact, default=Fact, covariant=True)
_Bytes = TypeVar("_Bytes", bound=Fact, default=Fact, covariant=True)
_Mount = TypeVar("_Mount", bound=str, default=str, covariant=True)


class OsInfo(msgspec.Struct, Generic[_Text], frozen=True, forbid_unknown_fields=True, gc=False):
    name: _Text
    version: _Text
    kernel: _Text
    architecture: _Text


class CpuInfo(msgspec.Struct, Generic[_Text, _Count], frozen=True, forbid_unknown_fields=True, gc=False):
    model: _Text
    sockets: _Count
    physical_cores: _Count
    logical_cores: _Count


class StorageObservation(
    msgspec.Struct, Generic[_Mount, _Bytes], frozen=True, forbid_unknown_fields=True, gc=False
):
    """One relevant mount (the state directory's filesystem, `/`)."""

    mount: _Mount
    used_bytes: _Bytes
    total_bytes: _Bytes


class HostObservation(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """What SystemHostCollector saw. Inventory facts plus host telemetry."""

    hostname: ObservedHostname
    os: OsInfo[TextFact]
    cpu: CpuInfo[TextFact, CountFact]
    memory_total_bytes: MemoryFact
    # Latest-state telemetry (never audited): keys are HOST_METRICS.
    telemetry: HostTelemetry
    storage: Annotated[
        list[StorageObservation[ObservedText, StorageFact]], msgspec.Meta(max_length=MAX_MOUNTS)
    ]


# Which facts are inventory (compared, recorded as HARDWARE_CHANGED, fingerprinted, signed by the
# agent), defined once: the reconciler, the node fold, the agent's validation and its inventory
# signature all read these tuples. Everything else an observation carries is telemetry.
ACCELERATOR_INVENTORY_FACTS: tuple[str, ...] = (
    "index",
    "name",
    "pci_bus_id",
    "memory_total_bytes",
    "compute_capability",
    "mig_mode",
)
# The driver facts come from the NVML scan and are kept on the node and on each accelerator.
DRIVER_FACTS: tuple[str, ...] = ("driver_version", "cuda_driver_version")
NODE_INVENTORY_FACTS: tuple[str, ...] = ("memory_total_bytes", *DRIVER_FACTS)


class AcceleratorObservation(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """One NVIDIA GPU as NVML reported it. Reconciled by `uuid` only."""

    uuid: ObservedGpuUuid
    index: IndexFact
    name: TextFact
    pci_bus_id: TextFact
    memory_total_bytes: MemoryFact
    compute_capability: ShortTextFact  # "9.0"
    mig_mode: MigModeFact  # "enabled" | "disabled"
    # Latest-state telemetry: keys are ACCELERATOR_METRICS.
    telemetry: AcceleratorTelemetry
    # Health signals (collectors.gpu_health); None from an agent that does not collect them.
    health: ObservedHealthSignals | None = None


class NvmlScan(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """The NVML enumeration.

    `complete`: every device handle and identity call succeeded, so absence of a known UUID means
    the GPU is missing. `incomplete`: some handle/identity call failed; nothing may be marked missing.
    `unavailable`: nvmlInit failed (no driver, no library); `reason` says why.
    """

    status: ScanStatus
    reason: ObservedText | None
    driver_version: ShortTextFact
    cuda_driver_version: ShortTextFact  # "13.1"
    accelerators: Annotated[list[AcceleratorObservation], msgspec.Meta(max_length=MAX_ACCELERATORS)]
    # XIDs (by GPU UUID) of GPUs this scan could not list, e.g. XID 79: fallen off the bus.
    unlisted_xids: Annotated[
        dict[ObservedGpuUuid, ObservedXids], msgspec.Meta(max_length=MAX_ACCELERATORS)
    ] = {}


class CollectorRun(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """A collector's success and duration: its failure is data, never a crash of the refresh."""

    collector: ObservedShortText
    ok: bool
    duration_seconds: Annotated[float, msgspec.Meta(ge=0, le=MAX_DURATION_SECONDS)]
    error: ObservedText | None = None


class HardwareObservation(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """One refresh's worth of observation of one host."""

    observed_at: AwareDatetime
    host: HostObservation
    nvml: NvmlScan
    collectors: Annotated[list[CollectorRun], msgspec.Meta(max_length=MAX_COLLECTORS)] = []


class HostCollectionError(Exception):
    """The host itself could not be observed: the refresh fails (the seed's normalized 503)."""
