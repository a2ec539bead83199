"""NvidiaNvmlCollector: one NVML enumeration of the host's NVIDIA GPUs as an NvmlScan.

Only NVML (through pynvml) is used; never nvidia-smi or any other command output. A failing
metric becomes a typed fact (docs/architecture.md, "Availability of a fact") and never hides the
GPU; only a failure of the identity calls (count, handle, UUID) makes the scan incomplete,
because then absence of a known UUID no longer proves the GPU is gone.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar

import msgspec

from collectors._worker import SingleFlightWorker, WorkerBusy, WorkerTimeout
from collectors.facts import (
    UNKNOWN,
    UNSUPPORTED,
    Fact,
    Known,
    TemporarilyFailed,
    Unavailable,
    Unsupported,
)
from collectors.gpu_health import XidOccurrence, XidWatch, collect_signals
from collectors.observations import AcceleratorObservation, NvmlScan

T = TypeVar("T")

# Real pynvml values; used only when the module object passed in lacks a constant.
_DEFAULT_CODES: dict[str, int] = {
    "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_NO_PERMISSION": 4,
    "NVML_ERROR_DRIVER_NOT_LOADED": 9,
    "NVML_ERROR_LIBRARY_NOT_FOUND": 12,
    "NVML_ERROR_FUNCTION_NOT_FOUND": 13,
}
_UNSUPPORTED_CODES = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND")
_UNAVAILABLE_CODES = (
    "NVML_ERROR_NO_PERMISSION",
    "NVML_ERROR_LIBRARY_NOT_FOUND",
    "NVML_ERROR_DRIVER_NOT_LOADED",
)
_INIT_REASONS = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": "NVML library not found",
    "NVML_ERROR_DRIVER_NOT_LOADED": "NVIDIA driver not loaded",
    "NVML_ERROR_NO_PERMISSION": "no permission to use NVML",
}
# Highest P-state NVML defines; NVML_PSTATE_UNKNOWN (32) and anything else is not a state.
_MAX_PSTATE = 15

Failure: TypeAlias = Unsupported | Unavailable | TemporarilyFailed


@dataclass(frozen=True, slots=True)
class _Ok(Generic[T]):
    value: T


class NvidiaNvmlCollector:
    """Enumerates GPUs through NVML, never taking longer than `timeout_seconds` per refresh.

    `nvml` is the pynvml module (imported lazily when None) or any object with its API.
    """

    name = "nvml"

    def __init__(self, nvml: Any = None, timeout_seconds: float = 5.0) -> None:
        self._nvml = nvml
        self.timeout_seconds = timeout_seconds
        self._worker: SingleFlightWorker[NvmlScan] = SingleFlightWorker("nvml-collector")
        self._xids = XidWatch()

    def close(self) -> None:
        """Free the XID event set and its NVML session reference."""
        self._xids.close()

    def collect(self) -> NvmlScan:
        """One scan, blocking the calling thread for at most `timeout_seconds`."""
        try:
            return self._worker.call(self._scan_or_report, self.timeout_seconds)
        except (WorkerTimeout, WorkerBusy) as err:
            return self._no_answer(err)

    async def collect_async(self) -> NvmlScan:
        """One scan without blocking the event loop, at most `timeout_seconds`."""
        try:
            return await self._worker.call_async(self._scan_or_report, self.timeout_seconds)
        except (WorkerTimeout, WorkerBusy) as err:
            return self._no_answer(err)

    def _no_answer(self, err: WorkerTimeout | WorkerBusy) -> NvmlScan:
        if isinstance(err, WorkerBusy):
            reason = (
                f"NVML is still busy with a previous call that did not answer within {self.timeout_seconds}s"
            )
        else:
            reason = f"NVML did not answer within {self.timeout_seconds}s"
        failed = TemporarilyFailed(reason)
        # Incomplete, not unavailable: the GPUs may be fine, and nothing may be marked missing.
        return NvmlScan(
            status="incomplete",
            reason=reason,
            driver_version=failed,
            cuda_driver_version=failed,
            accelerators=[],
        )

    def _scan_or_report(self) -> NvmlScan:
        try:
            return self._scan()
        except Exception as err:  # a bug or an exotic binding error is data, not a crashed refresh
            reason = f"NVML collection failed: {type(err).__name__}: {err}"
            failed = TemporarilyFailed(reason)
            return NvmlScan(
                status="incomplete",
                reason=reason,
                driver_version=failed,
                cuda_driver_version=failed,
                accelerators=[],
            )

    def _module(self) -> Any:
        if self._nvml is None:
            self._nvml = importlib.import_module("pynvml")
        return self._nvml

    def _scan(self) -> NvmlScan:
        try:
            nvml = self._module()
        except ImportError:
            return _unavailable_scan("pynvml (nvidia-ml-py) is not installed", transient=False)
        try:
            nvml.nvmlInit()
        except Exception as err:
            return _unavailable_scan(*_init_failure(nvml, err))
        try:
            return _Scanner(nvml, self._xids).scan()
        finally:
            try:
                nvml.nvmlShutdown()
            except Exception:  # the scan is already taken; a failed shutdown must not lose it
                pass


def _unavailable_scan(reason: str, transient: bool) -> NvmlScan:
    fact: Fact = TemporarilyFailed(reason) if transient else Unavailable(reason)
    return NvmlScan(
        status="unavailable",
        reason=reason,
        driver_version=fact,
        cuda_driver_version=fact,
        accelerators=[],
    )


def _init_failure(nvml: Any, err: Exception) -> tuple[str, bool]:
    """(reason, transient) for a failed nvmlInit."""
    for name, reason in _INIT_REASONS.items():
        if _has_code(nvml, err, name):
            return reason, False
    return f"nvmlInit failed: {describe_error(err)}", True


def _code(nvml: Any, name: str) -> int:
    value = getattr(nvml, name, _DEFAULT_CODES.get(name))
    return int(value) if value is not None else -1


def _is_nvml_error(nvml: Any, err: BaseException) -> bool:
    error_type = getattr(nvml, "NVMLError", None)
    return isinstance(error_type, type) and isinstance(err, error_type)


def _has_code(nvml: Any, err: BaseException, name: str) -> bool:
    return _is_nvml_error(nvml, err) and getattr(err, "value", None) == _code(nvml, name)


def describe_error(err: BaseException) -> str:
    """A human reason for an NVML (or other) error; str() of an NVMLError can itself fail."""
    try:
        text = str(err)
    except Exception:
        text = ""
    code = getattr(err, "value", None)
    if code is not None:
        return f"{text} (NVML error {code})" if text else f"NVML error {code}"
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def classify_error(nvml: Any, err: BaseException, call: str) -> Failure:
    """Which availability state an NVML error means (docs/architecture.md, "Availability of a fact")."""
    if any(_has_code(nvml, err, name) for name in _UNSUPPORTED_CODES):
        return UNSUPPORTED
    reason = f"{call}: {describe_error(err)}"
    if any(_has_code(nvml, err, name) for name in _UNAVAILABLE_CODES):
        return Unavailable(reason)
    return TemporarilyFailed(reason)


def format_cuda_version(version: int) -> str:
    """NVML's CUDA driver version integer (12020) as "12.2"."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def _text(value: object) -> str:
    # Old pynvml releases return bytes for strings; new ones return str.
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace").rstrip("\x00")
    if isinstance(value, str):
        return value
    raise TypeError(f"expected a string, got {type(value).__name__}")


def _known_text(value: object) -> Fact:
    text = _text(value).strip()
    return Known(text) if text else UNKNOWN


def _known_int(value: object) -> Fact:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return Known(value)


def _pstate(value: object) -> Fact:
    if isinstance(value, int) and 0 <= value <= _MAX_PSTATE:
        return Known(f"P{value}")
    return UNKNOWN


class _Scanner:
    """One scan inside an initialized NVML session."""

    def __init__(self, nvml: Any, xids: XidWatch | None = None) -> None:
        self.nvml = nvml
        self.xids = xids
        self.handles: dict[str, Any] = {}

    def call(self, name: str, *args: Any) -> _Ok[Any] | Failure:
        try:
            return _Ok(getattr(self.nvml, name)(*args))
        except Exception as err:
            return classify_error(self.nvml, err, name)

    def fact(self, result: _Ok[Any] | Failure, call: str, convert: Callable[[Any], Fact]) -> Fact:
        if not isinstance(result, _Ok):
            return result
        try:
            return convert(result.value)
        except (TypeError, ValueError, AttributeError) as err:
            return TemporarilyFailed(f"{call}: unexpected result: {err}")

    def memory_info(self, handle: Any) -> _Ok[Any] | Failure:
        """Memory as nvidia-smi shows it. The original call counts what the driver and firmware
        reserve as used (hundreds of MiB on an idle data-center GPU); _v2 leaves it out. The
        original only where the library lacks _v2 (drivers before R510)."""
        version = getattr(self.nvml, "nvmlMemory_v2", None)
        if version is not None:
            result = self.call("nvmlDeviceGetMemoryInfo", handle, version)
            if not isinstance(result, Unsupported):
                return result
        return self.call("nvmlDeviceGetMemoryInfo", handle)

    def identity_call(self, name: str, *args: Any) -> tuple[Any, str | None]:
        """(value, None) or (None, why) for a call the device's identity depends on."""
        try:
            return getattr(self.nvml, name)(*args), None
        except Exception as err:
            return None, f"{name} failed: {describe_error(err)}"

    def scan(self) -> NvmlScan:
        driver = self.fact(self.call("nvmlSystemGetDriverVersion"), "nvmlSystemGetDriverVersion", _known_text)
        cuda = self.fact(
            self.call("nvmlSystemGetCudaDriverVersion_v2"),
            "nvmlSystemGetCudaDriverVersion_v2",
            lambda v: Known(format_cuda_version(_int(v))),
        )
        count, why = self.identity_call("nvmlDeviceGetCount")
        if why is not None:
            return NvmlScan(
                status="incomplete",
                reason=why,
                driver_version=driver,
                cuda_driver_version=cuda,
                accelerators=[],
            )
        problems: list[str] = []
        accelerators: list[AcceleratorObservation] = []
        for index in range(_int(count)):
            device, problem = self.device(index)
            if device is None:
                problems.append(f"GPU at index {index}: {problem}")
            else:
                accelerators.append(device)
        accelerators, unlisted_xids = self.with_xids(accelerators)
        return NvmlScan(
            status="incomplete" if problems else "complete",
            reason="; ".join(problems) if problems else None,
            driver_version=driver,
            cuda_driver_version=cuda,
            accelerators=accelerators,
            unlisted_xids=unlisted_xids,
        )

    def with_xids(
        self, accelerators: list[AcceleratorObservation]
    ) -> tuple[list[AcceleratorObservation], dict[str, list[XidOccurrence]]]:
        """Register new GPUs for critical XIDs and drain what is pending, without blocking.
        Also returns the XIDs of registered GPUs this scan could not list (fallen off the bus)."""
        if self.xids is None:
            return accelerators, {}
        self.xids.register(self.nvml, self.handles, lambda err, call: classify_error(self.nvml, err, call))

        def uuid_of(device: Any) -> str | None:
            try:
                return _text(self.nvml.nvmlDeviceGetUUID(device)).strip() or None
            except Exception:  # a GPU that is gone: the watch matches its registered handle instead
                return None

        drained = self.xids.drain(uuid_of)
        out: list[AcceleratorObservation] = []
        for obs in accelerators:
            if obs.health is None:
                out.append(obs)
                continue
            health = msgspec.structs.replace(
                obs.health, xid_events=self.xids.status(obs.uuid), xids=drained.get(obs.uuid, [])
            )
            out.append(msgspec.structs.replace(obs, health=health))
        listed = {obs.uuid for obs in accelerators}
        return out, {uuid: xids for uuid, xids in sorted(drained.items()) if uuid not in listed}

    def device(self, index: int) -> tuple[AcceleratorObservation | None, str | None]:
        handle, why = self.identity_call("nvmlDeviceGetHandleByIndex", index)
        if why is not None:
            return None, why
        raw_uuid, why = self.identity_call("nvmlDeviceGetUUID", handle)
        if why is not None:
            return None, why
        try:
            uuid = _text(raw_uuid).strip()
        except TypeError as err:
            return None, f"nvmlDeviceGetUUID returned no UUID: {err}"
        if not uuid:
            return None, "nvmlDeviceGetUUID returned an empty UUID"

        nvml = self.nvml
        self.handles[uuid] = handle
        memory = self.memory_info(handle)
        memory_total = self.fact(memory, "nvmlDeviceGetMemoryInfo", lambda m: _known_int(m.total))
        memory_used = self.fact(memory, "nvmlDeviceGetMemoryInfo", lambda m: _known_int(m.used))
        utilization = self.call("nvmlDeviceGetUtilizationRates", handle)
        power = self.call("nvmlDeviceGetPowerUsage", handle)

        def clock(kind: str) -> Fact:
            return self.fact(
                self.call("nvmlDeviceGetClockInfo", handle, getattr(nvml, kind)),
                "nvmlDeviceGetClockInfo",
                _known_int,
            )

        telemetry: dict[str, Fact] = {
            "memory_used_bytes": memory_used,
            "memory_total_bytes": memory_total,
            "utilization_gpu_percent": self.fact(
                utilization, "nvmlDeviceGetUtilizationRates", lambda u: _known_int(u.gpu)
            ),
            "utilization_memory_percent": self.fact(
                utilization, "nvmlDeviceGetUtilizationRates", lambda u: _known_int(u.memory)
            ),
            "temperature_celsius": self.fact(
                self.call("nvmlDeviceGetTemperature", handle, nvml.NVML_TEMPERATURE_GPU),
                "nvmlDeviceGetTemperature",
                _known_int,
            ),
            # NVML reports milliwatts.
            "power_watts": self.fact(power, "nvmlDeviceGetPowerUsage", lambda mw: Known(_int(mw) / 1000.0)),
            "clock_graphics_mhz": clock("NVML_CLOCK_GRAPHICS"),
            "clock_sm_mhz": clock("NVML_CLOCK_SM"),
            "clock_memory_mhz": clock("NVML_CLOCK_MEM"),
            # 0 % is a measured fan speed, not an absent one.
            "fan_speed_percent": self.fact(
                self.call("nvmlDeviceGetFanSpeed", handle), "nvmlDeviceGetFanSpeed", _known_int
            ),
            "performance_state": self.fact(
                self.call("nvmlDeviceGetPerformanceState", handle), "nvmlDeviceGetPerformanceState", _pstate
            ),
        }
        mig_enable = getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1)
        observation = AcceleratorObservation(
            uuid=uuid,
            index=Known(index),
            name=self.fact(self.call("nvmlDeviceGetName", handle), "nvmlDeviceGetName", _known_text),
            pci_bus_id=self.fact(
                self.call("nvmlDeviceGetPciInfo", handle),
                "nvmlDeviceGetPciInfo",
                lambda p: _known_text(p.busId),
            ),
            memory_total_bytes=memory_total,
            compute_capability=self.fact(
                self.call("nvmlDeviceGetCudaComputeCapability", handle),
                "nvmlDeviceGetCudaComputeCapability",
                lambda cc: Known(f"{_int(cc[0])}.{_int(cc[1])}"),
            ),
            mig_mode=self.fact(
                self.call("nvmlDeviceGetMigMode", handle),
                "nvmlDeviceGetMigMode",
                lambda modes: Known("enabled" if _int(modes[0]) == mig_enable else "disabled"),
            ),
            telemetry=telemetry,
            health=collect_signals(
                nvml,
                handle,
                lambda name, *args: getattr(nvml, name)(*args),
                lambda err, call: classify_error(nvml, err, call),
            ),
        )
        return observation, None


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return value
