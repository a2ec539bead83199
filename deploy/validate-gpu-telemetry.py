"""The telemetry path on a host with NVIDIA GPUs, end to end: the server (embedded PostgreSQL), one
enrolled agent reporting every second, a load on every GPU in the middle, and nvidia-smi sampled
beside the agent. Then, per GPU, the history API (`GET /accelerators/{id}/telemetry`) must agree
with nvidia-smi: the same metrics known and the same ones not supported, the medians of each phase
(idle, under load) within a tolerance, the load visible, and the seconds after the agent stopped
a gap (no samples, no values), never 0. Prints what it compared; exits 1 on a mismatch.

The load is a bf16 matrix product loop through PyTorch (or CuPy) when the interpreter named by
LOAD_PYTHON (default `python3`) has one; otherwise only the idle phase is compared, and it says so.
On a host whose GPUs run work, pass `--load 0`: the load would compete with that work, and the
"idle" phase then compares whatever runs.

Usage (from the repository root, after the README's run setup):
    .venv/bin/python deploy/validate-gpu-telemetry.py [--out DIR]
DIR receives the history answers, nvidia-smi's samples, the CLI's table, the console's GPU page and
the logs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent

# nvidia-smi --query-gpu field -> the history's metric, and how far apart the two medians of a
# phase may be: (absolute, relative to nvidia-smi's median). NVML and nvidia-smi read the same
# counters, but not at the same instants: a phase's median absorbs the few samples at its edges.
SMI_FIELDS: dict[str, tuple[str, float, float]] = {
    "utilization.gpu": ("utilization_gpu_percent", 15.0, 0.0),
    "memory.used": ("memory_used_bytes", 256.0, 0.05),  # MiB
    "temperature.gpu": ("temperature_celsius", 4.0, 0.0),
    "power.draw": ("power_watts", 15.0, 0.15),
    "clocks.sm": ("clock_sm_mhz", 60.0, 0.10),
    "clocks.mem": ("clock_memory_mhz", 60.0, 0.05),
    "fan.speed": ("fan_speed_percent", 10.0, 0.0),
}
MIB = 1024 * 1024

LOAD = """
import sys, time
seconds = float(sys.argv[1])
try:
    import torch
    n = torch.cuda.device_count()
    if n == 0:
        raise ImportError("torch sees no GPU")
    mats = [(torch.randn(8192, 8192, device=f"cuda:{i}", dtype=torch.bfloat16),) * 2 for i in range(n)]
    def step():
        for a, b in mats:
            a @ b
    def sync():
        for i in range(n):
            torch.cuda.synchronize(i)
    what = f"torch {torch.__version__}, {n} GPU(s)"
except ImportError:
    import cupy
    n = cupy.cuda.runtime.getDeviceCount()
    mats = []
    for i in range(n):
        with cupy.cuda.Device(i):
            m = cupy.random.random((8192, 8192), dtype=cupy.float32)
            mats.append((i, m))
    def step():
        for i, m in mats:
            with cupy.cuda.Device(i):
                m @ m
    def sync():
        for i, _ in mats:
            cupy.cuda.Device(i).synchronize()
    what = f"cupy {cupy.__version__}, {n} GPU(s)"
step()
sync()
print("load:", what, flush=True)
print(f"load: from {time.time():.3f}", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    for _ in range(20):
        step()
    sync()
print("load: done", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


class Sampler(threading.Thread):
    """nvidia-smi once a second, each line stamped with this host's clock when its answer came."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.stop = threading.Event()
        self.rows: list[tuple[float, dict[str, str]]] = []
        self.fields = ["uuid", "pstate", *SMI_FIELDS]

    def run(self) -> None:
        query = ",".join(self.fields)
        while not self.stop.is_set():
            before = time.time()
            out = subprocess.run(
                ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
            at = (before + time.time()) / 2
            for row in csv.reader(out.splitlines()):
                if row:
                    self.rows.append((at, dict(zip(self.fields, (c.strip() for c in row), strict=False))))
            self.stop.wait(max(0.0, 1.0 - (time.time() - before)))
        with self.path.open("w") as f:
            w = csv.writer(f)
            w.writerow(["epoch", *self.fields])
            for at, row in self.rows:
                w.writerow([f"{at:.3f}", *(row.get(k, "") for k in self.fields)])


def run_load(seconds: float, env: dict[str, str]) -> tuple[float, float] | None:
    """The load on every GPU (LOAD_PYTHON's torch or cupy, in its own site: `env` has no
    PYTHONPATH); the phase to compare, or None where it could not run."""
    load = subprocess.run(
        [os.environ.get("LOAD_PYTHON", "python3"), "-c", LOAD, str(seconds)],
        env=env,
        capture_output=True,
        text=True,
        timeout=seconds + 120,
    )
    ended = time.time()
    print(load.stdout.strip() or "load: none")
    if load.returncode != 0 or "load: done" not in load.stdout:
        print("== NO GPU LOAD: neither torch nor cupy ran; only the idle phase is compared")
        print("   " + "\n   ".join(load.stderr.strip().splitlines()[-3:]))
        return None
    # From its first products on (past the framework's start); the first seconds spin up the
    # clocks, the last may miss the agent's sample.
    computing = float(load.stdout.split("load: from ", 1)[1].split()[0])
    if ended - 1.0 - (computing + 2.0) < 3.0:
        print(f"== the load ran {ended - computing:.1f} s, too briefly to compare (--load 8 or more)")
        return None
    return computing + 2.0, ended - 1.0


def number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


class Check:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def expect(self, ok: bool, what: str) -> None:
        print(f"     {'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            self.failures.append(what)


def compare_gpu(
    check: Check,
    uuid: str,
    history: dict[str, Any],
    smi: list[tuple[float, dict[str, str]]],
    phases: dict[str, tuple[float, float]],
    started: float,
    stopped: float,
    interval: float,
) -> None:
    series = {s["metric"]: s["points"] for s in history["series"]}
    step = history["step_seconds"]
    print(f"== GPU {uuid}: {history['samples']} samples, step {step} s")
    first = min(
        (datetime.fromisoformat(p["start"]).timestamp() for p in series["memory_total_bytes"] if p["count"]),
        default=stopped,
    )
    # The agent's interpreter starts first; from its first report on it reports every interval.
    check.expect(first - started <= 15, f"the agent's first sample {first - started:.1f} s after its start")
    expected = (stopped - first) / interval
    check.expect(
        history["samples"] >= 0.7 * expected,
        f"samples {history['samples']} >= 70 % of the {expected:.0f} reports the agent had time for",
    )
    rows = [(at, row) for at, row in smi if row["uuid"] == uuid]
    check.expect(bool(rows), f"nvidia-smi sampled this GPU {len(rows)} times")
    for field, (metric, absolute, relative) in SMI_FIELDS.items():
        points = series[metric]
        sampled = [p for p in points if p["count"]]
        known = [p for p in sampled if p["states"].get("known")]
        smi_values = [number(row[field]) for _, row in rows]
        smi_known = [v for v in smi_values if v is not None]
        if not smi_known:
            states = sorted({s for p in sampled for s in p["states"]})
            check.expect(
                not known,
                f"{metric}: nvidia-smi has no value ({rows[0][1][field] if rows else '-'}), "
                f"the history none known (states {states})",
            )
            continue
        check.expect(
            len(known) == len(sampled) and bool(known),
            f"{metric}: known in {len(known)} of {len(sampled)} sampled buckets",
        )
        scale = MIB if metric == "memory_used_bytes" else 1
        for phase, (start, end) in phases.items():
            ours = [
                p["mean"] / scale
                for p in known
                if start <= datetime.fromisoformat(p["start"]).timestamp()
                and datetime.fromisoformat(p["start"]).timestamp() + step <= end
            ]
            theirs = [
                v for v in (number(row[field]) for at, row in rows if start <= at <= end) if v is not None
            ]
            if not ours or not theirs:
                check.expect(
                    False, f"{metric} {phase}: history {len(ours)} buckets, nvidia-smi {len(theirs)}"
                )
                continue
            a, b = statistics.median(ours), statistics.median(theirs)
            allowed = absolute + relative * abs(b)
            check.expect(
                abs(a - b) <= allowed,
                f"{metric:24} {phase:5} median history {a:10.1f}  nvidia-smi {b:10.1f}"
                f"  (|d| <= {allowed:.1f})",
            )
    if "load" in phases:
        start, end = phases["load"]
        peak = max(
            (
                p["max"]
                for p in series["utilization_gpu_percent"]
                if p["max"] is not None and start <= datetime.fromisoformat(p["start"]).timestamp() <= end
            ),
            default=0,
        )
        check.expect(peak >= 50, f"the load shows in the history: utilization peak {peak:.0f} %")
    after = [
        p
        for p in series["utilization_gpu_percent"]
        if datetime.fromisoformat(p["start"]).timestamp() >= stopped + interval + 0.5
    ]
    check.expect(
        bool(after) and all(p["count"] == 0 and p["max"] is None and p["mean"] is None for p in after),
        f"after the agent stopped: {len(after)} buckets, all gaps (no samples, no values)",
    )
    pstates = sorted({s for p in series["performance_state"] for s in p["states"]})
    print(f"     performance_state states: {pstates}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where to keep the answers, samples and logs")
    parser.add_argument("--idle", type=float, default=float(os.environ.get("IDLE_SECONDS", 8)))
    parser.add_argument("--load", type=float, default=float(os.environ.get("LOAD_SECONDS", 16)))
    parser.add_argument("--tail", type=float, default=float(os.environ.get("TAIL_SECONDS", 6)))
    parser.add_argument("--interval", type=float, default=1.0, help="the agent's seconds between reports")
    args = parser.parse_args()
    if shutil.which("nvidia-smi") is None:
        print("nvidia-smi not found: is this a GPU host?", file=sys.stderr)
        return 2

    state = Path(tempfile.mkdtemp(prefix="mf-gpu-telemetry."))
    out = args.out or state
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    cli = [sys.executable, "-m", "api.cli"]
    server_env = {**env, "MODELFORGE_STATE_DIR": str(state / "server")}
    agent_env = {**env, "MODELFORGE_STATE_DIR": str(state / "agent")}
    processes: list[subprocess.Popen[bytes]] = []
    check = Check()
    try:
        server = subprocess.Popen(
            [*cli, "serve", "--port", str(port), "--no-startup-refresh"],
            env=server_env,
            cwd=ROOT,
            stdout=(out / "server.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        processes.append(server)
        for _ in range(300):
            try:
                if httpx.get(f"{base}/api/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                print((out / "server.log").read_text(), file=sys.stderr)
                return 1
            time.sleep(0.2)
        token_file = state / "enrollment-token"
        token_file.write_text(
            subprocess.run(
                [*cli, "token", "create", "--ttl", "10m"],
                env=server_env,
                cwd=ROOT,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        subprocess.run(
            [*cli, "agent", "enroll", "--server", base, "--token-file", str(token_file)],
            env=agent_env,
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        admin = (state / "server" / "admin-token").read_text().strip()
        auth = {"Authorization": f"Bearer {admin}"}

        sampler = Sampler(out / "nvidia-smi-samples.csv")
        sampler.start()
        agent_started = time.time()
        agent = subprocess.Popen(
            [*cli, "agent", "run", "--server", base, "--interval", str(args.interval)],
            env=agent_env,
            cwd=ROOT,
            stdout=(out / "agent.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        processes.append(agent)
        # The agent's CPU is counted from its first reports on, past its interpreter's start.
        time.sleep(min(3.0, args.idle))
        cpu_from, counted_from = sum(psutil.Process(agent.pid).cpu_times()[:2]), time.time()
        time.sleep(max(0.0, args.idle - 3.0))
        phases = {"idle": (agent_started + 1.5, time.time() - 0.5)}
        if args.load > 0:
            load_phase = run_load(args.load, {k: v for k, v in env.items() if k != "PYTHONPATH"})
            if load_phase is not None:
                phases["load"] = load_phase
        else:
            print("== NO GPU LOAD (--load 0): only the idle phase is compared")
        time.sleep(args.tail)
        agent_cpu = sum(psutil.Process(agent.pid).cpu_times()[:2]) - cpu_from
        counted_until = time.time()
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
        stopped = time.time()
        time.sleep(4 * args.interval + 1)
        sampler.stop.set()
        sampler.join(timeout=60)

        accs = httpx.get(f"{base}/api/v1/hardware/accelerators?limit=1000", headers=auth, timeout=30).json()
        accs = accs["items"]
        print(f"== {len(accs)} GPU(s) reported by the agent; nvidia-smi sampled {len(sampler.rows)} rows")
        smi_uuids = {row["uuid"] for _, row in sampler.rows}
        check.expect(
            {a["uuid"] for a in accs} == smi_uuids and bool(accs),
            f"the agent's GPUs are nvidia-smi's ({len(smi_uuids)})",
        )
        since = utc(agent_started - 2).isoformat()
        until = utc(time.time()).isoformat()
        reports = 0  # the reports the agent's CPU was counted over: samples of the first GPU in that span
        for acc in accs:
            answer = httpx.get(
                f"{base}/api/v1/hardware/accelerators/{acc['id']}/telemetry",
                params={"since": since, "until": until, "step": "1"},
                headers=auth,
                timeout=60,
            )
            check.expect(answer.status_code == 200, f"history of {acc['uuid']}: HTTP {answer.status_code}")
            history = answer.json()
            (out / f"history-{acc['index']}.json").write_text(json.dumps(history, indent=1))
            if not reports:
                utilization = next(s for s in history["series"] if s["metric"] == "utilization_gpu_percent")
                reports = sum(
                    p["count"]
                    for p in utilization["points"]
                    if counted_from <= datetime.fromisoformat(p["start"]).timestamp() < counted_until
                )
            compare_gpu(
                check, acc["uuid"], history, sampler.rows, phases, agent_started, stopped, args.interval
            )
        if reports:
            print(
                f"== agent: {reports} reports in {counted_until - counted_from:.1f} s, "
                f"{agent_cpu:.2f} s of CPU, "
                f"{1000 * agent_cpu / reports:.1f} ms per report (collection, encoding, sending)"
            )
        if accs:
            table = subprocess.run(
                [
                    *cli,
                    "gpu",
                    "telemetry",
                    accs[0]["uuid"],
                    "--server",
                    base,
                    "--since",
                    utc(agent_started - 2).isoformat(),
                    "--until",
                    until,
                ],
                env={**env, "MODELFORGE_TOKEN": admin},
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            print(f"== modelforge-hw gpu telemetry {accs[0]['uuid']} (exit {table.returncode})")
            print(table.stdout + table.stderr)
            (out / "gpu-telemetry.txt").write_text(table.stdout + table.stderr)
            page = httpx.get(
                f"{base}/console/gpus/{accs[0]['id']}",
                params={"window": "1h"},
                cookies={"mf_console_token": admin},
                timeout=60,
            )
            check.expect(
                page.status_code == 200 and "<svg" in page.text,
                f"console GPU page: HTTP {page.status_code}, with charts",
            )
            (out / "console-gpu.html").write_text(page.text)
            scrape = httpx.get(f"{base}/metrics", headers=auth, timeout=60)
            check.expect(
                scrape.status_code == 200 and "modelforge_gpu_power_watts{" in scrape.text,
                f"/metrics: HTTP {scrape.status_code}, with the GPUs' gauges",
            )
            (out / "metrics.txt").write_text(scrape.text)
            # What the health verdict made of the run, the load included (a GPU at its power cap
            # is throttled by software, which is no fault): told, not judged here.
            changes = httpx.get(
                f"{base}/api/v1/hardware/events",
                params={"type": "ACCELERATOR_HEALTH_CHANGED"},
                headers=auth,
                timeout=60,
            ).json()["items"]
            for acc in accs:
                health = acc["health"]
                print(
                    f"== GPU {acc['index']} health: {health['status']} (action {health['action']}, "
                    f"reasons {health['reasons']}); health changes during the run: "
                    f"{sum(1 for e in changes if acc['uuid'] in json.dumps(e))}"
                )
    finally:
        for p in reversed(processes):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()

    if check.failures:
        print("== TELEMETRY VALIDATION FAILED")
        for f in check.failures:
            print("   - " + f)
        return 1
    print(f"== TELEMETRY VALIDATION PASSED: {len(accs)} GPU(s), the history follows nvidia-smi")
    return 0


if __name__ == "__main__":
    sys.exit(main())
