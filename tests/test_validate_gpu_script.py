"""deploy/validate-gpu.sh runs end to end (server start, two refreshes, identity comparison,
nvidia-smi comparison, health signals against `nvidia-smi -q -x`). Here there is no GPU: a stub
nvidia-smi lists none and real NVML is unavailable, so both sides agree on zero GPUs; a stub that
lists one GPU must make it fail."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.fixtures_nvml import MIB, h200_gpu

ROOT = Path(__file__).resolve().parent.parent


NO_GPU_XML = (
    '<?xml version="1.0" ?><nvidia_smi_log><driver_version>570.133.20</driver_version></nvidia_smi_log>'
)


def run_script(
    tmp_path: Path, smi_output: str, smi_xml: str = NO_GPU_XML, *, fake_gpus: int = 0
) -> subprocess.CompletedProcess[str]:
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    (tmp_path / "q.xml").write_text(smi_xml)
    # `nvidia-smi -q -x` answers the XML, `--query-gpu` the CSV line.
    (stub / "nvidia-smi").write_text(
        f"#!/bin/sh\nif [ \"$1\" = -q ]; then cat '{tmp_path / 'q.xml'}'; exit 0; fi\nprintf '%s' '{smi_output}'\n"
    )
    (stub / "nvidia-smi").chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    env.update(PATH=f"{stub}:{env['PATH']}", PYTHON=sys.executable, PORT=str(port))
    if fake_gpus:
        # The product's `import pynvml` gets the fake NVML (H200-like GPUs), as in test_deployment_doc.
        env.update(PYTHONPATH=f"{ROOT / 'tests' / 'fake_nvml_site'}:{ROOT}", MF_TEST_GPUS=str(fake_gpus))
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
    assert "HEALTH VALIDATION PASSED: 0 GPU(s)" in result.stdout


def test_validate_gpu_script_fails_on_a_gpu_the_api_does_not_know(tmp_path: Path) -> None:
    line = "GPU-11111111-2222-3333-4444-555555555555, NVIDIA H200, 00000000:18:00.0, 143771, 570.133.20\\n"
    result = run_script(tmp_path, line)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "is not in /accelerators" in result.stdout


def test_validate_gpu_script_fails_on_health_signals_nvml_cannot_show(tmp_path: Path) -> None:
    # The identity check agrees (no GPU listed by --query-gpu), but `nvidia-smi -q` shows one GPU
    # with ECC counters: NVML (unavailable here) has no signals for it, and the script must say so.
    xml = (
        '<?xml version="1.0" ?><nvidia_smi_log><gpu id="00000000:18:00.0">'
        "<uuid>GPU-11111111-2222-3333-4444-555555555555</uuid>"
        "<ecc_mode><current_ecc>Enabled</current_ecc></ecc_mode>"
        "</gpu></nvidia_smi_log>"
    )
    result = run_script(tmp_path, "", xml)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "VALIDATION PASSED" in result.stdout  # the inventory part
    assert "HEALTH VALIDATION FAILED" in result.stdout
    assert "has no NVML health signals" in result.stdout


def h200_xml(pending: str = "No") -> str:
    gpu = h200_gpu(0)
    zero = "<sram_correctable>0</sram_correctable><sram_uncorrectable>0</sram_uncorrectable>"
    zero += "<dram_correctable>0</dram_correctable><dram_uncorrectable>0</dram_uncorrectable>"
    return (
        f'<?xml version="1.0" ?><nvidia_smi_log><gpu id="{gpu.pci_bus_id}"><uuid>{gpu.uuid}</uuid>'
        "<pci><replay_counter>0</replay_counter></pci>"
        "<clocks_event_reasons><clocks_event_reason_hw_slowdown>Not Active</clocks_event_reason_hw_slowdown>"
        "<clocks_event_reason_hw_thermal_slowdown>Not Active</clocks_event_reason_hw_thermal_slowdown>"
        "</clocks_event_reasons>"
        "<ecc_mode><current_ecc>Enabled</current_ecc><pending_ecc>Enabled</pending_ecc></ecc_mode>"
        f"<ecc_errors><volatile>{zero}</volatile><aggregate>{zero}</aggregate></ecc_errors>"
        "<retired_pages><multiple_single_bit_retirement><retired_count>N/A</retired_count>"
        "</multiple_single_bit_retirement><double_bit_retirement><retired_count>N/A</retired_count>"
        "</double_bit_retirement><pending_retirement>N/A</pending_retirement></retired_pages>"
        "<remapped_rows><remapped_row_corr>0</remapped_row_corr><remapped_row_unc>0</remapped_row_unc>"
        f"<remapped_row_pending>{pending}</remapped_row_pending>"
        "<remapped_row_failure>No</remapped_row_failure></remapped_rows>"
        "</gpu></nvidia_smi_log>"
    )


def h200_csv() -> str:
    gpu = h200_gpu(0)
    return f"{gpu.uuid}, {gpu.name}, {gpu.pci_bus_id}, {gpu.memory_total_bytes // MIB}, 570.133.20\n"


def test_validate_gpu_script_compares_health_signals_of_a_gpu(tmp_path: Path) -> None:
    result = run_script(tmp_path, h200_csv(), h200_xml(), fake_gpus=1)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "HEALTH VALIDATION PASSED: 1 GPU(s)" in result.stdout
    assert "remapped rows pending" in result.stdout


def test_validate_gpu_script_fails_when_a_health_signal_differs(tmp_path: Path) -> None:
    result = run_script(tmp_path, h200_csv(), h200_xml(pending="Yes"), fake_gpus=1)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "remapped rows pending: NVML False != nvidia-smi 'Yes'" in result.stdout
