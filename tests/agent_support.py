"""Helpers for the agent-plane tests: real server processes on 127.0.0.1, agent processes (with the
fake NVML, tests/agent_wrapper.py), reports built like the agent builds them, and log checks."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from agent.protocol import PROTOCOL_VERSION, Report, encode_report
from collectors.observations import HardwareObservation
from domain.node import node_id_for
from tests.builders import gpu, host, scan

OPERATOR_TOKEN = "test-operator-token-7f3a9c"
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
ROOT = Path(__file__).resolve().parent.parent
# Anything shaped like one of our secrets: an enrollment token or a node credential.
SECRET_SHAPE = re.compile(r"mf[ce]_[0-9a-f]{32}_[A-Za-z0-9_-]{20,}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MODELFORGE_", "MF_TEST_"))}
    env.update(PYTHONUNBUFFERED="1", MODELFORGE_LOG_JSON="1", PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> int:
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


class ServerProcess:
    """`modelforge-hw serve` on a free port of 127.0.0.1, against a given database."""

    def __init__(
        self,
        dsn: str,
        workdir: Path,
        *,
        stale_after: float = 60,
        offline_after: float = 300,
        port: int = 0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.dsn = dsn
        self.env = env or {}
        self.workdir = workdir
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"server-{self.port}.log"
        self.stale_after = stale_after
        self.offline_after = offline_after
        self.proc: subprocess.Popen[bytes] | None = None
        self.extra_env = env or {}  # more MODELFORGE_* settings
        workdir.mkdir(parents=True, exist_ok=True)

    def start(self) -> ServerProcess:
        env = clean_env(
            MODELFORGE_DATABASE_URL=self.dsn,
            MODELFORGE_ADMIN_TOKEN=OPERATOR_TOKEN,
            MODELFORGE_STATE_DIR=str(self.workdir / "server-state"),
            **self.extra_env,
        )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "api.cli",
                "serve",
                "--port",
                str(self.port),
                "--no-startup-refresh",
                "--stale-after",
                str(self.stale_after),
                "--offline-after",
                str(self.offline_after),
            ],
            env=env,
            cwd=ROOT,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    async def wait_healthy(self, within: float = 30.0) -> None:
        deadline = time.monotonic() + within
        async with httpx.AsyncClient() as client:
            while time.monotonic() < deadline:
                assert self.proc is not None and self.proc.poll() is None, (
                    f"server exited early:\n{self.log.read_text()}"
                )
                try:
                    r = await client.get(self.url + "/api/v1/health", timeout=2)
                    if r.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError(f"server did not answer within {within}s:\n{self.log.read_text()}")

    def stop(self) -> int:
        assert self.proc is not None
        return stop_process(self.proc)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class AgentProcess:
    """An agent with its own state directory and identity, run through tests/agent_wrapper.py."""

    def __init__(
        self,
        workdir: Path,
        node_id: str,
        *,
        gpus: int = 2,
        clock_offset: float = 0.0,
        state_dir: Path | None = None,
    ) -> None:
        self.node_id = node_id
        self.state_dir = state_dir or workdir / f"agent-{node_id}"
        self.log = workdir / f"agent-{node_id}.log"
        self.gpus = gpus
        self.clock_offset = clock_offset
        self.proc: subprocess.Popen[bytes] | None = None
        self.expected_node_id = node_id_for(node_id)

    def env(self) -> dict[str, str]:
        return clean_env(
            MODELFORGE_STATE_DIR=str(self.state_dir),
            MODELFORGE_NODE_ID=self.node_id,
            MF_TEST_GPUS=str(self.gpus),
            MF_TEST_CLOCK_OFFSET=str(self.clock_offset),
        )

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "tests.agent_wrapper", "agent", *args]

    async def enroll(self, server: str, token: str, *extra: str) -> subprocess.CompletedProcess[str]:
        done = await asyncio.to_thread(
            subprocess.run,
            self.command("enroll", "--server", server, "--token", token, *extra),
            env=self.env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        with self.log.open("a") as f:
            f.write(done.stdout + done.stderr)
        return done

    def start(self, *servers: str, interval: float = 0.3, extra: tuple[str, ...] = ()) -> AgentProcess:
        args = ["run", "--interval", str(interval), "--backoff-initial", "0.1", "--backoff-max", "0.5"]
        for s in servers:
            args += ["--server", s]
        self.proc = subprocess.Popen(
            self.command(*args, *extra),
            env=self.env(),
            cwd=ROOT,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int:
        assert self.proc is not None
        return stop_process(self.proc)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def credential(self) -> dict[str, Any]:
        import json

        return json.loads((self.state_dir / "agent-credential.json").read_text())  # type: ignore[no-any-return]

    def spooled(self) -> int:
        spool = self.state_dir / "agent-spool"
        return len([p for p in spool.glob("*.json")]) if spool.exists() else 0


# --- the operator API and hand-made reports ----------------------------------------------------------


async def create_token(
    client: httpx.AsyncClient, url: str, *, uses: int = 1, ttl: float = 600
) -> dict[str, Any]:
    r = await client.post(
        url + "/api/v1/enrollment-tokens", json={"ttl_seconds": ttl, "uses": uses}, headers=OPERATOR
    )
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


async def enroll_direct(
    client: httpx.AsyncClient, url: str, token: str, identity_key: str, hostname: str = "gpu-host-1"
) -> httpx.Response:
    return await client.post(
        url + "/api/v1/agent/enroll",
        json={"identity_key": identity_key, "identity_source": "configured", "hostname": hostname},
        headers={"Authorization": f"Bearer {token}"},
    )


def observation(*, mem_avail: int = 100, gpus: int = 2, hostname: str = "gpu-host-1") -> HardwareObservation:
    from tests.builders import T0

    return HardwareObservation(
        observed_at=T0, host=host(hostname, mem_avail=mem_avail), nvml=scan([gpu(i) for i in range(gpus)])
    )


def report_body(
    identity_key: str,
    sequence: int,
    *,
    stream: str = "telemetry",
    obs: HardwareObservation | None = None,
    mem_avail: int = 100,
) -> bytes:
    o = obs or observation(mem_avail=mem_avail)
    return encode_report(
        Report(
            protocol=PROTOCOL_VERSION,
            node_id=node_id_for(identity_key),
            identity_key=identity_key,
            identity_source="configured",
            stream=stream,
            sequence=sequence,
            observed_at=o.observed_at,
            observation=o,
        )
    )


async def post_report(client: httpx.AsyncClient, url: str, credential: str, body: bytes) -> httpx.Response:
    return await client.post(
        url + "/api/v1/agent/reports",
        content=body,
        headers={"Authorization": f"Bearer {credential}", "Content-Type": "application/json"},
    )


def assert_problem(r: httpx.Response, status: int, type_suffix: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers["content-type"]
    body: dict[str, Any] = r.json()
    assert body["status"] == status and body["title"] and body["detail"] and body["type"]
    if type_suffix is not None:
        assert body["type"].endswith("/" + type_suffix), body
    return body


def assert_no_secrets(texts: dict[str, str], secrets: list[str]) -> None:
    """No secret (and nothing shaped like one) in any captured log."""
    for name, text in texts.items():
        for secret in secrets:
            assert secret not in text, f"a secret appears in {name}"
            # the secret part alone (after the id) must not leak either
            tail = secret.split("_", 2)[2] if secret.startswith(("mfe_", "mfc_")) else None
            if tail and len(tail) >= 20:
                assert tail not in text, f"a secret appears in {name}"
        assert not SECRET_SHAPE.search(text), f"something shaped like a secret appears in {name}"


async def wait_for(predicate: Any, within: float, what: str, every: float = 0.1) -> Any:
    """Poll an async predicate until it returns something truthy."""
    deadline = time.monotonic() + within
    last: Any = None
    while time.monotonic() < deadline:
        last = await predicate()
        if last:
            return last
        await asyncio.sleep(every)
    raise AssertionError(f"timed out after {within}s waiting for {what} (last: {last!r})")
