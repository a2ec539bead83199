"""The GPU health signals NVML exposes, collected per accelerator as typed facts.

Each signal is a fact in the availability form (NOTES.md section 5): a consumer GPU without ECC
reports `unsupported` for its ECC counters, never 0. Counters that only grow (ECC counts, retired
pages, PCIe replays) are telemetry; XIDs are occurrences, drained from NVML's event API at each
collection without blocking, and recorded once each by the ledger.

Verdicts are not decided here: `domain.health` holds the rule table.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, Generic, TypeAlias

import msgspec
from typing_extensions import TypeVar

from collectors.contract import (
    MAX_CLOCK_EVENT_REASONS,
    MAX_HEALTH_COUNTERS,
    MAX_XIDS,
    AwareDatetime,
    CountOrFlagFact,
    EccModeFact,
    ErrorCountFact,
    FlagFact,
    ObservedShortText,
    XidCode,
)
from collectors.facts import UNKNOWN, Fact, Known, TemporarilyFailed

# NVML's clock event (formerly "throttle") reason bits, by the names operators know from
# `nvidia-smi -q` (clocks_event_reason_<name>).
CLOCK_EVENT_REASONS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}
ECC_COUNTERS: tuple[str, ...] = (
    "corrected_volatile",
    "uncorrected_volatile",
    "corrected_aggregate",
    "uncorrected_aggregate",
)
REMAPPED_ROWS: tuple[str, ...] = ("correctable", "uncorrectable", "pending", "failure")
RETIRED_PAGES: tuple[str, ...] = ("single_bit", "double_bit", "pending")

# Real pynvml values, used when the module passed in lacks the constant.
_EVENT_TYPE_XID_CRITICAL = 0x8
_ERROR_TIMEOUT = 10
_FEATURE_ENABLED = 1


# The ledger stores XIDs and health signals too (events, checkpoints) and reads them back with
# these classes as they stand, their type parameters at their defaults (what any release stored);
# an observation's fields name them with the contract's bounds (`ObservedHealthSignals`, below).
_Code = TypeVar("_Code", bound=int, default=int, covariant=True)
_At = TypeVar("_At", bound=datetime, default=datetime, covariant=True)
_Flags = TypeVar("_Flags", bound=dict[str, Fact], default=dict[str, Fact], covariant=True)
_Counts = TypeVar("_Counts", bound=dict[str, Fact], default=dict[str, Fact], covariant=True)
_CountsOrFlags = TypeVar("_CountsOrFlags", bound=dict[str, Fact], default=dict[str, Fact], covariant=True)
_Mode = TypeVar("_Mode", bound=Fact, default=Fact, covariant=True)
_Count = TypeVar("_Count", bound=Fact, default=Fact, covariant=True)
_Flag = TypeVar("_Flag", bound=Fact, default=Fact, covariant=True)


# Untracked by the garbage collector, as observations are (collectors/observations.py).
class XidOccurrence(msgspec.Struct, Generic[_Code, _At], frozen=True, forbid_unknown_fields=True, gc=False):
    """One XID error: its code and when the collector drained it (NVML's event carries no time)."""

    code: _Code
    at: _At


_Xids = TypeVar("_Xids", bound=list[XidOccurrence], default=list[XidOccurrence], covariant=True)


class AcceleratorHealthSignals(
    msgspec.Struct,
    Generic[_Flags, _Mode, _Counts, _CountsOrFlags, _Count, _Flag, _Xids],
    frozen=True,
    forbid_unknown_fields=True,
    gc=False,
):
    """What NVML says about one GPU's health at one collection."""

    # Reason name (CLOCK_EVENT_REASONS) -> Known(bool active) or the call's failure.
    clock_event_reasons: _Flags
    ecc_mode: _Mode  # "enabled" | "disabled"
    ecc_errors: _Counts  # ECC_COUNTERS -> count
    remapped_rows: _CountsOrFlags  # Ampere and later: counts, pending/failure as bools
    retired_pages: _CountsOrFlags  # before Ampere: page counts, pending as bool
    pcie_replay_count: _Count
    # Known(True) while the XID event set is registered for this GPU; the failure otherwise.
    xid_events: _Flag
    xids: _Xids = []  # type: ignore[assignment]


if TYPE_CHECKING:
    ObservedXids: TypeAlias = list[XidOccurrence]
    ObservedHealthSignals: TypeAlias = AcceleratorHealthSignals
else:
    ObservedXids = Annotated[list[XidOccurrence[XidCode, AwareDatetime]], msgspec.Meta(max_length=MAX_XIDS)]
    ObservedHealthSignals = AcceleratorHealthSignals[
        Annotated[dict[ObservedShortText, FlagFact], msgspec.Meta(max_length=MAX_CLOCK_EVENT_REASONS)],
        EccModeFact,
        Annotated[dict[ObservedShortText, ErrorCountFact], msgspec.Meta(max_length=MAX_HEALTH_COUNTERS)],
        Annotated[dict[ObservedShortText, CountOrFlagFact], msgspec.Meta(max_length=MAX_HEALTH_COUNTERS)],
        ErrorCountFact,
        FlagFact,
        ObservedXids,
    ]


def _same_device(a: Any, b: Any) -> bool:
    """Whether two NVML device handles (ctypes pointers in pynvml) point at the same device."""
    if a is b:
        return True
    try:
        return bool(ctypes.cast(a, ctypes.c_void_p).value == ctypes.cast(b, ctypes.c_void_p).value)
    except (TypeError, ctypes.ArgumentError):
        return False


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return value


Call = Callable[..., Any]
"""`call(name, *args) -> value`; raises what NVML raised."""
Classify = Callable[[BaseException, str], Fact]


def _fact(
    call: Call, classify: Classify, name: str, args: tuple[Any, ...], convert: Callable[[Any], Fact]
) -> Fact:
    try:
        value = call(name, *args)
    except Exception as err:
        return classify(err, name)
    try:
        return convert(value)
    except (TypeError, ValueError, AttributeError, IndexError) as err:
        return TemporarilyFailed(f"{name}: unexpected result: {err}")


def _group(names: tuple[str, ...], result: Fact | dict[str, Fact]) -> dict[str, Fact]:
    return dict(result) if isinstance(result, dict) else {n: result for n in names}


def _call_group(
    call: Call,
    classify: Classify,
    name: str,
    args: tuple[Any, ...],
    names: tuple[str, ...],
    convert: Callable[[Any], dict[str, Fact]],
) -> dict[str, Fact]:
    try:
        value = call(name, *args)
    except Exception as err:
        return _group(names, classify(err, name))
    try:
        return convert(value)
    except (TypeError, ValueError, AttributeError, IndexError) as err:
        return _group(names, TemporarilyFailed(f"{name}: unexpected result: {err}"))


def collect_signals(nvml: Any, handle: Any, call: Call, classify: Classify) -> AcceleratorHealthSignals:
    """Every signal but the XIDs (which `XidWatch` drains for all GPUs at once)."""

    def const(name: str, default: int) -> int:
        value = getattr(nvml, name, default)
        return value if isinstance(value, int) else default

    # The newer name first; drivers before 535 only have the "throttle" one.
    reasons_call = (
        "nvmlDeviceGetCurrentClocksEventReasons"
        if hasattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons")
        else "nvmlDeviceGetCurrentClocksThrottleReasons"
    )
    clock_event_reasons = _call_group(
        call,
        classify,
        reasons_call,
        (handle,),
        tuple(CLOCK_EVENT_REASONS),
        lambda mask: {n: Known(bool(_int(mask) & bit)) for n, bit in CLOCK_EVENT_REASONS.items()},
    )
    enabled = const("NVML_FEATURE_ENABLED", _FEATURE_ENABLED)
    ecc_mode = _fact(
        call,
        classify,
        "nvmlDeviceGetEccMode",
        (handle,),
        lambda modes: Known("enabled" if _int(modes[0]) == enabled else "disabled"),
    )
    corrected = const("NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
    uncorrected = const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
    volatile = const("NVML_VOLATILE_ECC", 0)
    aggregate = const("NVML_AGGREGATE_ECC", 1)
    ecc_args = {
        "corrected_volatile": (corrected, volatile),
        "uncorrected_volatile": (uncorrected, volatile),
        "corrected_aggregate": (corrected, aggregate),
        "uncorrected_aggregate": (uncorrected, aggregate),
    }
    ecc_errors = {
        name: _fact(call, classify, "nvmlDeviceGetTotalEccErrors", (handle, *args), lambda v: Known(_int(v)))
        for name, args in ecc_args.items()
    }
    remapped_rows = _call_group(
        call,
        classify,
        "nvmlDeviceGetRemappedRows",
        (handle,),
        REMAPPED_ROWS,
        lambda r: {
            "correctable": Known(_int(r[0])),
            "uncorrectable": Known(_int(r[1])),
            "pending": Known(bool(_int(r[2]))),
            "failure": Known(bool(_int(r[3]))),
        },
    )
    sbe = const("NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", 0)
    dbe = const("NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1)
    retired_pages = {
        "single_bit": _fact(
            call, classify, "nvmlDeviceGetRetiredPages", (handle, sbe), lambda p: Known(len(p))
        ),
        "double_bit": _fact(
            call, classify, "nvmlDeviceGetRetiredPages", (handle, dbe), lambda p: Known(len(p))
        ),
        "pending": _fact(
            call,
            classify,
            "nvmlDeviceGetRetiredPagesPendingStatus",
            (handle,),
            lambda v: Known(_int(v) == enabled),
        ),
    }
    pcie = _fact(call, classify, "nvmlDeviceGetPcieReplayCounter", (handle,), lambda v: Known(_int(v)))
    return AcceleratorHealthSignals(
        clock_event_reasons=clock_event_reasons,
        ecc_mode=ecc_mode,
        ecc_errors=ecc_errors,
        remapped_rows=remapped_rows,
        retired_pages=retired_pages,
        pcie_replay_count=pcie,
        xid_events=UNKNOWN,
    )


class XidWatch:
    """An NVML event set registered for critical XIDs, kept across collections.

    An event set lives only as long as the NVML session that created it, so the watch holds its
    own nvmlInit reference (NVML counts them) from registration until `close`. Each collection
    drains what is pending with a zero timeout: NVML answers NVML_ERROR_TIMEOUT when nothing is.
    """

    # At most this many XIDs are drained per collection, so a storm cannot stall a refresh.
    MAX_DRAIN = 256

    def __init__(self, clock: Callable[[], datetime] | None = None) -> None:
        self._clock = clock or (lambda: datetime.now(UTC))
        self._nvml: Any = None
        self._set: Any = None
        self._registered: dict[str, Fact] = {}  # GPU UUID -> Known(True) or why not
        self._handles: dict[str, Any] = {}  # GPU UUID -> the handle registered
        self._lock = threading.Lock()

    def status(self, uuid: str) -> Fact:
        return self._registered.get(uuid, UNKNOWN)

    def register(self, nvml: Any, devices: dict[str, Any], classify: Classify) -> None:
        """Register every GPU (UUID -> handle) not registered yet. Call inside an NVML session."""
        with self._lock:
            if self._set is None:
                try:
                    event_set = nvml.nvmlEventSetCreate()
                except Exception as err:
                    failure = classify(err, "nvmlEventSetCreate")
                    self._registered = dict.fromkeys(devices, failure)
                    return
                nvml.nvmlInit()  # our own reference: the set dies with the session
                self._nvml, self._set = nvml, event_set
            xid = getattr(nvml, "nvmlEventTypeXidCriticalError", _EVENT_TYPE_XID_CRITICAL)
            for uuid, handle in devices.items():
                if isinstance(self._registered.get(uuid), Known):
                    continue
                try:
                    nvml.nvmlDeviceRegisterEvents(handle, xid, self._set)
                    self._registered[uuid] = Known(True)
                    self._handles[uuid] = handle
                except Exception as err:
                    self._registered[uuid] = classify(err, "nvmlDeviceRegisterEvents")

    def drain(self, uuid_of: Callable[[Any], str | None]) -> dict[str, list[XidOccurrence]]:
        """The XIDs pending now, by GPU UUID, without blocking."""
        out: dict[str, list[XidOccurrence]] = {}
        with self._lock:
            nvml, event_set = self._nvml, self._set
            if event_set is None:
                return out
            timeout = getattr(nvml, "NVML_ERROR_TIMEOUT", _ERROR_TIMEOUT)
            for _ in range(self.MAX_DRAIN):
                try:
                    data = nvml.nvmlEventSetWait_v2(event_set, 0)
                except Exception as err:
                    if getattr(err, "value", None) != timeout:
                        # The set is broken (GPU lost, driver reloaded): register afresh next time.
                        self._close_locked()
                    break
                # A GPU that fell off the bus (XID 79) no longer answers its UUID: recognize it
                # by the handle it was registered with.
                uuid = uuid_of(data.device) or self._uuid_by_handle(data.device)
                if uuid is not None:
                    out.setdefault(uuid, []).append(XidOccurrence(code=int(data.eventData), at=self._clock()))
        return out

    def _uuid_by_handle(self, device: Any) -> str | None:
        for uuid, handle in self._handles.items():
            if _same_device(handle, device):
                return uuid
        return None

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        nvml, event_set = self._nvml, self._set
        self._nvml, self._set, self._registered, self._handles = None, None, {}, {}
        if event_set is None:
            return
        try:
            nvml.nvmlEventSetFree(event_set)
        except Exception:  # freeing a set of a lost session cannot be helped
            pass
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
