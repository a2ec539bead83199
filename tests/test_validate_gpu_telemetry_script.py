"""deploy/validate-gpu-telemetry.py runs end to end here, where there is no GPU: the fake NVML (one
H200-like GPU) stands behind the agent, a stub nvidia-smi answers the same values, and no GPU load
can run. The history must then agree with nvidia-smi, and must not when the stub disagrees."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.fixtures_nvml import MIB, h200_gpu

ROOT = Path(__file__).resolve().parent.parent


def run_script(tmp_path: Path, utilization: int, load: int) -> subprocess.CompletedProcess[str]:
    gpu = h200_gpu(0)
    # uuid, pstate, utilization.gpu, memory.used, temperature.gpu, power.draw, clocks.sm, clocks.mem,
    # fan.speed: as nvidia-smi prints them with `--format=csv,noheader,nounits`.
    line = (
        f"{gpu.uuid}, P0, {utilization}, {gpu.memory_used_bytes // MIB}, {gpu.temperature_celsius}, "
        f"{gpu.power_milliwatts / 1000:.2f}, {gpu.clock_sm_mhz}, {gpu.clock_memory_mhz}, [N/A]"
    )
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "nvidia-smi").write_text(f"#!/bin/sh\necho '{line}'\n")
    (stub / "nvidia-smi").chmod(0o755)
    # No torch or cupy behind LOAD_PYTHON: the load cannot run, as on a host without them.
    (stub / "no-load-python").write_text("#!/bin/sh\necho 'ModuleNotFoundError: torch' >&2\nexit 1\n")
    (stub / "no-load-python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    env.update(
        PATH=f"{stub}:{env['PATH']}",
        PYTHONPATH=f"{ROOT / 'tests' / 'fake_nvml_site'}:{ROOT}",
        MF_TEST_GPUS="1",
        LOAD_PYTHON=str(stub / "no-load-python"),
    )
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "deploy" / "validate-gpu-telemetry.py"),
            "--out",
            str(tmp_path / "out"),
            "--idle",
            "6",
            "--load",
            str(load),
            "--tail",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_history_that_follows_nvidia_smi_passes(tmp_path: Path) -> None:
    gpu = h200_gpu(0)
    result = run_script(tmp_path, gpu.utilization_gpu_percent, load=3)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TELEMETRY VALIDATION PASSED: 1 GPU(s)" in result.stdout
    assert "NO GPU LOAD: neither torch nor cupy ran" in result.stdout
    # what the operator reads: the unsupported fan and the gap after the agent stopped
    assert "fan_speed_percent: nvidia-smi has no value ([N/A]), the history none known" in result.stdout
    assert "all gaps (no samples, no values)" in result.stdout
    assert "ms per report" in result.stdout
    out = tmp_path / "out"
    assert "<svg" in (out / "console-gpu.html").read_text()
    assert "utilization" in (out / "gpu-telemetry.txt").read_text().lower()


def test_history_that_differs_from_nvidia_smi_fails(tmp_path: Path) -> None:
    gpu = h200_gpu(0)
    result = run_script(tmp_path, gpu.utilization_gpu_percent + 60, load=0)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "NO GPU LOAD (--load 0)" in result.stdout
    assert "TELEMETRY VALIDATION FAILED" in result.stdout
    assert (
        "- utilization_gpu_percent  idle  median history        0.0  nvidia-smi       60.0" in result.stdout
    )
