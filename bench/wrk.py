"""`wrk` as a load generator for read routes: one thread, keep-alive connections, closed loop,
paths round robin from a Lua script; its summary read back as JSON."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

WRK_MISSING = "wrk is not installed: apt-get update && apt-get install -y wrk (Debian package `wrk`)"

_WRK_SCRIPT = r"""
local paths = {}
for line in io.lines(os.getenv("BENCH_PATHS")) do paths[#paths + 1] = line end
local token = os.getenv("BENCH_TOKEN")
local headers = {}
if token and #token > 0 then headers["Authorization"] = "Bearer " .. token end
local i = 0
request = function()
  i = i + 1
  return wrk.format("GET", paths[(i - 1) % #paths + 1], headers)
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "errors": %d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.status + e.timeout))
end
"""


def require_wrk() -> str:
    found = shutil.which("wrk")
    if not found:
        raise SystemExit(WRK_MISSING)
    return found


@dataclass
class WrkRun:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int
    generator_cpu: float


async def run_wrk(
    base: str, paths: Sequence[str], seconds: float, connections: int, token: str, work: Path
) -> WrkRun:
    """wrk, one thread, `connections` keep-alive connections, closed loop, over `paths` round robin
    (non-2xx answers count as errors)."""
    wrk = require_wrk()
    paths_file = work / f"paths-{secrets.token_hex(4)}.txt"
    paths_file.write_text("\n".join(paths) + "\n")
    script = work / "bench.lua"
    script.write_text(_WRK_SCRIPT)
    before = os.times()
    proc = await asyncio.create_subprocess_exec(
        wrk, "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "10s",
        "-s", str(script), base + paths[0],
        env={**os.environ, "BENCH_PATHS": str(paths_file), "BENCH_TOKEN": token},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    after = os.times()
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed: {err.decode()[-1000:]}")
    d = json.loads([ln for ln in out.decode().splitlines() if ln.startswith("{")][-1])
    return WrkRun(
        d["requests"],
        d["duration_us"] / 1e6,
        d["p50_us"] / 1e3,
        d["p99_us"] / 1e3,
        d["errors"],
        (after.children_user + after.children_system) - (before.children_user + before.children_system),
    )
