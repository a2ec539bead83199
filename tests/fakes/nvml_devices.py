"""The devices a fake NVML answers for (tests/fakes/fake_pynvml.py): a `Scenario` of `FakeGpu`s a
test writes and may change between refreshes, with the calls it can make fail or hang, and the
structs and handles pynvml's calls return."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Names of the injectable per-GPU calls (keys of FakeGpu.errors / FakeGpu.hang_call).
GPU_CALLS = (
    "handle",
    "uuid",
    "name",
    "pci_info",
    "memory_info",
    "compute_capability",
    "mig_mode",
    "utilization",
    "temperature",
    "power_usage",
    "clock_graphics",
    "clock_sm",
    "clock_mem",
    "fan_speed",
    "performance_state",
    "clock_event_reasons",
    "ecc_mode",
    "ecc_errors",
    "remapped_rows",
    "retired_pages",
    "retired_pages_pending",
    "pcie_replay",
    "register_events",
)
ECC_COUNTERS = ("corrected_volatile", "uncorrected_volatile", "corrected_aggregate", "uncorrected_aggregate")
# Names of the injectable system calls (keys of Scenario.errors / Scenario.hang_call).
SYSTEM_CALLS = ("init", "driver_version", "cuda_driver_version", "device_count")


@dataclass
class FakeGpu:
    uuid: str
    name: str
    pci_bus_id: str
    memory_total_bytes: int
    # As nvidia-smi's "FB Memory Usage": Used excludes what the driver and firmware reserve. Real
    # NVML's original nvmlDeviceGetMemoryInfo counts the reservation as used; its _v2 does not.
    memory_used_bytes: int = 0
    memory_reserved_bytes: int = 0
    # False: a driver whose NVML has no nvmlDeviceGetMemoryInfo_v2 (before R510): FunctionNotFound.
    memory_info_v2: bool = True
    compute_capability: tuple[int, int] = (9, 0)
    # NVML_DEVICE_MIG_ENABLE / _DISABLE; None: the GPU has no MIG (GetMigMode is NotSupported).
    mig_mode: int | None = None
    mig_pending: int | None = None
    utilization_gpu_percent: int = 0
    utilization_memory_percent: int = 0
    temperature_celsius: int = 40
    power_milliwatts: int = 50_000
    clock_graphics_mhz: int = 1000
    clock_sm_mhz: int = 1000
    clock_memory_mhz: int = 1000
    fan_speed_percent: int = 30
    performance_state: int = 0
    # Health signals. Bits of nvmlClocksEventReason*.
    clock_event_reasons: int = 0
    # NVML_FEATURE_ENABLED / _DISABLED; None: no ECC (consumer GPUs): GetEccMode is NotSupported.
    ecc_mode: int | None = None
    # ECC_COUNTERS -> count; a counter left out is NotSupported (N/A in nvidia-smi), and with ECC
    # disabled or absent every counter is.
    ecc_errors: dict[str, int] = field(default_factory=dict)
    # (correctable, uncorrectable, pending, failure); None: no row remapping (before Ampere).
    remapped_rows: tuple[int, int, int, int] | None = None
    # (single-bit pages, double-bit pages, pending); None: no page retirement (Ampere and later).
    retired_pages: tuple[int, int, bool] | None = None
    pcie_replay_count: int = 0
    # NVML's event API (Linux only): False makes nvmlDeviceRegisterEvents NotSupported.
    events_supported: bool = True
    # Call name (GPU_CALLS) -> error name ("NotSupported") or NVML code raised by that call.
    errors: dict[str, str | int] = field(default_factory=dict)
    # Fallen off the bus: the handle and UUID calls raise GpuIsLost.
    lost: bool = False
    # Seconds the call `hang_call` blocks before answering (released early by FakeNvml.release()).
    hang_seconds: float = 0.0
    hang_call: str = "temperature"


@dataclass
class Scenario:
    driver_version: str
    cuda_driver_version: int
    gpus: list[FakeGpu] = field(default_factory=list)
    # "LibraryNotFound", "DriverNotLoaded", ... raised by nvmlInit.
    init_error: str | int | None = None
    # System call name (SYSTEM_CALLS) -> error raised by that call.
    errors: dict[str, str | int] = field(default_factory=dict)
    hang_seconds: float = 0.0
    hang_call: str = "init"
    # Old pynvml (< 11.5) returned bytes for every string; new ones return str.
    strings_as_bytes: bool = False


@dataclass(frozen=True)
class PciInfo:
    busId: str | bytes
    busIdLegacy: str | bytes
    domain: int
    bus: int
    device: int
    pciDeviceId: int = 0x233510DE
    pciSubSystemId: int = 0


@dataclass(frozen=True)
class Memory:
    total: int
    free: int
    used: int


@dataclass(frozen=True)
class MemoryV2:
    """As pynvml's c_nvmlMemory_v2_t."""

    version: int
    total: int
    reserved: int
    free: int
    used: int


@dataclass(frozen=True)
class Utilization:
    gpu: int
    memory: int


@dataclass(frozen=True)
class EventData:
    """As pynvml's c_nvmlEventData_t."""

    device: Any
    eventType: int
    eventData: int
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass(eq=False)
class EventSet:
    """An NVML event set: valid only within the NVML session that created it."""

    session: int
    gpus: dict[int, tuple[FakeGpu, Handle]] = field(default_factory=dict)  # id(gpu) -> (gpu, handle)
    pending: list[EventData] = field(default_factory=list)
    freed: bool = False


@dataclass(frozen=True, eq=False)
class Handle:
    """A device handle stays bound to its device, as NVML's does."""

    gpu: FakeGpu
    index: int
