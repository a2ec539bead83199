"""deploy/validate-gpu.sh runs end to end (server start, two refreshes, identity comparison,
nvidia-smi comparison). Here there is no GPU: a stub nvidia-smi lists none and real NVML is
unavailable, so both sides agree on zero GPUs; a stub that lists one GPU must make it fail."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_script(tmp_path: Path, smi_output: str) -> subprocess.CompletedProcess[str]:
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    (stub / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '%s' '{smi_output}'\n")
    (stub / "nvidia-smi").chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    env.update(PATH=f"{stub}:{env['PATH']}", PYTHON=sys.executable, PORT=str(port))
    return subprocess.run(
        ["bash", str(ROOT / "deploy" / "validate-gpu.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_validate_gpu_script_passes_when_api_and_nvidia_smi_agree(tmp_path: Path) -> None:
    result = run_script(tmp_path, "")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "VALIDATION PASSED" in result.stdout
    assert "refresh 2: HTTP 200" in result.stdout


def test_validate_gpu_script_fails_on_a_gpu_the_api_does_not_know(tmp_path: Path) -> None:
    line = "GPU-11111111-2222-3333-4444-555555555555, NVIDIA H200, 00000000:18:00.0, 143771, 570.133.20\\n"
    result = run_script(tmp_path, line)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "is not in /accelerators" in result.stdout
