"""Small builders of observations and events for ledger and projection tests."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from collectors.facts import UNSUPPORTED, Known
from collectors.gpu_health import CLOCK_EVENT_REASONS, ECC_COUNTERS, AcceleratorHealthSignals
from collectors.observations import (
    AcceleratorObservation,
    CpuInfo,
    HardwareObservation,
    HostObservation,
    NvmlScan,
    OsInfo,
    StorageObservation,
)
from ledger.events import EventMetadata, EventPayload, NewEvent

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def host(
    hostname: str = "gpu-host-1", *, kernel: str = "6.8.0-45-generic", mem_avail: int = 100
) -> HostObservation:
    return HostObservation(
        hostname=hostname,
        os=OsInfo(
            name=Known("Ubuntu"), version=Known("24.04"), kernel=Known(kernel), architecture=Known("x86_64")
        ),
        cpu=CpuInfo(
            model=Known("AMD EPYC 9454"), sockets=Known(2), physical_cores=Known(96), logical_cores=Known(192)
        ),
        memory_total_bytes=Known(1_649_267_441_664),
        telemetry={
            "memory_available_bytes": Known(mem_avail),
            "memory_total_bytes": Known(1_649_267_441_664),
        },
        storage=[StorageObservation(mount="/", used_bytes=Known(10), total_bytes=Known(100))],
    )


def gpu(
    n: int,
    *,
    index: int | None = None,
    pci: str | None = None,
    temp: int = 40,
    fan: Known | None = None,
) -> AcceleratorObservation:
    return AcceleratorObservation(
        uuid=f"GPU-00000000-0000-4000-8000-{n:012d}",
        index=Known(n if index is None else index),
        name=Known("NVIDIA H200"),
        pci_bus_id=Known(pci or f"00000000:{0x18 + n:02X}:00.0"),
        memory_total_bytes=Known(150_754_820_096),
        compute_capability=Known("9.0"),
        mig_mode=Known("disabled"),
        telemetry={
            "temperature_celsius": Known(temp),
            "fan_speed_percent": fan if fan is not None else UNSUPPORTED,
            "utilization_gpu_percent": Known(0),
        },
    )


def scan(
    gpus: list[AcceleratorObservation],
    *,
    status: str = "complete",
    reason: str | None = None,
    driver: str = "580.95.05",
    cuda: str = "13.0",
) -> NvmlScan:
    return NvmlScan(
        status=status,  # type: ignore[arg-type]
        reason=reason,
        driver_version=Known(driver),
        cuda_driver_version=Known(cuda),
        accelerators=gpus,
    )


def observation(
    gpus: list[AcceleratorObservation] | None = None, *, nvml: NvmlScan | None = None, **host_kw: object
) -> HardwareObservation:
    return HardwareObservation(
        observed_at=T0,
        host=host(**host_kw),  # type: ignore[arg-type]
        nvml=nvml if nvml is not None else scan(gpus if gpus is not None else [gpu(0), gpu(1)]),
    )


def meta(at: datetime = T0, source: str = "local") -> EventMetadata:
    return EventMetadata(received_at=at, source=source, observed_at=at)  # type: ignore[arg-type]


def new(payload: EventPayload, at: datetime = T0) -> NewEvent:
    return NewEvent(payload=payload, metadata=meta(at))


def signals(**changes: object) -> AcceleratorHealthSignals:
    """A data-center GPU's health signals with nothing wrong (every fact known), then `changes`."""
    base: dict[str, object] = {
        "clock_event_reasons": {n: Known(False) for n in CLOCK_EVENT_REASONS},
        "ecc_mode": Known("enabled"),
        "ecc_errors": {n: Known(0) for n in ECC_COUNTERS},
        "remapped_rows": {
            "correctable": Known(0),
            "uncorrectable": Known(0),
            "pending": Known(False),
            "failure": Known(False),
        },
        "retired_pages": {"single_bit": Known(0), "double_bit": Known(0), "pending": Known(False)},
        "pcie_replay_count": Known(0),
        "xid_events": Known(True),
    }
    return AcceleratorHealthSignals(**{**base, **changes})  # type: ignore[arg-type]


def pending_remap(**changes: object) -> AcceleratorHealthSignals:
    """Degraded, reset_gpu: a row remap waits for a GPU reset."""
    return signals(
        remapped_rows={
            "correctable": Known(0),
            "uncorrectable": Known(1),
            "pending": Known(True),
            "failure": Known(False),
        },
        **changes,
    )


def uncorrected_ecc(count: int = 2, **changes: object) -> AcceleratorHealthSignals:
    """Failed, service: uncorrectable ECC errors since the driver loaded."""
    return signals(
        ecc_errors={**{n: Known(0) for n in ECC_COUNTERS}, "uncorrected_volatile": Known(count)}, **changes
    )


def with_health(
    observation: AcceleratorObservation, health: AcceleratorHealthSignals
) -> AcceleratorObservation:
    return msgspec.structs.replace(observation, health=health)
