"""The README's run command on a fresh machine: `modelforge-hw serve` with no database URL starts
an embedded PostgreSQL in the state directory, answers /health within 30 s, and keeps its data
across a restart."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(state: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    env.update(MODELFORGE_STATE_DIR=str(state), MODELFORGE_NODE_ID="serve-test-node", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "api.cli", "serve", "--port", str(port), "--no-startup-refresh"],
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, within: float = 30.0) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited early:\n{log.read_text()}"
        try:
            r = httpx.get(url + "/api/v1/health", timeout=2)
            if r.status_code == 200:
                return r.json()  # type: ignore[no-any-return]
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"/health did not answer 200 within {within}s:\n{log.read_text()}")


def stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def test_serve_on_embedded_postgres_survives_restart(tmp_path: Path) -> None:
    state = tmp_path / "state"
    log = tmp_path / "server.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(state, port, log)
    try:
        started = time.monotonic()
        health = wait_healthy(url, proc, log)
        assert time.monotonic() - started < 30
        assert health["inventory"]["status"] == "pending"
        token = (state / "admin-token").read_text().strip()
        assert oct((state / "admin-token").stat().st_mode & 0o777) == "0o600"
        auth = {"Authorization": f"Bearer {token}"}
        r = httpx.post(url + "/api/v1/hardware/refresh", headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        nodes = httpx.get(url + "/api/v1/hardware/nodes", headers=auth).json()["items"]
        assert len(nodes) == 1
        # Behind the TLS proxy of docs/operations/SERVER_AGENT_DEPLOYMENT.md (on this host, so
        # trusted), the console's cookie is sent over HTTPS only; on plain loopback it cannot be.
        for forwarded, secure in (({"X-Forwarded-Proto": "https"}, True), ({}, False)):
            r = httpx.post(url + "/console/login", data={"token": token}, headers=forwarded)
            assert r.status_code == 303, r.text
            assert ("secure" in r.headers["set-cookie"].lower().split("; ")) is secure, r.headers
    finally:
        assert stop(proc) == 0, log.read_text()
    assert (state / "postgres" / "PG_VERSION").exists()
    assert not (state / "postgres" / "postmaster.pid").exists(), "the embedded PostgreSQL was left running"

    proc = start(state, port, log)
    try:
        health = wait_healthy(url, proc, log)
        assert health["inventory"]["nodes"] == 1
        again = httpx.get(url + "/api/v1/hardware/nodes", headers=auth).json()["items"]
        assert [n["id"] for n in again] == [n["id"] for n in nodes]
        assert again[0]["fingerprint"] == nodes[0]["fingerprint"]
    finally:
        assert stop(proc) == 0, log.read_text()
    assert not (state / "postgres" / "postmaster.pid").exists()
