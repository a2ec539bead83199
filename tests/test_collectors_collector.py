"""The one collector interface: `collectors.collector.observe`, and that both the server's local
refresh and the agent observe a host through it."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from collectors.collector import observe
from collectors.nvml import NvidiaNvmlCollector
from collectors.observations import HostCollectionError, HostObservation, NvmlScan
from tests.builders import T0, host
from tests.fakes.fake_pynvml import FakeNvml
from tests.fixtures_nvml import multi_gpu_scenario

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("api", "agent", "domain", "projections", "ledger", "runtime")


class Host:
    def __init__(self, error: Exception | None = None, delay: float = 0.0) -> None:
        self.error = error
        self.delay = delay

    async def collect_async(self) -> HostObservation:
        await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return host("observed-host")


class SlowNvml:
    """Finishes after `delay`, or raises `error`; says whether it ran to its end."""

    def __init__(self, delay: float = 0.0, error: Exception | None = None) -> None:
        self.delay = delay
        self.error = error
        self.finished = False

    async def collect_async(self) -> NvmlScan:
        await asyncio.sleep(self.delay)
        self.finished = True
        if self.error is not None:
            raise self.error
        return NvidiaNvmlCollector(nvml=FakeNvml(multi_gpu_scenario(1)), timeout_seconds=5).collect()


async def test_observe_runs_both_collectors_and_records_each_run() -> None:
    obs = await observe(Host(), NvidiaNvmlCollector(nvml=FakeNvml(multi_gpu_scenario(2))), T0)
    assert obs.observed_at == T0
    assert obs.host.hostname == "observed-host"
    assert obs.nvml.status == "complete" and len(obs.nvml.accelerators) == 2
    assert [(run.collector, run.ok, run.error) for run in obs.collectors] == [
        ("system", True, None),
        ("nvml", True, None),
    ]
    assert all(run.duration_seconds >= 0 for run in obs.collectors)


async def test_observe_runs_the_collectors_concurrently() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    await observe(Host(delay=0.3), SlowNvml(delay=0.3), T0)
    assert loop.time() - started < 0.55


async def test_a_host_that_cannot_be_observed_fails_the_observation_after_both_collectors_ended() -> None:
    nvml = SlowNvml(delay=0.05, error=RuntimeError("nvml bug"))
    with pytest.raises(HostCollectionError, match="no /proc"):
        await observe(Host(HostCollectionError("no /proc")), nvml, T0)
    assert nvml.finished  # not abandoned half-way; and the host's failure wins over the NVML one


async def test_an_exception_from_the_nvml_collector_is_raised_not_recorded_as_data() -> None:
    with pytest.raises(RuntimeError, match="nvml bug"):
        await observe(Host(), SlowNvml(error=RuntimeError("nvml bug")), T0)


def _python_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_the_collector_protocol_is_declared_once_and_only_observe_calls_collectors() -> None:
    """No second copy of the interface outside collectors/, and no caller that runs the collectors
    itself instead of through `observe`."""
    offenders: list[str] = []
    for package in PRODUCT:
        for path in _python_files(package):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "collect_async":
                    offenders.append(f"{where}: defines collect_async")
                if isinstance(node, ast.Attribute) and node.attr == "collect_async":
                    offenders.append(f"{where}: calls collect_async instead of collectors.collector.observe")
    assert offenders == []


@pytest.mark.parametrize("module", ["api/services/inventory.py", "agent/runner.py"])
def test_the_local_refresh_and_the_agent_both_observe_through_collectors_collector(module: str) -> None:
    tree = ast.parse((ROOT / module).read_text(encoding="utf-8"))
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "collectors.collector"
        for alias in node.names
    }
    assert "observe" in imported
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "observe"
    ]
    assert calls, f"{module} imports observe but never calls it"
