"""NVML scenarios built from real `nvidia-smi -q -x` captures.

The facts come from the netdata/netdata go.d `nvidia_smi` test data (GPL-3.0; see
/work/shared/fixtures/nvidia-smi/README.md); only the facts are copied, as Python literals, and
nothing outside the repository is read at test time. "N/A" in a capture becomes the NVML error
that produces it (NotSupported). Compute capabilities are not in the XML and come from NVIDIA's
published table. Each function returns a fresh Scenario, so a test may mutate it.
"""

from __future__ import annotations

import uuid

from tests.fakes.fake_pynvml import (
    NVML_DEVICE_MIG_DISABLE,
    NVML_DEVICE_MIG_ENABLE,
    NVML_FEATURE_DISABLED,
    NVML_FEATURE_ENABLED,
    nvmlClocksEventReasonGpuIdle,
)
from tests.fakes.nvml_devices import ECC_COUNTERS, FakeGpu, Scenario

MIB = 1024 * 1024


def a100_sxm4_mig() -> Scenario:
    # a100-sxm4-mig.xml: MIG enabled, so GPU/memory utilization are N/A; no fan (SXM, fan_speed N/A).
    return Scenario(
        driver_version="510.47.03",
        cuda_driver_version=11060,
        gpus=[
            FakeGpu(
                uuid="GPU-27b94a00-ed54-5c24-b1fd-1054085de32a",
                name="NVIDIA A100-SXM4-40GB",
                pci_bus_id="00000000:00:04.0",
                memory_total_bytes=40960 * MIB,
                memory_used_bytes=38 * MIB,
                memory_reserved_bytes=605 * MIB,  # fb_memory_usage/reserved
                compute_capability=(8, 0),
                mig_mode=NVML_DEVICE_MIG_ENABLE,
                mig_pending=NVML_DEVICE_MIG_ENABLE,
                temperature_celsius=36,
                power_milliwatts=66_920,
                clock_graphics_mhz=1410,
                clock_sm_mhz=1410,
                clock_memory_mhz=1215,
                performance_state=0,
                # ecc_mode Enabled; volatile counters N/A under MIG, aggregate 0; remapped_rows and
                # retired_pages N/A in this capture; no clock event reason active; replay_counter 0.
                ecc_mode=NVML_FEATURE_ENABLED,
                ecc_errors={"corrected_aggregate": 0, "uncorrected_aggregate": 0},
                pcie_replay_count=0,
                errors={"fan_speed": "NotSupported", "utilization": "NotSupported"},
            )
        ],
    )


def rtx_4090_driver_535() -> Scenario:
    # rtx-4090-driver-535.xml: fan at 0 % (a real reading), gpu_power_readings/power_draw 26.84 W.
    return Scenario(
        driver_version="535.86.05",
        cuda_driver_version=12020,
        gpus=[
            FakeGpu(
                uuid="GPU-71d1acc2-662d-2166-bf9f-65272d2fc437",
                name="NVIDIA GeForce RTX 4090",
                pci_bus_id="00000000:84:00.0",
                memory_total_bytes=24564 * MIB,
                memory_used_bytes=2 * MIB,
                memory_reserved_bytes=346 * MIB,  # fb_memory_usage/reserved
                compute_capability=(8, 9),
                mig_mode=None,  # MIG current=N/A: GeForce has no MIG
                utilization_gpu_percent=0,
                utilization_memory_percent=0,
                temperature_celsius=40,
                power_milliwatts=26_840,
                clock_graphics_mhz=210,
                clock_sm_mhz=210,
                clock_memory_mhz=405,
                fan_speed_percent=0,
                performance_state=8,
                # ECC Disabled (counters N/A); remapped_rows 0/0/No/No; gpu_idle Active.
                clock_event_reasons=nvmlClocksEventReasonGpuIdle,
                ecc_mode=NVML_FEATURE_DISABLED,
                remapped_rows=(0, 0, 0, 0),
                pcie_replay_count=0,
            )
        ],
    )


def rtx_3060_laptop() -> Scenario:
    # rtx-3060.xml: laptop GPU, fan_speed N/A (the fan belongs to the laptop, not the GPU).
    return Scenario(
        driver_version="515.65.01",
        cuda_driver_version=11070,
        gpus=[
            FakeGpu(
                uuid="GPU-473d8d0f-d462-185c-6b36-6fc23e23e571",
                name="NVIDIA GeForce RTX 3060 Laptop GPU",
                pci_bus_id="00000000:01:00.0",
                memory_total_bytes=6144 * MIB,
                memory_used_bytes=5 * MIB,
                memory_reserved_bytes=197 * MIB,  # fb_memory_usage/reserved
                compute_capability=(8, 6),
                mig_mode=None,
                utilization_gpu_percent=0,
                utilization_memory_percent=0,
                temperature_celsius=45,
                power_milliwatts=8_700,
                clock_graphics_mhz=210,
                clock_sm_mhz=210,
                clock_memory_mhz=405,
                performance_state=8,
                # No ECC (current_ecc N/A), no remapping, no retirement; gpu_idle Active.
                clock_event_reasons=nvmlClocksEventReasonGpuIdle,
                pcie_replay_count=0,
                errors={"fan_speed": "NotSupported"},
            )
        ],
    )


def tesla_p100() -> Scenario:
    # tesla-p100.xml: passively cooled PCIe card, fan_speed N/A.
    return Scenario(
        driver_version="510.47.03",
        cuda_driver_version=11060,
        gpus=[
            FakeGpu(
                uuid="GPU-d3da8716-eaab-75db-efc1-60e88e1cd55e",
                name="Tesla P100-PCIE-16GB",
                pci_bus_id="00000000:00:04.0",
                memory_total_bytes=16384 * MIB,
                memory_used_bytes=0,
                memory_reserved_bytes=103 * MIB,  # fb_memory_usage/reserved
                compute_capability=(6, 0),
                mig_mode=None,
                utilization_gpu_percent=0,
                utilization_memory_percent=0,
                temperature_celsius=38,
                power_milliwatts=26_160,
                clock_graphics_mhz=405,
                clock_sm_mhz=405,
                clock_memory_mhz=715,
                performance_state=0,
                # ECC Enabled: volatile 0/0, aggregate single-bit 3, double-bit 0; retired pages 0/0,
                # pending No; remapped_rows N/A (Pascal); gpu_idle Active.
                clock_event_reasons=nvmlClocksEventReasonGpuIdle,
                ecc_mode=NVML_FEATURE_ENABLED,
                ecc_errors={
                    "corrected_volatile": 0,
                    "uncorrected_volatile": 0,
                    "corrected_aggregate": 3,
                    "uncorrected_aggregate": 0,
                },
                retired_pages=(0, 0, False),
                pcie_replay_count=0,
                errors={"fan_speed": "NotSupported"},
            )
        ],
    )


def rtx_2080_windows() -> Scenario:
    # rtx-2080-win.xml: Windows (WDDM) host, every metric present, fan at 37 %.
    return Scenario(
        driver_version="516.59",
        cuda_driver_version=11070,
        gpus=[
            FakeGpu(
                uuid="GPU-fbd55ed4-1eec-4423-0a47-ad594b4333e3",
                name="NVIDIA GeForce RTX 2080",
                pci_bus_id="00000000:0A:00.0",
                memory_total_bytes=8192 * MIB,
                memory_used_bytes=862 * MIB,
                memory_reserved_bytes=182 * MIB,  # fb_memory_usage/reserved
                compute_capability=(7, 5),
                mig_mode=None,
                utilization_gpu_percent=2,
                utilization_memory_percent=7,
                temperature_celsius=29,
                power_milliwatts=14_500,
                clock_graphics_mhz=193,
                clock_sm_mhz=193,
                clock_memory_mhz=403,
                fan_speed_percent=37,
                performance_state=8,
                # No ECC; gpu_idle Active; NVML's event API exists on Linux only.
                clock_event_reasons=nvmlClocksEventReasonGpuIdle,
                pcie_replay_count=0,
                events_supported=False,
            )
        ],
    )


def h200_driver_580() -> Scenario:
    # An idle NVIDIA H200 on driver 580.159.04 (a virtual machine's GPU, hence PCI 00:06.0), read
    # with `nvidia-smi -q -x` and NVML side by side (docs/real-gpu-validation.md): 0 MiB used of
    # 143771 MiB with 615 MiB reserved, 28 C, 78.07 W, clocks 345/345/3201 MHz, fan N/A (SXM),
    # ECC on with clean counters, row remapping (page retirement N/A), XID events registrable.
    return Scenario(
        driver_version="580.159.04",
        cuda_driver_version=13000,
        gpus=[
            FakeGpu(
                uuid="GPU-15b57630-a909-6fe8-a1bc-f636b5552f5b",
                name="NVIDIA H200",
                pci_bus_id="00000000:00:06.0",
                memory_total_bytes=143771 * MIB,
                memory_used_bytes=0,
                memory_reserved_bytes=644_939_776,
                compute_capability=(9, 0),
                mig_mode=NVML_DEVICE_MIG_DISABLE,
                mig_pending=NVML_DEVICE_MIG_DISABLE,
                temperature_celsius=28,
                power_milliwatts=78_070,
                clock_graphics_mhz=345,
                clock_sm_mhz=345,
                clock_memory_mhz=3201,
                performance_state=0,
                clock_event_reasons=nvmlClocksEventReasonGpuIdle,
                ecc_mode=NVML_FEATURE_ENABLED,
                ecc_errors=dict.fromkeys(ECC_COUNTERS, 0),
                remapped_rows=(0, 0, 0, 0),
                pcie_replay_count=0,
                errors={"fan_speed": "NotSupported"},
            )
        ],
    )


CAPTURES = {
    "a100-sxm4-mig": a100_sxm4_mig,
    "rtx-4090-driver-535": rtx_4090_driver_535,
    "rtx-3060": rtx_3060_laptop,
    "tesla-p100": tesla_p100,
    "rtx-2080-win": rtx_2080_windows,
    "h200-driver-580": h200_driver_580,
}

# PCI bus IDs of the eight SXM GPUs on a typical HGX H100/H200 baseboard.
_HGX_BUS_IDS = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")
_H200_NAMESPACE = uuid.UUID("5b0c7b8e-8c53-4c59-9a55-0c1d9a1f2f00")


def h200_gpu(index: int) -> FakeGpu:
    """One H200-like GPU with a UUID derived from its index (stable across runs)."""
    bus = _HGX_BUS_IDS[index] if index < len(_HGX_BUS_IDS) else f"{(index * 7) % 256:02X}"
    domain = index // len(_HGX_BUS_IDS)
    return FakeGpu(
        uuid=f"GPU-{uuid.uuid5(_H200_NAMESPACE, f'h200-{index}')}",
        name="NVIDIA H200",
        pci_bus_id=f"{domain:08X}:{bus}:00.0",
        memory_total_bytes=143771 * MIB,
        memory_used_bytes=(1 + index) * 512 * MIB,
        # an H200's driver reserves this much (NVML _v2 `reserved`, driver 580)
        memory_reserved_bytes=644_939_776,
        compute_capability=(9, 0),
        mig_mode=NVML_DEVICE_MIG_DISABLE,
        utilization_gpu_percent=(index * 13) % 101,
        utilization_memory_percent=(index * 7) % 101,
        temperature_celsius=30 + index % 20,
        power_milliwatts=120_000 + index * 1_000,
        clock_graphics_mhz=1980,
        clock_sm_mhz=1980,
        clock_memory_mhz=3201,
        errors={"fan_speed": "NotSupported"},  # SXM modules are cooled by the chassis
        # A data-center Hopper: ECC on with clean counters, row remapping (no page retirement).
        ecc_mode=NVML_FEATURE_ENABLED,
        ecc_errors=dict.fromkeys(ECC_COUNTERS, 0),
        remapped_rows=(0, 0, 0, 0),
    )


def multi_gpu_scenario(n: int = 8) -> Scenario:
    """An HGX-H200-like host with `n` GPUs (for benchmarks and scale tests)."""
    return Scenario(
        driver_version="570.133.20",
        cuda_driver_version=12080,
        gpus=[h200_gpu(index) for index in range(n)],
    )
