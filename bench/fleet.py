"""Realistic inputs for the benchmarks: an eight-GPU fleet's observations, as the collectors
produce them (typed facts; NotSupported where NVML answers so), for the product's `reconcile`.

Nothing here is product code and nothing here is timed.
"""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime

from collectors.facts import UNSUPPORTED, Fact, Known
from collectors.observations import (
    AcceleratorObservation,
    CpuInfo,
    HardwareObservation,
    HostObservation,
    NvmlScan,
    OsInfo,
    StorageObservation,
)

GIB = 1024**3
MIB = 1024**2


class GpuModel:
    def __init__(
        self,
        name: str,
        memory_mib: int,
        cc: str,
        *,
        mig: str,
        fan: bool,
        tdp_w: float,
        bus_ids: tuple[str, ...],
        driver: str,
        cuda: str,
    ) -> None:
        self.name = name
        self.memory_total = memory_mib * MIB
        self.cc = cc
        self.mig = mig
        self.fan = fan
        self.tdp_w = tdp_w
        self.bus_ids = bus_ids
        self.driver = driver
        self.cuda = cuda


_HGX = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")
_PCIE = ("01", "21", "41", "61", "81", "A1", "C1", "E1")

# The eight-GPU node types of a typical fleet (facts as NVML reports them).
GPU_MODELS: tuple[GpuModel, ...] = (
    GpuModel("NVIDIA H200", 143771, "9.0", mig="disabled", fan=False, tdp_w=700, bus_ids=_HGX,
             driver="570.133.20", cuda="12.8"),
    GpuModel("NVIDIA H100 80GB HBM3", 81559, "9.0", mig="disabled", fan=False, tdp_w=700, bus_ids=_HGX,
             driver="550.127.08", cuda="12.4"),
    GpuModel("NVIDIA A100-SXM4-80GB", 81920, "8.0", mig="enabled", fan=False, tdp_w=400, bus_ids=_HGX,
             driver="535.216.03", cuda="12.2"),
    GpuModel("NVIDIA L40S", 46068, "8.9", mig="disabled", fan=True, tdp_w=350, bus_ids=_PCIE,
             driver="550.127.08", cuda="12.4"),
)  # fmt: skip

_GPU_NAMESPACE = uuid.UUID("9c1f0a52-3b9e-4d7a-a8a4-0f5b2c7d9e31")
T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def node_key(i: int) -> str:
    return f"bench-node-{i:06d}"


def model_of(i: int) -> GpuModel:
    return GPU_MODELS[i % len(GPU_MODELS)]


def gpu_uuid(node: int, index: int) -> str:
    return f"GPU-{uuid.uuid5(_GPU_NAMESPACE, f'{node}/{index}')}"


def accelerator_telemetry(model: GpuModel, rng: random.Random) -> dict[str, Fact]:
    util = rng.randint(0, 100)
    used = rng.randint(1, model.memory_total // MIB) * MIB
    mig = model.mig == "enabled"
    return {
        "memory_used_bytes": Known(used),
        "memory_total_bytes": Known(model.memory_total),
        # NVML answers NotSupported for utilization while MIG is enabled.
        "utilization_gpu_percent": UNSUPPORTED if mig else Known(util),
        "utilization_memory_percent": UNSUPPORTED if mig else Known(rng.randint(0, 100)),
        "temperature_celsius": Known(rng.randint(28, 84)),
        "power_watts": Known(round(60 + model.tdp_w * util / 100 * rng.uniform(0.7, 1.0), 3)),
        "clock_graphics_mhz": Known(rng.choice((210, 1410, 1755, 1980))),
        "clock_sm_mhz": Known(rng.choice((210, 1410, 1755, 1980))),
        "clock_memory_mhz": Known(rng.choice((1215, 2619, 3201))),
        "fan_speed_percent": Known(rng.randint(0, 100)) if model.fan else UNSUPPORTED,
        "performance_state": Known("P0" if util else "P8"),
    }


def node_observation(i: int, rng: random.Random, *, gpus: int = 8) -> HardwareObservation:
    """One refresh of node `i`: an eight-GPU server of one of the fleet's types."""
    model = model_of(i)
    ubuntu = ("22.04", "5.15.0-126-generic") if i % 3 else ("24.04", "6.8.0-49-generic")
    mem_total = (1024 + 1024 * (i % 2)) * GIB
    host = HostObservation(
        hostname=f"gpu-r{i // 32:03d}-u{i % 32:02d}.dc1.example.net",
        os=OsInfo(
            name=Known("Ubuntu"), version=Known(ubuntu[0]), kernel=Known(ubuntu[1]),
            architecture=Known("x86_64"),
        ),
        cpu=CpuInfo(
            model=Known("AMD EPYC 9454 48-Core Processor" if i % 2 else "Intel(R) Xeon(R) Platinum 8480+"),
            sockets=Known(2), physical_cores=Known(96 if i % 2 else 112),
            logical_cores=Known(192 if i % 2 else 224),
        ),
        memory_total_bytes=Known(mem_total),
        telemetry={
            # whole KiB, as psutil reads them off /proc/meminfo
            "memory_available_bytes": Known(rng.randint(mem_total // 8, mem_total) // 1024 * 1024),
            "memory_total_bytes": Known(mem_total),
        },
        storage=[
            StorageObservation(mount="/", used_bytes=Known(rng.randint(50, 400) * GIB),
                               total_bytes=Known(894 * GIB)),
            StorageObservation(mount="/var/lib/modelforge", used_bytes=Known(rng.randint(1, 30_000) * GIB),
                               total_bytes=Known(30_720 * GIB)),
        ],
    )  # fmt: skip
    accelerators = [
        AcceleratorObservation(
            uuid=gpu_uuid(i, g),
            index=Known(g),
            name=Known(model.name),
            pci_bus_id=Known(f"00000000:{model.bus_ids[g % 8]}:00.0"),
            memory_total_bytes=Known(model.memory_total),
            compute_capability=Known(model.cc),
            mig_mode=Known(model.mig),
            telemetry=accelerator_telemetry(model, rng),
        )
        for g in range(gpus)
    ]
    return HardwareObservation(
        observed_at=T0,
        host=host,
        nvml=NvmlScan(
            status="complete",
            reason=None,
            driver_version=Known(model.driver),
            cuda_driver_version=Known(model.cuda),
            accelerators=accelerators,
        ),
    )
