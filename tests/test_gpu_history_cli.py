"""`gpu history` and `gpu lemons` run as real commands against a real server process: the GPU with
XID 79 on node A moved to node B, named by a UUID prefix that both its rows share, shows both nodes
and its events on each, and ranks first; JSON documents; a viewer token; an unknown GPU (exit 5)
and a window that is not one (exit 2)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from api.services.scopes import OperatorTokens
from ledger.store import EventStore
from tests.agent_support import OPERATOR_TOKEN, ServerProcess, clean_env, stop_process
from tests.lemons_support import MOVED, NODE_A, NODE_B, STEADY, seed_moved_gpu
from tests.test_telemetry_cli import hw_async


@pytest.fixture
async def server(database_dsn: str, store: EventStore, tmp_path: Path) -> AsyncIterator[ServerProcess]:
    await seed_moved_gpu(store)
    process = ServerProcess(database_dsn, tmp_path).start()
    try:
        await process.wait_healthy()
        yield process
    finally:
        assert process.proc is not None
        stop_process(process.proc, timeout=60)


def _lines_with(stdout: str, word: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if word in line.split()]


async def test_history_and_lemons_tables_json_a_viewer_and_refusals(
    server: ServerProcess, pool: asyncpg.Pool
) -> None:
    env = clean_env(MODELFORGE_SERVER=server.url, MODELFORGE_TOKEN=OPERATOR_TOKEN)
    # A prefix without `GPU-` matches the GPU's row on A and its row on B: one GPU, not two.
    prefix = MOVED.lower().removeprefix("gpu-")
    shown = await hw_async("gpu", "history", prefix, env=env)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == f"GPU {MOVED} (NVIDIA H200): 2 nodes"
    (on_a,) = _lines_with(shown.stdout, NODE_A)
    (on_b,) = _lines_with(shown.stdout, NODE_B)
    assert on_a[1:5] == ["lemon-a", on_a[2], "missing", "failed"] and on_a[-1] == "1.0"
    assert on_b[1] == "lemon-b" and on_b[3:5] == ["active", "healthy"]
    kinds = [row[4] for row in (line.split() for line in lines) if len(row) > 4 and row[4].startswith("ACC")]
    assert kinds == [
        "ACCELERATOR_DISCOVERED",
        "ACCELERATOR_XID_OBSERVED",
        "ACCELERATOR_HEALTH_CHANGED",
        "ACCELERATOR_MISSING",
        "ACCELERATOR_DISCOVERED",
    ]
    assert any("XID 79" in line and "lemon-a" in line for line in lines)
    assert any("healthy -> failed (service) xid_79" in line for line in lines)

    as_json = await hw_async("gpu", "history", MOVED, "-o", "json", env=env)
    assert as_json.returncode == 0, as_json.stderr
    body = json.loads(as_json.stdout)
    assert [n["node_id"] for n in body["nodes"]] == [NODE_A, NODE_B]
    assert len(body["items"]) == 5 and body["has_more"] is False

    lemons = await hw_async("gpu", "lemons", env=env)
    assert lemons.returncode == 0, lemons.stderr
    out = lemons.stdout.splitlines()
    assert out[0].startswith("2 GPUs failed since ") and "ACCELERATOR_HEALTH_CHANGED into failed" in out[0]
    assert out[1].split()[:4] == ["RANK", "UUID", "MODEL", "FAILURES"]
    first, second = out[2].split(), out[3].split()
    assert first[:2] == ["1", MOVED] and first[4] == "1"  # one failure
    assert "lemon-a,lemon-b" in out[2] and "xid_79" in out[2]
    assert second[:2] == ["2", STEADY]
    recent = await hw_async("gpu", "lemons", "--since", "6d", "-o", "json", env=env)
    assert recent.returncode == 0, recent.stderr
    assert [g["uuid"] for g in json.loads(recent.stdout)["items"]] == [STEADY]

    # One server for both halves: its start is most of the test's time.
    viewer = (await OperatorTokens(pool).create(ttl_seconds=3600)).token
    env = clean_env(MODELFORGE_SERVER=server.url, MODELFORGE_TOKEN=viewer)
    lemons = await hw_async("gpu", "lemons", "-o", "json", env=env)
    assert lemons.returncode == 0, lemons.stderr
    assert json.loads(lemons.stdout)["items"][0]["uuid"] == MOVED
    history = await hw_async("gpu", "history", MOVED, "-o", "json", env=env)
    assert history.returncode == 0 and len(json.loads(history.stdout)["items"]) == 5, history.stderr
    unknown = await hw_async("gpu", "history", "GPU-ffff", env=env)
    assert unknown.returncode == 5, unknown.stderr
    future = await hw_async("gpu", "lemons", "--since", "2999-01-01T00:00:00Z", env=env)
    assert future.returncode == 2 and "since" in future.stderr, future.stderr
    nonsense = await hw_async("gpu", "lemons", "--since", "lately", env=env)
    assert nonsense.returncode == 2 and "lately" in nonsense.stderr, nonsense.stderr
