"""docs/operations/SERVER_AGENT_DEPLOYMENT.md, followed word for word on this machine: the commands
of its quick-start block, run as written (server on its embedded PostgreSQL, one agent), give a
node with its GPUs in GET /api/v1/hardware/accelerators. NVML is the fake with eight GPUs, put in
place at the pynvml boundary by PYTHONPATH; nothing else differs from the document."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests import debian

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "operations" / "SERVER_AGENT_DEPLOYMENT.md"


def quickstart() -> str:
    text = DOC.read_text()
    block = text.split("<!-- quickstart:begin -->", 1)[1].split("<!-- quickstart:end -->", 1)[0]
    return block.split("```sh", 1)[1].rsplit("```", 1)[0]


def test_quickstart_gives_a_node_with_its_gpus(tmp_path: Path) -> None:
    debian.require("curl", "curl")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tmp_path / "checkout"
    workdir.mkdir()
    # the document runs from a checkout with `.venv`: give it this interpreter's environment
    (workdir / ".venv").symlink_to(Path(sys.executable).parent.parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    env.update(
        HOME=str(tmp_path / "home"),
        PORT=str(port),
        PYTHONPATH=f"{ROOT / 'tests' / 'fake_nvml_site'}:{ROOT}",
        MF_TEST_GPUS="8",
    )
    (tmp_path / "home").mkdir()
    script = "set -euo pipefail\ntrap 'kill $SERVER_PID 2>/dev/null; wait' EXIT\n" + quickstart()
    result = subprocess.run(
        ["bash", "-c", script], cwd=workdir, env=env, capture_output=True, text=True, timeout=120
    )
    log = tmp_path / "home" / ".local" / "state" / "modelforge" / "server.log"
    assert result.returncode == 0, result.stdout + result.stderr + (log.read_text() if log.exists() else "")
    page = json.loads(result.stdout.strip().splitlines()[-1])
    accs = page["items"]
    assert len(accs) == 8 and all(a["status"] == "active" for a in accs)
    assert {a["name"] for a in accs} == {"NVIDIA H200"}
    assert len({a["node_id"] for a in accs}) == 1
    # the server stopped with the script, and with it its embedded PostgreSQL
    pid_file = tmp_path / "home" / ".local" / "state" / "modelforge" / "postgres" / "postmaster.pid"
    for _ in range(50):
        if not pid_file.exists():
            break
        import time

        time.sleep(0.2)
    if pid_file.exists():  # never leave a server behind, even when the assertion below fails
        pid = int(pid_file.read_text().split()[0])
        os.kill(pid, signal.SIGTERM)
    assert not pid_file.exists()
