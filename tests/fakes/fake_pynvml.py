"""A fake of the `pynvml` module, for tests only.

It behaves like real NVML where the collector can tell: error classes carry `.value` with the real
NVML_ERROR_* codes and `NVMLError(code)` returns the per-code subclass; device calls before
`nvmlInit` raise NVMLError_Uninitialized; init/shutdown are reference counted; a lost GPU fails
its handle and UUID calls. A `FakeNvml` reads its `Scenario` on every call, so a test may change
the scenario between refreshes (driver upgrade, swapped indexes, a removed GPU); the scenario and
its devices are tests/fakes/nvml_devices.py's.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, ClassVar

from tests.fakes.nvml_devices import (
    EventData,
    EventSet,
    FakeGpu,
    Handle,
    Memory,
    MemoryV2,
    PciInfo,
    Scenario,
    Utilization,
)

# The real pynvml values (nvidia-ml-py 13.615): checked by test_fake_matches_real_pynvml.
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_UNKNOWN = 999

NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_PSTATE_UNKNOWN = 32
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
nvmlEventTypeXidCriticalError = 0x8
nvmlMemory_v2 = 0x02000028  # the version a caller passes for nvmlDeviceGetMemoryInfo_v2
nvmlClocksEventReasonGpuIdle = 0x1
nvmlClocksEventReasonSwPowerCap = 0x4
nvmlClocksEventReasonHwSlowdown = 0x8
nvmlClocksEventReasonSwThermalSlowdown = 0x20
nvmlClocksEventReasonHwThermalSlowdown = 0x40
nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x80

_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """As in pynvml: `NVMLError(code)` is an instance of the subclass for that code."""

    _by_code: ClassVar[dict[int, type[NVMLError]]] = {}
    code: ClassVar[int | None] = None
    value: int

    def __new__(cls, value: int | None = None) -> NVMLError:
        if value is None:
            value = cls.code if cls.code is not None else NVML_ERROR_UNKNOWN
        if cls is NVMLError:
            cls = NVMLError._by_code.get(value, NVMLError)
        error = Exception.__new__(cls)
        error.value = value
        return error

    def __init__(self, value: int | None = None) -> None:
        super().__init__(self.value)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.code is not None:
            NVMLError._by_code[cls.code] = cls

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML Error with code {self.value}")


class NVMLError_Uninitialized(NVMLError):
    code = NVML_ERROR_UNINITIALIZED


class NVMLError_InvalidArgument(NVMLError):
    code = NVML_ERROR_INVALID_ARGUMENT


class NVMLError_NotSupported(NVMLError):
    code = NVML_ERROR_NOT_SUPPORTED


class NVMLError_NoPermission(NVMLError):
    code = NVML_ERROR_NO_PERMISSION


class NVMLError_DriverNotLoaded(NVMLError):
    code = NVML_ERROR_DRIVER_NOT_LOADED


class NVMLError_Timeout(NVMLError):
    code = NVML_ERROR_TIMEOUT


class NVMLError_LibraryNotFound(NVMLError):
    code = NVML_ERROR_LIBRARY_NOT_FOUND


class NVMLError_FunctionNotFound(NVMLError):
    code = NVML_ERROR_FUNCTION_NOT_FOUND


class NVMLError_GpuIsLost(NVMLError):
    code = NVML_ERROR_GPU_IS_LOST


class NVMLError_ResetRequired(NVMLError):
    code = NVML_ERROR_RESET_REQUIRED


class NVMLError_Unknown(NVMLError):
    code = NVML_ERROR_UNKNOWN


ERRORS_BY_NAME: dict[str, type[NVMLError]] = {
    cls.__name__.removeprefix("NVMLError_"): cls for cls in NVMLError._by_code.values()
}


def make_error(error: str | int) -> NVMLError:
    """An NVMLError from a subclass name ("NotSupported") or a raw code."""
    if isinstance(error, int):
        return NVMLError(error)
    return ERRORS_BY_NAME[error]()


class FakeNvml:
    """Stands in for the `pynvml` module: pass an instance as `nvml=`."""

    NVMLError = NVMLError
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVMLError_InvalidArgument = NVMLError_InvalidArgument
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NoPermission = NVMLError_NoPermission
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_Timeout = NVMLError_Timeout
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_ResetRequired = NVMLError_ResetRequired
    NVMLError_Unknown = NVMLError_Unknown

    NVML_SUCCESS = NVML_SUCCESS
    NVML_ERROR_UNINITIALIZED = NVML_ERROR_UNINITIALIZED
    NVML_ERROR_INVALID_ARGUMENT = NVML_ERROR_INVALID_ARGUMENT
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NO_PERMISSION = NVML_ERROR_NO_PERMISSION
    NVML_ERROR_ALREADY_INITIALIZED = NVML_ERROR_ALREADY_INITIALIZED
    NVML_ERROR_NOT_FOUND = NVML_ERROR_NOT_FOUND
    NVML_ERROR_INSUFFICIENT_SIZE = NVML_ERROR_INSUFFICIENT_SIZE
    NVML_ERROR_INSUFFICIENT_POWER = NVML_ERROR_INSUFFICIENT_POWER
    NVML_ERROR_DRIVER_NOT_LOADED = NVML_ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_TIMEOUT = NVML_ERROR_TIMEOUT
    NVML_ERROR_IRQ_ISSUE = NVML_ERROR_IRQ_ISSUE
    NVML_ERROR_LIBRARY_NOT_FOUND = NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_FUNCTION_NOT_FOUND = NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_ERROR_CORRUPTED_INFOROM = NVML_ERROR_CORRUPTED_INFOROM
    NVML_ERROR_GPU_IS_LOST = NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_RESET_REQUIRED = NVML_ERROR_RESET_REQUIRED
    NVML_ERROR_OPERATING_SYSTEM = NVML_ERROR_OPERATING_SYSTEM
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = NVML_ERROR_LIB_RM_VERSION_MISMATCH
    NVML_ERROR_IN_USE = NVML_ERROR_IN_USE
    NVML_ERROR_MEMORY = NVML_ERROR_MEMORY
    NVML_ERROR_NO_DATA = NVML_ERROR_NO_DATA
    NVML_ERROR_UNKNOWN = NVML_ERROR_UNKNOWN

    NVML_DEVICE_MIG_DISABLE = NVML_DEVICE_MIG_DISABLE
    NVML_DEVICE_MIG_ENABLE = NVML_DEVICE_MIG_ENABLE
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    NVML_CLOCK_GRAPHICS = NVML_CLOCK_GRAPHICS
    NVML_CLOCK_SM = NVML_CLOCK_SM
    NVML_CLOCK_MEM = NVML_CLOCK_MEM
    NVML_PSTATE_UNKNOWN = NVML_PSTATE_UNKNOWN
    NVML_FEATURE_DISABLED = NVML_FEATURE_DISABLED
    NVML_FEATURE_ENABLED = NVML_FEATURE_ENABLED
    NVML_MEMORY_ERROR_TYPE_CORRECTED = NVML_MEMORY_ERROR_TYPE_CORRECTED
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = NVML_VOLATILE_ECC
    NVML_AGGREGATE_ECC = NVML_AGGREGATE_ECC
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = (
        NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
    )
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
    nvmlEventTypeXidCriticalError = nvmlEventTypeXidCriticalError
    nvmlMemory_v2 = nvmlMemory_v2

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.calls: Counter[str] = Counter()
        self._refcount = 0
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._session = 0  # bumps each time the reference count returns to 0
        self.event_sets: list[EventSet] = []

    # -- test helpers --------------------------------------------------------------------------

    @property
    def initialized(self) -> bool:
        return self._refcount > 0

    @property
    def refcount(self) -> int:
        return self._refcount

    def xid(self, gpu_uuid: str, code: int) -> None:
        """The driver reports XID `code` on a GPU: queued in every live set registered for it."""
        for event_set in self.event_sets:
            for gpu, handle in event_set.gpus.values():
                if gpu.uuid == gpu_uuid and not event_set.freed and event_set.session == self._session:
                    # NVML hands back the device's handle (the pointer the caller registered).
                    event_set.pending.append(EventData(handle, nvmlEventTypeXidCriticalError, code))

    def release(self) -> None:
        """Wake every hung call now (tests call this so no thread outlives them)."""
        self._released.set()

    def _hang(self, seconds: float) -> None:
        if seconds > 0:
            self._released.wait(seconds)

    def _system(self, call: str, *, needs_init: bool = True) -> None:
        self.calls[call] += 1
        if needs_init and not self.initialized:
            raise NVMLError_Uninitialized()
        if self.scenario.hang_call == call:
            self._hang(self.scenario.hang_seconds)
        error = self.scenario.errors.get(call)
        if error is not None:
            raise make_error(error)

    def _enter(self, call: str) -> None:
        self.calls[call] += 1
        if not self.initialized:
            raise NVMLError_Uninitialized()

    def _answer(self, call: str, gpu: FakeGpu) -> FakeGpu:
        if gpu.hang_call == call:
            self._hang(gpu.hang_seconds)
        if gpu.lost and call in ("uuid", "handle"):
            raise NVMLError_GpuIsLost()
        error = gpu.errors.get(call)
        if error is not None:
            raise make_error(error)
        return gpu

    def _device(self, call: str, handle: Handle) -> FakeGpu:
        self._enter(call)
        if not isinstance(handle, Handle):
            raise NVMLError_InvalidArgument()
        return self._answer(call, handle.gpu)

    def _string(self, value: str) -> str | bytes:
        return value.encode() if self.scenario.strings_as_bytes else value

    # -- the pynvml API ------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._system("init", needs_init=False)
        if self.scenario.init_error is not None:
            raise make_error(self.scenario.init_error)
        with self._lock:
            self._refcount += 1

    def nvmlShutdown(self) -> None:
        self.calls["shutdown"] += 1
        with self._lock:
            if self._refcount == 0:
                raise NVMLError_Uninitialized()
            self._refcount -= 1
            if self._refcount == 0:
                self._session += 1  # every event set of the session is gone with it

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        self._system("driver_version")
        return self._string(self.scenario.driver_version)

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._system("cuda_driver_version")
        return self.scenario.cuda_driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.nvmlSystemGetCudaDriverVersion_v2()

    def nvmlDeviceGetCount(self) -> int:
        self._system("device_count")
        return len(self.scenario.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:
        self._enter("handle")
        gpus = self.scenario.gpus
        if not 0 <= index < len(gpus):
            raise NVMLError_InvalidArgument()
        return Handle(self._answer("handle", gpus[index]), index)

    def nvmlDeviceGetUUID(self, handle: Handle) -> str | bytes:
        return self._string(self._device("uuid", handle).uuid)

    def nvmlDeviceGetName(self, handle: Handle) -> str | bytes:
        return self._string(self._device("name", handle).name)

    def nvmlDeviceGetPciInfo(self, handle: Handle) -> PciInfo:
        gpu = self._device("pci_info", handle)
        domain, bus, rest = gpu.pci_bus_id.split(":")
        device = rest.split(".")[0]
        legacy = f"{int(domain, 16):04X}:{bus}:{rest}"
        return PciInfo(
            busId=self._string(gpu.pci_bus_id),
            busIdLegacy=self._string(legacy),
            domain=int(domain, 16),
            bus=int(bus, 16),
            device=int(device, 16),
        )

    def nvmlDeviceGetMemoryInfo(self, handle: Handle, version: int | None = None) -> Memory | MemoryV2:
        gpu = self._device("memory_info", handle)
        free = gpu.memory_total_bytes - gpu.memory_used_bytes - gpu.memory_reserved_bytes
        if not version:
            # the original call: what the driver reserves counts as used
            return Memory(total=gpu.memory_total_bytes, free=free, used=gpu.memory_total_bytes - free)
        if not gpu.memory_info_v2:
            raise NVMLError_FunctionNotFound()  # as pynvml when the library lacks the _v2 symbol
        return MemoryV2(
            version=version,
            total=gpu.memory_total_bytes,
            reserved=gpu.memory_reserved_bytes,
            free=free,
            used=gpu.memory_used_bytes,
        )

    def nvmlDeviceGetCudaComputeCapability(self, handle: Handle) -> tuple[int, int]:
        return self._device("compute_capability", handle).compute_capability

    def nvmlDeviceGetMigMode(self, handle: Handle) -> list[int]:
        gpu = self._device("mig_mode", handle)
        if gpu.mig_mode is None:
            raise NVMLError_NotSupported()
        pending = gpu.mig_mode if gpu.mig_pending is None else gpu.mig_pending
        return [gpu.mig_mode, pending]

    def nvmlDeviceGetUtilizationRates(self, handle: Handle) -> Utilization:
        gpu = self._device("utilization", handle)
        return Utilization(gpu=gpu.utilization_gpu_percent, memory=gpu.utilization_memory_percent)

    def nvmlDeviceGetTemperature(self, handle: Handle, sensor: int) -> int:
        gpu = self._device("temperature", handle)
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError_InvalidArgument()
        return gpu.temperature_celsius

    def nvmlDeviceGetPowerUsage(self, handle: Handle) -> int:
        return self._device("power_usage", handle).power_milliwatts

    def nvmlDeviceGetClockInfo(self, handle: Handle, clock_type: int) -> int:
        names = {
            NVML_CLOCK_GRAPHICS: "clock_graphics",
            NVML_CLOCK_SM: "clock_sm",
            NVML_CLOCK_MEM: "clock_mem",
        }
        if clock_type not in names:
            raise NVMLError_InvalidArgument()
        gpu = self._device(names[clock_type], handle)
        return {
            NVML_CLOCK_GRAPHICS: gpu.clock_graphics_mhz,
            NVML_CLOCK_SM: gpu.clock_sm_mhz,
            NVML_CLOCK_MEM: gpu.clock_memory_mhz,
        }[clock_type]

    def nvmlDeviceGetFanSpeed(self, handle: Handle) -> int:
        return self._device("fan_speed", handle).fan_speed_percent

    def nvmlDeviceGetPerformanceState(self, handle: Handle) -> int:
        return self._device("performance_state", handle).performance_state

    # -- health ---------------------------------------------------------------------------------

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Handle) -> int:
        return self._device("clock_event_reasons", handle).clock_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Handle) -> int:
        return self.nvmlDeviceGetCurrentClocksEventReasons(handle)

    def nvmlDeviceGetEccMode(self, handle: Handle) -> list[int]:
        gpu = self._device("ecc_mode", handle)
        if gpu.ecc_mode is None:
            raise NVMLError_NotSupported()
        return [gpu.ecc_mode, gpu.ecc_mode]

    def nvmlDeviceGetTotalEccErrors(self, handle: Handle, error_type: int, counter_type: int) -> int:
        gpu = self._device("ecc_errors", handle)
        if error_type not in (0, 1) or counter_type not in (0, 1):
            raise NVMLError_InvalidArgument()
        name = ("corrected_" if error_type == 0 else "uncorrected_") + (
            "volatile" if counter_type == 0 else "aggregate"
        )
        if gpu.ecc_mode != NVML_FEATURE_ENABLED or name not in gpu.ecc_errors:
            raise NVMLError_NotSupported()
        return gpu.ecc_errors[name]

    def nvmlDeviceGetRemappedRows(self, handle: Handle) -> tuple[int, int, int, int]:
        gpu = self._device("remapped_rows", handle)
        if gpu.remapped_rows is None:
            raise NVMLError_NotSupported()
        return gpu.remapped_rows

    def nvmlDeviceGetRetiredPages(self, handle: Handle, cause: int) -> list[int]:
        gpu = self._device("retired_pages", handle)
        if cause not in (0, 1):
            raise NVMLError_InvalidArgument()
        if gpu.retired_pages is None:
            raise NVMLError_NotSupported()
        return [0x1000 * (i + 1) for i in range(gpu.retired_pages[cause])]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Handle) -> int:
        gpu = self._device("retired_pages_pending", handle)
        if gpu.retired_pages is None:
            raise NVMLError_NotSupported()
        return NVML_FEATURE_ENABLED if gpu.retired_pages[2] else NVML_FEATURE_DISABLED

    def nvmlDeviceGetPcieReplayCounter(self, handle: Handle) -> int:
        return self._device("pcie_replay", handle).pcie_replay_count

    def nvmlEventSetCreate(self) -> EventSet:
        self._enter("event_set_create")
        event_set = EventSet(session=self._session)
        self.event_sets.append(event_set)
        return event_set

    def _live(self, event_set: object) -> EventSet:
        if not isinstance(event_set, EventSet) or event_set.freed or event_set.session != self._session:
            raise NVMLError_InvalidArgument()
        return event_set

    def nvmlDeviceRegisterEvents(self, handle: Handle, event_types: int, event_set: EventSet) -> None:
        gpu = self._device("register_events", handle)
        live = self._live(event_set)
        if not gpu.events_supported:
            raise NVMLError_NotSupported()
        if event_types & ~nvmlEventTypeXidCriticalError:
            raise NVMLError_NotSupported()  # the fake knows only XIDs
        live.gpus[id(gpu)] = (gpu, handle)

    def nvmlEventSetWait_v2(self, event_set: EventSet, timeout_ms: int) -> EventData:
        self._enter("event_set_wait")
        live = self._live(event_set)
        if not live.pending:
            # Real NVML waits up to timeout_ms; the fake never has more to come while it waits.
            raise NVMLError_Timeout()
        return live.pending.pop(0)

    def nvmlEventSetWait(self, event_set: EventSet, timeout_ms: int) -> EventData:
        return self.nvmlEventSetWait_v2(event_set, timeout_ms)

    def nvmlEventSetFree(self, event_set: EventSet) -> None:
        self._enter("event_set_free")
        self._live(event_set).freed = True

    def nvmlErrorString(self, code: int) -> str:
        return _MESSAGES.get(code, f"Unknown Error (code {code})")
