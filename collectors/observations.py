"""The typed observations the collectors produce and the ledger reconciles.

These Structs are the contract between collection (local or agent) and reconciliation: the agent
sends exactly these over the wire, and the server validates them with the same types.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal, TypeAlias

import msgspec

from collectors.facts import Fact
from collectors.gpu_health import AcceleratorHealthSignals, XidOccurrence

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


class OsInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    name: Fact
    version: Fact
    kernel: Fact
    architecture: Fact


class CpuInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    model: Fact
    sockets: Fact
    physical_cores: Fact
    logical_cores: Fact


class StorageObservation(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """One relevant mount (the state directory's filesystem, `/`)."""

    mount: str
    used_bytes: Fact
    total_bytes: Fact


class HostObservation(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """What SystemHostCollector saw. Inventory facts plus host telemetry."""

    hostname: str
    os: OsInfo
    cpu: CpuInfo
    memory_total_bytes: Fact
    # Latest-state telemetry (never audited): keys are HOST_METRICS.
    telemetry: dict[str, Fact]
    storage: list[StorageObservation]


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

    uuid: str
    index: Fact
    name: Fact
    pci_bus_id: Fact
    memory_total_bytes: Fact
    compute_capability: Fact  # "9.0"
    mig_mode: Fact  # "enabled" | "disabled"
    # Latest-state telemetry: keys are ACCELERATOR_METRICS.
    telemetry: dict[str, Fact]
    # Health signals (collectors.gpu_health); None from an agent that does not collect them.
    health: AcceleratorHealthSignals | None = None


class NvmlScan(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """The NVML enumeration.

    `complete`: every device handle and identity call succeeded, so absence of a known UUID means
    the GPU is missing. `incomplete`: some handle/identity call failed; nothing may be marked missing.
    `unavailable`: nvmlInit failed (no driver, no library); `reason` says why.
    """

    status: ScanStatus
    reason: str | None
    driver_version: Fact
    cuda_driver_version: Fact  # "13.1"
    accelerators: list[AcceleratorObservation]
    # XIDs (by GPU UUID) of GPUs this scan could not list, e.g. XID 79: fallen off the bus.
    unlisted_xids: dict[str, list[XidOccurrence]] = {}


class CollectorRun(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """A collector's success and duration: its failure is data, never a crash of the refresh."""

    collector: str
    ok: bool
    duration_seconds: float
    error: str | None = None


class HardwareObservation(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """One refresh's worth of observation of one host."""

    observed_at: datetime
    host: HostObservation
    nvml: NvmlScan
    collectors: list[CollectorRun] = []


class HostCollectionError(Exception):
    """The host itself could not be observed: the refresh fails (the seed's normalized 503)."""
