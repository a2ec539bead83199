"""NvidiaNvmlCollector against the fake NVML, fed with facts from real nvidia-smi captures."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest

from collectors.facts import (
    UNKNOWN,
    UNSUPPORTED,
    Fact,
    Known,
    TemporarilyFailed,
    Unavailable,
    Unsupported,
)
from collectors.nvml import NvidiaNvmlCollector, format_cuda_version
from collectors.observations import ACCELERATOR_METRICS, AcceleratorObservation, NvmlScan
from tests.fakes.fake_pynvml import NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_ENABLE, FakeNvml
from tests.fakes.nvml_devices import Scenario
from tests.fixtures_nvml import (
    CAPTURES,
    MIB,
    a100_sxm4_mig,
    h200_driver_580,
    multi_gpu_scenario,
    rtx_2080_windows,
    rtx_3060_laptop,
    rtx_4090_driver_535,
    tesla_p100,
)


@pytest.fixture
def fakes() -> Iterator[Callable[[Scenario], FakeNvml]]:
    """Builds fakes and releases their hung calls afterwards, so no test leaves a thread behind."""
    made: list[FakeNvml] = []

    def make(scenario: Scenario) -> FakeNvml:
        fake = FakeNvml(scenario)
        made.append(fake)
        return fake

    yield make
    for fake in made:
        fake.release()


def scan_of(fake: FakeNvml, timeout_seconds: float = 5.0) -> NvmlScan:
    collector = NvidiaNvmlCollector(nvml=fake, timeout_seconds=timeout_seconds)
    try:
        return collector.collect()
    finally:
        collector.close()  # frees the XID event set and the NVML reference it holds


def only_gpu(scan: NvmlScan) -> AcceleratorObservation:
    assert len(scan.accelerators) == 1
    return scan.accelerators[0]


# -- the five captures ------------------------------------------------------------------------


@pytest.mark.parametrize("capture", sorted(CAPTURES))
def test_every_capture_is_a_complete_scan_with_every_metric_named(capture: str) -> None:
    fake = FakeNvml(CAPTURES[capture]())
    scan = scan_of(fake)
    assert scan.status == "complete"
    assert scan.reason is None
    gpu = only_gpu(scan)
    assert tuple(gpu.telemetry) == ACCELERATOR_METRICS
    assert gpu.index == Known(0)
    assert gpu.uuid == fake.scenario.gpus[0].uuid
    # NVML is always shut down after a successful init (the XID watch's own reference at close).
    assert fake.refcount == 0
    assert fake.calls["init"] == fake.calls["shutdown"] >= 1


def test_a100_with_mig() -> None:
    scan = scan_of(FakeNvml(a100_sxm4_mig()))
    assert scan.driver_version == Known("510.47.03")
    assert scan.cuda_driver_version == Known("11.6")
    gpu = only_gpu(scan)
    assert gpu.uuid == "GPU-27b94a00-ed54-5c24-b1fd-1054085de32a"
    assert gpu.name == Known("NVIDIA A100-SXM4-40GB")
    assert gpu.pci_bus_id == Known("00000000:00:04.0")
    assert gpu.memory_total_bytes == Known(40960 * MIB)
    assert gpu.compute_capability == Known("8.0")
    assert gpu.mig_mode == Known("enabled")
    t = gpu.telemetry
    # Under MIG the whole-GPU utilization is not supported; the GPU stays fully observed.
    assert t["utilization_gpu_percent"] == UNSUPPORTED
    assert t["utilization_memory_percent"] == UNSUPPORTED
    assert t["fan_speed_percent"] == UNSUPPORTED
    assert t["power_watts"] == Known(66.92)
    assert t["temperature_celsius"] == Known(36)
    assert t["memory_used_bytes"] == Known(38 * MIB)
    assert t["memory_total_bytes"] == Known(40960 * MIB)
    assert t["clock_graphics_mhz"] == Known(1410)
    assert t["clock_sm_mhz"] == Known(1410)
    assert t["clock_memory_mhz"] == Known(1215)
    assert t["performance_state"] == Known("P0")


def test_rtx_4090_fan_at_zero_is_a_known_zero() -> None:
    scan = scan_of(FakeNvml(rtx_4090_driver_535()))
    assert scan.driver_version == Known("535.86.05")
    assert scan.cuda_driver_version == Known("12.2")
    gpu = only_gpu(scan)
    assert gpu.compute_capability == Known("8.9")
    assert gpu.telemetry["fan_speed_percent"] == Known(0)
    assert gpu.telemetry["utilization_gpu_percent"] == Known(0)
    assert gpu.telemetry["power_watts"] == Known(26.84)
    assert gpu.telemetry["temperature_celsius"] == Known(40)
    assert gpu.telemetry["performance_state"] == Known("P8")
    # GeForce has no MIG: NVML says NotSupported, which is not the same as "disabled".
    assert gpu.mig_mode == UNSUPPORTED
    wire = json.loads(msgspec.json.encode(gpu.telemetry))
    assert wire["fan_speed_percent"] == {"state": "known", "value": 0}


def test_fan_unsupported_is_not_zero() -> None:
    gpu = only_gpu(scan_of(FakeNvml(rtx_3060_laptop())))
    assert gpu.telemetry["fan_speed_percent"] == UNSUPPORTED
    assert gpu.telemetry["power_watts"] == Known(8.7)
    assert gpu.telemetry["temperature_celsius"] == Known(45)
    assert gpu.compute_capability == Known("8.6")
    wire = json.loads(msgspec.json.encode(gpu.telemetry))
    assert wire["fan_speed_percent"] == {"state": "unsupported"}


def test_p100_and_2080() -> None:
    p100 = scan_of(FakeNvml(tesla_p100()))
    assert p100.cuda_driver_version == Known("11.6")
    gpu = only_gpu(p100)
    assert gpu.name == Known("Tesla P100-PCIE-16GB")
    assert gpu.compute_capability == Known("6.0")
    assert gpu.memory_total_bytes == Known(16384 * MIB)
    assert gpu.telemetry["fan_speed_percent"] == UNSUPPORTED
    assert gpu.telemetry["memory_used_bytes"] == Known(0)

    rtx2080 = scan_of(FakeNvml(rtx_2080_windows()))
    assert rtx2080.driver_version == Known("516.59")
    assert rtx2080.cuda_driver_version == Known("11.7")
    gpu = only_gpu(rtx2080)
    assert gpu.compute_capability == Known("7.5")
    assert gpu.pci_bus_id == Known("00000000:0A:00.0")
    assert gpu.telemetry["fan_speed_percent"] == Known(37)
    assert gpu.telemetry["utilization_gpu_percent"] == Known(2)
    assert gpu.telemetry["utilization_memory_percent"] == Known(7)
    assert gpu.telemetry["power_watts"] == Known(14.5)


def test_idle_h200_as_nvidia_smi_shows_it() -> None:
    # nvidia-smi shows 0 MiB used; NVML's original memory call says 615 MiB, the driver's
    # reservation. Operators compare with nvidia-smi.
    scan = scan_of(FakeNvml(h200_driver_580()))
    assert scan.driver_version == Known("580.159.04")
    assert scan.cuda_driver_version == Known("13.0")
    gpu = only_gpu(scan)
    assert gpu.telemetry["memory_used_bytes"] == Known(0)
    assert gpu.telemetry["memory_total_bytes"] == Known(143771 * MIB)
    assert gpu.telemetry["power_watts"] == Known(78.07)
    assert gpu.telemetry["clock_sm_mhz"] == Known(345)
    assert gpu.telemetry["fan_speed_percent"] == UNSUPPORTED
    assert gpu.mig_mode == Known("disabled")
    assert gpu.compute_capability == Known("9.0")


def test_memory_used_without_the_v2_call_counts_the_reservation() -> None:
    # Drivers before R510 have no nvmlDeviceGetMemoryInfo_v2: the original call is all there is.
    scenario = tesla_p100()
    scenario.gpus[0].memory_info_v2 = False
    gpu = only_gpu(scan_of(FakeNvml(scenario)))
    assert gpu.telemetry["memory_used_bytes"] == Known(103 * MIB)
    assert gpu.memory_total_bytes == Known(16384 * MIB)


# -- error mapping (docs/architecture.md, "Availability of a fact") ----------------------------


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        ("NotSupported", Unsupported),
        ("FunctionNotFound", Unsupported),
        ("NoPermission", Unavailable),
        ("LibraryNotFound", Unavailable),
        ("DriverNotLoaded", Unavailable),
        ("GpuIsLost", TemporarilyFailed),
        ("Unknown", TemporarilyFailed),
        ("Timeout", TemporarilyFailed),
        ("ResetRequired", TemporarilyFailed),
        (21, TemporarilyFailed),  # NVML_ERROR_NO_DATA: no class of its own in the fake, as a raw code
    ],
)
def test_metric_error_mapping(error: str | int, expected: type[Fact]) -> None:
    scenario = rtx_2080_windows()
    scenario.gpus[0].errors["temperature"] = error
    scan = scan_of(FakeNvml(scenario))
    # A failed metric never makes the scan incomplete nor hides the GPU.
    assert scan.status == "complete"
    gpu = only_gpu(scan)
    fact = gpu.telemetry["temperature_celsius"]
    assert type(fact) is expected
    if isinstance(fact, Unavailable | TemporarilyFailed):
        assert "nvmlDeviceGetTemperature" in fact.reason
    assert gpu.telemetry["power_watts"] == Known(14.5)
    assert gpu.telemetry["fan_speed_percent"] == Known(37)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        ("name", "name"),
        ("pci_info", "pci_bus_id"),
        ("memory_info", "memory_total_bytes"),
        ("compute_capability", "compute_capability"),
        ("mig_mode", "mig_mode"),
    ],
)
def test_failed_inventory_fact_carries_its_state_and_the_scan_stays_complete(call: str, field: str) -> None:
    scenario = a100_sxm4_mig()
    scenario.gpus[0].errors[call] = "GpuIsLost"
    scan = scan_of(FakeNvml(scenario))
    assert scan.status == "complete"
    gpu = only_gpu(scan)
    assert isinstance(getattr(gpu, field), TemporarilyFailed)
    assert gpu.uuid == "GPU-27b94a00-ed54-5c24-b1fd-1054085de32a"


def test_memory_info_failure_reaches_inventory_and_telemetry() -> None:
    scenario = tesla_p100()
    scenario.gpus[0].errors["memory_info"] = "NoPermission"
    gpu = only_gpu(scan_of(FakeNvml(scenario)))
    assert isinstance(gpu.memory_total_bytes, Unavailable)
    assert isinstance(gpu.telemetry["memory_used_bytes"], Unavailable)
    assert isinstance(gpu.telemetry["memory_total_bytes"], Unavailable)


def test_an_exception_that_is_not_an_nvml_error_is_a_temporary_failure() -> None:
    fake = FakeNvml(tesla_p100())

    def broken(handle: object) -> str:
        raise RuntimeError("ctypes went sideways")

    fake.nvmlDeviceGetName = broken  # type: ignore[method-assign]
    scan = scan_of(fake)
    assert scan.status == "complete"
    name = only_gpu(scan).name
    assert isinstance(name, TemporarilyFailed)
    assert "ctypes went sideways" in name.reason


def test_driver_version_failure_is_a_fact_not_an_incomplete_scan() -> None:
    scenario = rtx_4090_driver_535()
    scenario.errors["driver_version"] = "Unknown"
    scenario.errors["cuda_driver_version"] = "FunctionNotFound"
    scan = scan_of(FakeNvml(scenario))
    assert scan.status == "complete"
    assert isinstance(scan.driver_version, TemporarilyFailed)
    assert scan.cuda_driver_version == UNSUPPORTED
    assert len(scan.accelerators) == 1


# -- scan status ------------------------------------------------------------------------------


def test_lost_gpu_makes_the_scan_incomplete_and_is_omitted() -> None:
    scenario = multi_gpu_scenario(3)
    scenario.gpus[1].lost = True
    fake = FakeNvml(scenario)
    scan = scan_of(fake)
    assert scan.status == "incomplete"
    assert scan.reason is not None
    assert "index 1" in scan.reason
    assert "GPU is lost" in scan.reason
    assert [gpu.uuid for gpu in scan.accelerators] == [scenario.gpus[0].uuid, scenario.gpus[2].uuid]
    assert [gpu.index for gpu in scan.accelerators] == [Known(0), Known(2)]
    assert fake.refcount == 0


def test_uuid_failure_makes_the_scan_incomplete() -> None:
    scenario = multi_gpu_scenario(2)
    scenario.gpus[0].errors["uuid"] = "Unknown"
    scan = scan_of(FakeNvml(scenario))
    assert scan.status == "incomplete"
    assert scan.reason is not None and "index 0" in scan.reason and "nvmlDeviceGetUUID" in scan.reason
    assert [gpu.uuid for gpu in scan.accelerators] == [scenario.gpus[1].uuid]


def test_empty_uuid_is_no_identity() -> None:
    scenario = multi_gpu_scenario(1)
    scenario.gpus[0].uuid = ""
    scan = scan_of(FakeNvml(scenario))
    assert scan.status == "incomplete"
    assert scan.accelerators == []


def test_device_count_failure_is_incomplete_with_no_devices() -> None:
    scenario = multi_gpu_scenario(2)
    scenario.errors["device_count"] = "Unknown"
    fake = FakeNvml(scenario)
    scan = scan_of(fake)
    assert scan.status == "incomplete"
    assert scan.reason is not None and "nvmlDeviceGetCount" in scan.reason
    assert scan.accelerators == []
    assert scan.driver_version == Known("570.133.20")
    assert fake.refcount == 0


@pytest.mark.parametrize(
    ("init_error", "reason"),
    [("LibraryNotFound", "NVML library not found"), ("DriverNotLoaded", "NVIDIA driver not loaded")],
)
def test_init_failure_is_unavailable(init_error: str, reason: str) -> None:
    scenario = rtx_4090_driver_535()
    scenario.init_error = init_error
    fake = FakeNvml(scenario)
    scan = scan_of(fake)
    assert scan.status == "unavailable"
    assert scan.reason == reason
    assert scan.accelerators == []
    assert scan.driver_version == Unavailable(reason)
    assert scan.cuda_driver_version == Unavailable(reason)
    # No shutdown without a successful init (real NVML would answer Uninitialized).
    assert fake.calls["shutdown"] == 0
    assert fake.calls["device_count"] == 0


def test_transient_init_failure_is_unavailable_with_temporarily_failed_facts() -> None:
    scenario = rtx_4090_driver_535()
    scenario.init_error = "Unknown"
    scan = scan_of(FakeNvml(scenario))
    assert scan.status == "unavailable"
    assert scan.reason is not None and "nvmlInit failed" in scan.reason
    assert isinstance(scan.driver_version, TemporarilyFailed)


def test_no_gpus_is_a_complete_empty_scan() -> None:
    scan = scan_of(FakeNvml(Scenario(driver_version="580.65.06", cuda_driver_version=13000)))
    assert scan.status == "complete"
    assert scan.accelerators == []
    assert scan.cuda_driver_version == Known("13.0")


# -- MIG, versions, strings -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("current", "expected"),
    [
        (NVML_DEVICE_MIG_ENABLE, Known("enabled")),
        (NVML_DEVICE_MIG_DISABLE, Known("disabled")),
        (None, UNSUPPORTED),
    ],
)
def test_mig_mode(current: int | None, expected: Fact) -> None:
    scenario = a100_sxm4_mig()
    scenario.gpus[0].mig_mode = current
    scenario.gpus[0].mig_pending = None
    assert only_gpu(scan_of(FakeNvml(scenario))).mig_mode == expected


def test_mig_mode_reports_the_current_not_the_pending_mode() -> None:
    scenario = a100_sxm4_mig()
    scenario.gpus[0].mig_mode = NVML_DEVICE_MIG_DISABLE
    scenario.gpus[0].mig_pending = NVML_DEVICE_MIG_ENABLE  # takes effect after a GPU reset
    assert only_gpu(scan_of(FakeNvml(scenario))).mig_mode == Known("disabled")


@pytest.mark.parametrize(
    ("version", "text"),
    [(12020, "12.2"), (11060, "11.6"), (11070, "11.7"), (13010, "13.1"), (12080, "12.8"), (10010, "10.1")],
)
def test_cuda_version_formatting(version: int, text: str) -> None:
    assert format_cuda_version(version) == text


def test_cuda_version_in_the_scan() -> None:
    scenario = multi_gpu_scenario(1)
    scenario.cuda_driver_version = 13010
    assert scan_of(FakeNvml(scenario)).cuda_driver_version == Known("13.1")


def test_bytes_from_old_pynvml_are_normalized_to_str() -> None:
    scenario = rtx_2080_windows()
    scenario.strings_as_bytes = True
    scan = scan_of(FakeNvml(scenario))
    gpu = only_gpu(scan)
    assert scan.driver_version == Known("516.59")
    assert gpu.uuid == "GPU-fbd55ed4-1eec-4423-0a47-ad594b4333e3"
    assert gpu.name == Known("NVIDIA GeForce RTX 2080")
    assert gpu.pci_bus_id == Known("00000000:0A:00.0")


def test_unknown_performance_state_is_unknown_not_a_state() -> None:
    scenario = tesla_p100()
    scenario.gpus[0].performance_state = 32  # NVML_PSTATE_UNKNOWN
    assert only_gpu(scan_of(FakeNvml(scenario))).telemetry["performance_state"] == UNKNOWN


def test_power_is_converted_from_milliwatts() -> None:
    scenario = tesla_p100()
    scenario.gpus[0].power_milliwatts = 0
    assert only_gpu(scan_of(FakeNvml(scenario))).telemetry["power_watts"] == Known(0.0)
    scenario.gpus[0].power_milliwatts = 700_123
    assert only_gpu(scan_of(FakeNvml(scenario))).telemetry["power_watts"] == Known(700.123)


# -- refreshes of a changing host -------------------------------------------------------------


def test_changes_between_refreshes_are_observed() -> None:
    scenario = multi_gpu_scenario(3)
    fake = FakeNvml(scenario)
    collector = NvidiaNvmlCollector(nvml=fake)
    first = collector.collect()
    by_uuid = {gpu.uuid: gpu for gpu in first.accelerators}

    scenario.driver_version = "575.51.03"
    scenario.cuda_driver_version = 12090
    scenario.gpus[0], scenario.gpus[1] = scenario.gpus[1], scenario.gpus[0]
    scenario.gpus[0].pci_bus_id = "00000000:C1:00.0"
    removed = scenario.gpus.pop()
    second = collector.collect()

    assert second.status == "complete"
    assert second.driver_version == Known("575.51.03")
    assert second.cuda_driver_version == Known("12.9")
    assert removed.uuid not in {gpu.uuid for gpu in second.accelerators}
    moved = second.accelerators[0]
    assert moved.uuid == first.accelerators[1].uuid
    assert moved.index == Known(0)
    assert by_uuid[moved.uuid].index == Known(1)
    assert moved.pci_bus_id == Known("00000000:C1:00.0")
    # Two scan sessions plus the XID watch's one reference, which it holds until closed.
    assert fake.refcount == 1 and fake.calls["init"] == 3
    collector.close()
    assert fake.refcount == 0


def test_eight_gpu_host() -> None:
    scan = scan_of(FakeNvml(multi_gpu_scenario(8)))
    assert scan.status == "complete"
    assert len(scan.accelerators) == 8
    assert len({gpu.uuid for gpu in scan.accelerators}) == 8
    assert len({msgspec.json.encode(gpu.pci_bus_id) for gpu in scan.accelerators}) == 8
    assert all(gpu.mig_mode == Known("disabled") for gpu in scan.accelerators)
    assert all(gpu.compute_capability == Known("9.0") for gpu in scan.accelerators)


def test_scan_round_trips_through_the_wire_form() -> None:
    scan = scan_of(FakeNvml(a100_sxm4_mig()))
    assert msgspec.json.decode(msgspec.json.encode(scan), type=NvmlScan) == scan


# -- timeouts ---------------------------------------------------------------------------------


def test_a_hung_call_returns_incomplete_within_the_timeout(fakes: Callable[[Scenario], FakeNvml]) -> None:
    scenario = multi_gpu_scenario(2)
    scenario.gpus[1].hang_seconds = 30.0
    scenario.gpus[1].hang_call = "temperature"
    fake = fakes(scenario)
    collector = NvidiaNvmlCollector(nvml=fake, timeout_seconds=0.3)

    started = time.monotonic()
    scan = collector.collect()
    elapsed = time.monotonic() - started

    assert elapsed < 1.5
    assert scan.status == "incomplete"
    assert scan.reason == "NVML did not answer within 0.3s"
    assert scan.accelerators == []
    assert isinstance(scan.driver_version, TemporarilyFailed)
    assert isinstance(scan.cuda_driver_version, TemporarilyFailed)

    # While the first call is still hung, no second NVML session is started behind it.
    started = time.monotonic()
    again = collector.collect()
    assert time.monotonic() - started < 0.2
    assert again.status == "incomplete"
    assert again.reason is not None and "still busy" in again.reason
    assert fake.calls["init"] == 1

    # Once the driver answers, the collector works again and the hung session was shut down.
    scenario.gpus[1].hang_seconds = 0.0
    fake.release()
    deadline = time.monotonic() + 5
    while fake.calls["shutdown"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.refcount == 1  # the XID watch's own reference only
    recovered = collector.collect()
    assert recovered.status == "complete"
    assert len(recovered.accelerators) == 2


def test_a_hung_init_times_out(fakes: Callable[[Scenario], FakeNvml]) -> None:
    scenario = rtx_4090_driver_535()
    scenario.hang_call = "init"
    scenario.hang_seconds = 30.0
    started = time.monotonic()
    scan = NvidiaNvmlCollector(nvml=fakes(scenario), timeout_seconds=0.2).collect()
    assert time.monotonic() - started < 1.5
    assert scan.status == "incomplete"
    assert scan.accelerators == []


async def test_collect_async_times_out_without_blocking_the_loop(
    fakes: Callable[[Scenario], FakeNvml],
) -> None:
    scenario = multi_gpu_scenario(1)
    scenario.hang_call = "device_count"
    scenario.hang_seconds = 30.0
    collector = NvidiaNvmlCollector(nvml=fakes(scenario), timeout_seconds=0.3)

    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    started = time.monotonic()
    scan = await collector.collect_async()
    elapsed = time.monotonic() - started
    task.cancel()

    assert elapsed < 1.5
    assert scan.status == "incomplete"
    assert scan.reason == "NVML did not answer within 0.3s"
    assert ticks >= 5  # the event loop kept running while NVML hung


async def test_collect_async_returns_the_scan() -> None:
    scan = await NvidiaNvmlCollector(nvml=FakeNvml(a100_sxm4_mig())).collect_async()
    assert scan.status == "complete"
    assert only_gpu(scan).mig_mode == Known("enabled")


# -- the real pynvml module -------------------------------------------------------------------


def test_real_nvml_on_this_machine_is_complete_or_cleanly_unavailable() -> None:
    """No GPU: unavailable with a reason. A GPU (the device check): complete, every metric typed."""
    scan = NvidiaNvmlCollector(timeout_seconds=10.0).collect()
    if scan.status == "unavailable":
        assert scan.reason
        assert scan.accelerators == []
        assert not isinstance(scan.driver_version, Known)
        return
    assert scan.status == "complete", scan.reason
    assert isinstance(scan.driver_version, Known)
    assert isinstance(scan.cuda_driver_version, Known)
    assert scan.accelerators
    for gpu in scan.accelerators:
        assert gpu.uuid.startswith(("GPU-", "MIG-"))
        assert tuple(gpu.telemetry) == ACCELERATOR_METRICS
        assert isinstance(gpu.name, Known)
        assert isinstance(gpu.pci_bus_id, Known) and isinstance(gpu.pci_bus_id.value, str)
        assert isinstance(gpu.memory_total_bytes, Known)
        assert isinstance(gpu.compute_capability, Known)
