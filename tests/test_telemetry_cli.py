"""`gpu telemetry` and `node telemetry` run as real commands against a real server process over
a seeded history: the table (range and sparkline per metric, `-` for a gap, the states that are
not values), the JSON document, a viewer token, and a refused window."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from api.services.scopes import OperatorTokens
from collectors.observations import HardwareObservation
from domain.node import node_id_for
from tests.agent_support import (
    OPERATOR,
    OPERATOR_TOKEN,
    ROOT,
    ServerProcess,
    clean_env,
    create_token,
    enroll_direct,
    post_report,
    report_body,
    stop_process,
)
from tests.builders import T0, gpu, host, scan
from tests.telemetry_support import WINDOW, seed

GPU_UUID = gpu(0).uuid
RANGE = ["--since", WINDOW["since"], "--until", WINDOW["until"]]


def hw(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *args],
        capture_output=True,
        text=True,
        env={**env, "COLUMNS": "200"},
        cwd=ROOT,
        timeout=120,
    )


async def hw_async(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(hw, *args, env=env)


@pytest.fixture
async def server(database_dsn: str, pool: asyncpg.Pool, tmp_path: Path) -> AsyncIterator[ServerProcess]:
    process = ServerProcess(database_dsn, tmp_path).start()
    try:
        await process.wait_healthy()
        async with httpx.AsyncClient() as http:
            token = (await create_token(http, process.url))["token"]
            r = await enroll_direct(http, process.url, token, "key-alpha", "gpu-alpha")
            assert r.status_code in (200, 201), r.text
            obs = HardwareObservation(observed_at=T0, host=host("gpu-alpha"), nvml=scan([gpu(0), gpu(1)]))
            body = report_body("key-alpha", 1, stream="inventory", obs=obs)
            r = await post_report(http, process.url, r.json()["credential"], body)
            assert r.status_code in (200, 202), r.text
            listed = await http.get(process.url + "/api/v1/hardware/accelerators", headers=OPERATOR)
            acc = next(a for a in listed.json()["items"] if a["uuid"] == GPU_UUID)
        await seed(pool, node_id_for("key-alpha"), acc["id"], GPU_UUID)
        yield process
    finally:
        assert process.proc is not None
        stop_process(process.proc, timeout=60)


def _row(stdout: str, label: str) -> list[str]:
    """The table's row of the metric labelled so, its cells (columns are two spaces apart at least)."""
    return next(
        re.split(r"\s{2,}", line.strip()) for line in stdout.splitlines() if line.startswith(label + "  ")
    )


async def test_gpu_and_node_telemetry_tables_and_json(server: ServerProcess) -> None:
    env = clean_env(MODELFORGE_SERVER=server.url, MODELFORGE_TOKEN=OPERATOR_TOKEN)
    shown = await hw_async("gpu", "telemetry", GPU_UUID.lower(), *RANGE, "--step", "300", env=env)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith(f"accelerator {GPU_UUID}: 2026-11-30 10:00:00Z .. 2026-11-30 11:00:00Z")
    assert "300 s per bucket, 51 samples" in lines[0]
    assert lines[1].split() == ["METRIC", "MIN", "MEAN", "MAX", "HISTORY", "OTHER", "STATES"]
    # Each metric by its label, each value with its unit, as the console shows them.
    # 40..59 and 70..99 a minute, and 45 delivered late: a mean of 70; the gap is `--`.
    metric, low, mean, high, spark = _row(shown.stdout, "Temperature")
    assert (metric, low, mean, high) == ("Temperature", "40 °C", "70 °C", "99 °C")
    assert len(spark) == 12 and spark[4:6] == "--" and spark[0] == "▁" and spark[-1] == "█", spark
    # unsupported where there were samples, a gap where there were none, as on the other rows
    fan = _row(shown.stdout, "Fan speed")
    assert fan[:4] + fan[5:] == ["Fan speed", "-", "-", "-", "unsupported ×51"]
    assert fan[4] == "····--······", fan[4]
    assert _row(shown.stdout, "Power draw")[1:4] == ["100.5 W", "100.5 W", "100.5 W"]
    assert _row(shown.stdout, "SM clock") == ["SM clock", "-", "-", "-", "-" * 12]
    assert "temperature_celsius" not in shown.stdout

    as_json = await hw_async("gpu", "telemetry", GPU_UUID, *RANGE, "-o", "json", env=env)
    assert as_json.returncode == 0, as_json.stderr
    body = json.loads(as_json.stdout)
    # without --step the command asks for 40 buckets
    assert (body["uuid"], body["samples"], body["step_seconds"]) == (GPU_UUID, 51, 90)
    assert len(body["series"][0]["points"]) == 40

    node = await hw_async("node", "telemetry", "gpu-alpha", *RANGE, "--step", "600", env=env)
    assert node.returncode == 0, node.stderr
    assert node.stdout.startswith(f"node {node_id_for('key-alpha')}: ")
    # the seeded host counts 1000..1059 bytes: in binary units as free(1) prints them
    assert _row(node.stdout, "Memory available")[:4] == ["Memory available", "1000 B", "1.0 KiB", "1.0 KiB"]
    assert _row(node.stdout, "Memory total")[1:5] == ["4.0 KiB", "4.0 KiB", "4.0 KiB", "▁▁-▁▁▁"]


async def test_a_viewer_reads_it_and_a_window_too_fine_is_refused(
    server: ServerProcess, pool: asyncpg.Pool
) -> None:
    viewer = (await OperatorTokens(pool).create(ttl_seconds=3600)).token
    env = clean_env(MODELFORGE_SERVER=server.url, MODELFORGE_TOKEN=viewer)
    shown = await hw_async("node", "telemetry", "gpu-alpha", *RANGE, "-o", "json", env=env)
    assert shown.returncode == 0 and json.loads(shown.stdout)["samples"] == 51, shown.stderr
    refused = await hw_async("gpu", "telemetry", GPU_UUID, "--since", "2d", "--step", "1", env=env)
    assert refused.returncode == 2 and "at most 2000" in refused.stderr, refused.stderr
    backwards = await hw_async("gpu", "telemetry", GPU_UUID, "--since", "1h", "--until", "2h", env=env)
    assert backwards.returncode != 0 and "must be before" in backwards.stderr
    unknown = await hw_async("gpu", "telemetry", "GPU-ffff", env=env)
    assert unknown.returncode == 5, unknown.stderr


def test_sparkline_and_states_of_a_series() -> None:
    from datetime import timedelta

    from api.cli.telemetry import seen, sparkline
    from collectors.facts import UNKNOWN, Known
    from domain.telemetry_buckets import downsample
    from domain.telemetry_history import Bucket, Sample, window
    from tests.telemetry_support import BASE

    def points(*means: float | None, count: int = 1) -> list[Bucket]:
        return [Bucket(BASE, count if m is not None else 0, {}, m, m, m) for m in means]

    assert sparkline(points(1.0, None, 8.0, 4.5)) == "▁-█▅"
    assert sparkline(points(3.0, 3.0)) == "▁▁" and sparkline(points(None, None)) == "--"
    # samples without a number (unsupported, a performance state) are not a gap
    unsupported = Bucket(BASE, 3, {"unsupported": 3}, None, None, None)
    assert sparkline([*points(2.0, None), unsupported]) == "▁-·"
    w = window(BASE, BASE + timedelta(minutes=2), 60)
    samples = [
        Sample(BASE, {"performance_state": Known("P0")}),
        Sample(BASE + timedelta(seconds=70), {"performance_state": UNKNOWN}),
    ]
    (pstate,) = downsample(w, samples, ["performance_state"])
    assert seen(pstate) == "known ×1, not numbers, unknown ×1"
