"""The fake NVML stays faithful to the real pynvml module where the collector can tell."""

from __future__ import annotations

import pytest

from tests.fakes import fake_pynvml
from tests.fakes.fake_pynvml import FakeNvml, NVMLError, NVMLError_NotSupported
from tests.fakes.nvml_devices import Scenario
from tests.fixtures_nvml import multi_gpu_scenario

pynvml = pytest.importorskip("pynvml")


def test_error_codes_and_constants_match_real_pynvml() -> None:
    names = [name for name in dir(fake_pynvml) if name.startswith("NVML_")]
    assert len(names) > 20
    for name in names:
        assert getattr(fake_pynvml, name) == getattr(pynvml, name), name
        assert getattr(FakeNvml, name) == getattr(pynvml, name), name
    assert fake_pynvml.nvmlMemory_v2 == FakeNvml.nvmlMemory_v2 == pynvml.nvmlMemory_v2


def test_error_classes_match_real_pynvml() -> None:
    for name in dir(fake_pynvml):
        if name.startswith("NVMLError_"):
            fake_class = getattr(fake_pynvml, name)
            real_class = getattr(pynvml, name)
            assert fake_class().value == real_class().value, name
            assert getattr(FakeNvml, name) is fake_class
            assert str(fake_class()) == str(real_class()), name


def test_nvml_error_of_a_code_is_its_subclass_like_real_pynvml() -> None:
    assert type(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)) is pynvml.NVMLError_NotSupported
    error = NVMLError(fake_pynvml.NVML_ERROR_NOT_SUPPORTED)
    assert type(error) is NVMLError_NotSupported
    assert isinstance(error, NVMLError)
    assert error.value == 3
    assert NVMLError(21).value == 21  # a code without a class of its own


def test_device_calls_before_init_raise_uninitialized() -> None:
    fake = FakeNvml(multi_gpu_scenario(1))
    with pytest.raises(fake_pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    with pytest.raises(fake_pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(fake_pynvml.NVMLError_Uninitialized):
        fake.nvmlShutdown()
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetUUID(handle) == scenario_uuid(fake)
    fake.nvmlShutdown()
    with pytest.raises(fake_pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetUUID(handle)


def scenario_uuid(fake: FakeNvml) -> str:
    return fake.scenario.gpus[0].uuid


def test_init_error_and_out_of_range_index() -> None:
    fake = FakeNvml(Scenario(driver_version="1", cuda_driver_version=1, init_error="DriverNotLoaded"))
    with pytest.raises(fake_pynvml.NVMLError_DriverNotLoaded):
        fake.nvmlInit()
    assert not fake.initialized
    fake.scenario.init_error = None
    fake.nvmlInit()
    with pytest.raises(fake_pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(0)


def test_lost_gpu_fails_handle_and_uuid() -> None:
    scenario = multi_gpu_scenario(1)
    fake = FakeNvml(scenario)
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    scenario.gpus[0].lost = True
    with pytest.raises(fake_pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetUUID(handle)
    with pytest.raises(fake_pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetHandleByIndex(0)
