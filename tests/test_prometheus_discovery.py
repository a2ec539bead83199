"""The real Prometheus (Debian's `prometheus` package, installed with apt-get when missing; the test
FAILS when it cannot be) discovers the fleet from a running `modelforge-hw serve`: the shipped
deploy/prometheus/prometheus.yml, pointed at the test's server and given a real viewer token, lists
every node that is not decommissioned in its `/api/v1/targets`, with the `__meta_modelforge_*`
labels discovered and the relabelled `node_id` and `health` kept."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import yaml

from api.services.scopes import OperatorTokens
from tests.agent_support import OPERATOR, ServerProcess, free_port, stop_process
from tests.console_support import OFFLINE, ONLINE, STALE, node_id, seed_fleet
from tests.test_monitoring_deploy import PROMETHEUS, discovery_job, prometheus_tool

JOB = "modelforge-dcgm"
SHIPPED_SERVER = "modelforge-server:8080"


async def decommission(server: ServerProcess, node: str) -> None:
    async with httpx.AsyncClient(base_url=server.url, headers=OPERATOR, timeout=30) as client:
        p = (await client.post(f"/api/v1/hardware/nodes/{node}/decommission/preview")).json()
        r = await client.post(
            f"/api/v1/hardware/nodes/{node}/decommission",
            json={"generation": p["generation"], "digest": p["digest"], "reason": "retired"},
        )
        assert r.status_code == 200, r.text


def prometheus_config(workdir: Path, server_url: str, token: str) -> Path:
    """The shipped files, the servers' address replaced by the test server's, the token beside them."""
    target = workdir / "prometheus"
    shutil.copytree(PROMETHEUS, target)
    config = target / "prometheus.yml"
    text = config.read_text(encoding="utf-8")
    assert SHIPPED_SERVER in text
    config.write_text(text.replace(SHIPPED_SERVER, server_url.removeprefix("http://")), encoding="utf-8")
    (target / "modelforge-viewer-token").write_text(token + "\n", encoding="utf-8")
    return config


def start_prometheus(prometheus: str, config: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={config.parent / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        cwd=config.parent,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


async def discovered(url: str, proc: subprocess.Popen[bytes], log: Path, want: int) -> list[dict[str, Any]]:
    """The job's active targets once Prometheus lists `want` of them (within 60 s)."""
    deadline = time.monotonic() + 60
    targets: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"prometheus exited:\n{tail(log)}"
            try:
                r = await client.get(url + "/api/v1/targets", params={"state": "active"})
                if r.status_code == 200:
                    active = r.json()["data"]["activeTargets"]
                    targets = [t for t in active if t["scrapePool"] == JOB]
                    if len(targets) >= want:
                        return targets
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.25)
    raise AssertionError(f"{JOB} listed {targets} after 60 s:\n{tail(log)}")


async def test_prometheus_discovers_the_fleet_from_a_running_server(
    pool: asyncpg.Pool, database_dsn: str, tmp_path: Path
) -> None:
    prometheus = prometheus_tool("prometheus")
    await seed_fleet(pool)
    token = (await OperatorTokens(pool).create(ttl_seconds=3600, description="prometheus")).token
    server = ServerProcess(database_dsn, tmp_path / "server").start()
    proc: subprocess.Popen[bytes] | None = None
    try:
        await server.wait_healthy()
        await decommission(server, node_id(OFFLINE))
        config = prometheus_config(tmp_path, server.url, token)
        assert discovery_job(yaml.safe_load(config.read_text(encoding="utf-8")))["job_name"] == JOB
        port = free_port()
        log = tmp_path / "prometheus.log"
        proc = start_prometheus(prometheus, config, port, log)
        targets = await discovered(f"http://127.0.0.1:{port}", proc, log, want=2)
        sd_url = f"{server.url}/api/v1/sd/prometheus?port=9400"
    finally:
        if proc is not None:
            stop_process(proc)
        server.stop()

    by_host = {t["discoveredLabels"]["__meta_modelforge_hostname"]: t for t in targets}
    assert sorted(by_host) == [ONLINE, STALE], "every node but the decommissioned one, once each"
    online = by_host[ONLINE]
    assert online["discoveredLabels"] == {
        "__address__": f"{ONLINE}:9400",
        "__meta_modelforge_node_id": node_id(ONLINE),
        "__meta_modelforge_hostname": ONLINE,
        "__meta_modelforge_liveness": "online",
        "__meta_modelforge_inventory_status": "ok",
        "__meta_modelforge_health": "degraded",
        "__meta_modelforge_gpu_count": "3",
        "__meta_modelforge_gpu_models": "NVIDIA A100-SXM4-40GB,NVIDIA H200",
        "__meta_modelforge_driver_version": online["discoveredLabels"]["__meta_modelforge_driver_version"],
        "__meta_url": sd_url,
        "__metrics_path__": "/metrics",
        "__scheme__": "http",
        "__scrape_interval__": "30s",
        "__scrape_timeout__": "10s",
        "job": JOB,
    }
    assert online["discoveredLabels"]["__meta_modelforge_driver_version"]
    assert online["labels"] == {
        "instance": f"{ONLINE}:9400",
        "job": JOB,
        "node_id": node_id(ONLINE),
        "health": "degraded",
    }
    stale = by_host[STALE]
    assert stale["discoveredLabels"]["__meta_modelforge_liveness"] == "stale"
    assert stale["labels"]["health"] == "failed" and stale["scrapeUrl"] == f"http://{STALE}:9400/metrics"
    log_text = server.log_text()
    assert token not in log_text, "the viewer token is never logged"
