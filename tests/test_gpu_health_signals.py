"""Each GPU health signal, collected through the fake NVML from the real captures' facts."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from collectors.facts import UNSUPPORTED, Known, TemporarilyFailed
from collectors.gpu_health import CLOCK_EVENT_REASONS, AcceleratorHealthSignals
from collectors.nvml import NvidiaNvmlCollector
from tests.fakes.fake_pynvml import (
    NVML_FEATURE_DISABLED,
    NVML_FEATURE_ENABLED,
    FakeNvml,
    nvmlClocksEventReasonGpuIdle,
    nvmlClocksEventReasonHwThermalSlowdown,
    nvmlClocksEventReasonSwPowerCap,
)
from tests.fixtures_nvml import (
    a100_sxm4_mig,
    multi_gpu_scenario,
    rtx_2080_windows,
    rtx_3060_laptop,
    rtx_4090_driver_535,
    tesla_p100,
)


@pytest.fixture
def collectors() -> Iterator[list[NvidiaNvmlCollector]]:
    made: list[NvidiaNvmlCollector] = []
    yield made
    for c in made:
        c.close()


def collector_for(fake: FakeNvml, made: list[NvidiaNvmlCollector]) -> NvidiaNvmlCollector:
    c = NvidiaNvmlCollector(nvml=fake)
    made.append(c)
    return c


def signals(fake: FakeNvml, made: list[NvidiaNvmlCollector]) -> list[AcceleratorHealthSignals]:
    scan = collector_for(fake, made).collect()
    assert scan.status == "complete"
    out = [g.health for g in scan.accelerators]
    assert all(h is not None for h in out)
    return [h for h in out if h is not None]


def test_consumer_gpu_without_ecc_reports_unsupported_never_zero(
    collectors: list[NvidiaNvmlCollector],
) -> None:
    (h,) = signals(FakeNvml(rtx_3060_laptop()), collectors)
    assert h.ecc_mode == UNSUPPORTED
    assert h.ecc_errors == dict.fromkeys(h.ecc_errors, UNSUPPORTED) and len(h.ecc_errors) == 4
    assert set(h.remapped_rows.values()) == {UNSUPPORTED}
    assert set(h.retired_pages.values()) == {UNSUPPORTED}
    assert h.pcie_replay_count == Known(0)
    assert h.clock_event_reasons["gpu_idle"] == Known(True)
    assert h.clock_event_reasons["hw_thermal_slowdown"] == Known(False)
    assert set(h.clock_event_reasons) == set(CLOCK_EVENT_REASONS)
    assert h.xid_events == Known(True)


def test_ada_with_ecc_disabled_has_row_remapping_but_no_counts(collectors: list[NvidiaNvmlCollector]) -> None:
    (h,) = signals(FakeNvml(rtx_4090_driver_535()), collectors)
    assert h.ecc_mode == Known("disabled")
    assert set(h.ecc_errors.values()) == {UNSUPPORTED}
    assert h.remapped_rows == {
        "correctable": Known(0),
        "uncorrectable": Known(0),
        "pending": Known(False),
        "failure": Known(False),
    }
    assert set(h.retired_pages.values()) == {UNSUPPORTED}


def test_pascal_has_ecc_counts_and_page_retirement_not_remapping(
    collectors: list[NvidiaNvmlCollector],
) -> None:
    (h,) = signals(FakeNvml(tesla_p100()), collectors)
    assert h.ecc_mode == Known("enabled")
    assert h.ecc_errors == {
        "corrected_volatile": Known(0),
        "uncorrected_volatile": Known(0),
        "corrected_aggregate": Known(3),
        "uncorrected_aggregate": Known(0),
    }
    assert h.retired_pages == {"single_bit": Known(0), "double_bit": Known(0), "pending": Known(False)}
    assert set(h.remapped_rows.values()) == {UNSUPPORTED}


def test_a100_in_mig_mode_has_aggregate_but_no_volatile_counts(collectors: list[NvidiaNvmlCollector]) -> None:
    (h,) = signals(FakeNvml(a100_sxm4_mig()), collectors)
    assert h.ecc_errors["corrected_volatile"] == UNSUPPORTED
    assert h.ecc_errors["uncorrected_aggregate"] == Known(0)
    assert not any(f == Known(True) for f in h.clock_event_reasons.values())


def test_counts_and_reasons_follow_the_gpu(collectors: list[NvidiaNvmlCollector]) -> None:
    scenario = multi_gpu_scenario(1)
    g = scenario.gpus[0]
    g.clock_event_reasons = nvmlClocksEventReasonHwThermalSlowdown | nvmlClocksEventReasonSwPowerCap
    g.ecc_errors["uncorrected_volatile"] = 2
    g.remapped_rows = (5, 1, 1, 0)
    g.pcie_replay_count = 17
    (h,) = signals(FakeNvml(scenario), collectors)
    assert [n for n, f in h.clock_event_reasons.items() if f == Known(True)] == [
        "sw_power_cap",
        "hw_thermal_slowdown",
    ]
    assert h.ecc_errors["uncorrected_volatile"] == Known(2)
    assert h.remapped_rows == {
        "correctable": Known(5),
        "uncorrectable": Known(1),
        "pending": Known(True),
        "failure": Known(False),
    }
    assert h.pcie_replay_count == Known(17)


def test_a_failing_health_call_is_a_typed_fact_and_hides_nothing(
    collectors: list[NvidiaNvmlCollector],
) -> None:
    scenario = multi_gpu_scenario(1)
    scenario.gpus[0].errors["remapped_rows"] = "Unknown"
    scenario.gpus[0].errors["pcie_replay"] = "NoPermission"
    scan = collector_for(FakeNvml(scenario), collectors).collect()
    h = scan.accelerators[0].health
    assert h is not None
    assert all(isinstance(f, TemporarilyFailed) for f in h.remapped_rows.values())
    assert h.pcie_replay_count.__class__.__name__ == "Unavailable"
    assert h.ecc_mode == Known("enabled")


def test_xids_are_drained_once_with_code_and_time(collectors: list[NvidiaNvmlCollector]) -> None:
    scenario = multi_gpu_scenario(2)
    fake = FakeNvml(scenario)
    collector = collector_for(fake, collectors)
    first = collector.collect()
    assert [g.health.xids for g in first.accelerators if g.health] == [[], []]
    before = datetime.now(UTC)
    fake.xid(scenario.gpus[1].uuid, 79)
    fake.xid(scenario.gpus[1].uuid, 48)
    second = collector.collect()
    h0, h1 = (g.health for g in second.accelerators)
    assert h0 is not None and h1 is not None
    assert h0.xids == []
    assert [x.code for x in h1.xids] == [79, 48]
    assert all(x.at >= before for x in h1.xids)
    # Drained: the next collection has nothing new, and waiting never blocked (timeout 0).
    third = collector.collect()
    assert [g.health.xids for g in third.accelerators if g.health] == [[], []]
    assert fake.calls["event_set_create"] == 1  # one set, kept across collections


def test_xids_are_unsupported_where_nvml_has_no_event_api(collectors: list[NvidiaNvmlCollector]) -> None:
    (h,) = signals(FakeNvml(rtx_2080_windows()), collectors)
    assert h.xid_events == UNSUPPORTED
    assert h.xids == []


def test_fake_event_api_behaves_like_nvml() -> None:
    fake = FakeNvml(multi_gpu_scenario(1))
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    event_set = fake.nvmlEventSetCreate()
    fake.nvmlDeviceRegisterEvents(handle, fake.nvmlEventTypeXidCriticalError, event_set)
    with pytest.raises(fake.NVMLError_Timeout):
        fake.nvmlEventSetWait_v2(event_set, 0)
    fake.xid(fake.scenario.gpus[0].uuid, 31)
    data = fake.nvmlEventSetWait_v2(event_set, 0)
    assert (data.eventType, data.eventData) == (fake.nvmlEventTypeXidCriticalError, 31)
    assert fake.nvmlDeviceGetUUID(data.device) == fake.scenario.gpus[0].uuid
    fake.nvmlShutdown()
    fake.nvmlInit()
    # The set died with its session.
    with pytest.raises(fake.NVMLError_InvalidArgument):
        fake.nvmlEventSetWait_v2(event_set, 0)
    fake.nvmlShutdown()


def test_fake_ecc_follows_the_mode() -> None:
    scenario = tesla_p100()
    scenario.gpus[0].ecc_mode = NVML_FEATURE_DISABLED
    fake = FakeNvml(scenario)
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetEccMode(handle) == [NVML_FEATURE_DISABLED, NVML_FEATURE_DISABLED]
    with pytest.raises(fake.NVMLError_NotSupported):
        fake.nvmlDeviceGetTotalEccErrors(handle, 0, 1)
    scenario.gpus[0].ecc_mode = NVML_FEATURE_ENABLED
    assert fake.nvmlDeviceGetTotalEccErrors(handle, 0, 1) == 3
    assert fake.nvmlDeviceGetCurrentClocksEventReasons(handle) == nvmlClocksEventReasonGpuIdle
    fake.nvmlShutdown()


def test_an_xid_of_a_gpu_that_fell_off_the_bus_is_kept(collectors: list[NvidiaNvmlCollector]) -> None:
    scenario = multi_gpu_scenario(2)
    fake = FakeNvml(scenario)
    collector = collector_for(fake, collectors)
    assert collector.collect().status == "complete"
    lost = scenario.gpus[1]
    fake.xid(lost.uuid, 79)
    lost.lost = True  # its handle and UUID calls now fail, as after XID 79
    scan = collector.collect()
    assert scan.status == "incomplete"
    assert [g.uuid for g in scan.accelerators] == [scenario.gpus[0].uuid]
    assert [x.code for x in scan.unlisted_xids[lost.uuid]] == [79]
