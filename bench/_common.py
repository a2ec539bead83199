"""Shared pieces of the benchmarks: throwaway databases, realistic node observations, verdicts.

Nothing here is product code; it only builds inputs the way a real host would produce them
(the collectors' typed observations, reconciled by the product's own `reconcile`).
"""

from __future__ import annotations

import os
import platform
import random
import secrets
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from collectors.facts import UNSUPPORTED, Fact, Known
from collectors.observations import (
    AcceleratorObservation,
    CpuInfo,
    HardwareObservation,
    HostObservation,
    NvmlScan,
    OsInfo,
    StorageObservation,
)

DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/test"
GIB = 1024**3
MIB = 1024**2


def server_dsn() -> str:
    return os.environ.get("MODELFORGE_BENCH_DATABASE_URL") or DEFAULT_SERVER


def dsn_for_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


def bench_database_name(suffix: str = "") -> str:
    return f"mf_bench_{secrets.token_hex(4)}{'_' + suffix if suffix else ''}"


async def create_database(server: str, name: str) -> str:
    admin = await asyncpg.connect(server)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return dsn_for_database(server, name)


async def drop_database(server: str, name: str) -> None:
    admin = await asyncpg.connect(server)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def server_description(server: str) -> str:
    conn = await asyncpg.connect(server)
    try:
        version = await conn.fetchval("SHOW server_version")
        sync = await conn.fetchval("SHOW synchronous_commit")
        shared = await conn.fetchval("SHOW shared_buffers")
    finally:
        await conn.close()
    return f"PostgreSQL {version} (synchronous_commit={sync}, shared_buffers={shared})"


def machine_description() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_of(pids: Sequence[int]) -> float | None:
    """utime + stime of the processes, in seconds; None when /proc does not have them (a remote
    server, or not readable)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _CLK_TCK
        except (OSError, IndexError, ValueError):
            return None
    return total


def verdict(ratio: float, target: float, *, at_least: bool = True) -> str:
    ok = ratio >= target if at_least else ratio < target
    return "MET" if ok else "NOT MET"


# --- realistic nodes ------------------------------------------------------------------------------


class GpuModel:
    def __init__(
        self,
        name: str,
        memory_mib: int,
        cc: str,
        *,
        mig: str,
        fan: bool,
        tdp_w: float,
        bus_ids: tuple[str, ...],
        driver: str,
        cuda: str,
    ) -> None:
        self.name = name
        self.memory_total = memory_mib * MIB
        self.cc = cc
        self.mig = mig
        self.fan = fan
        self.tdp_w = tdp_w
        self.bus_ids = bus_ids
        self.driver = driver
        self.cuda = cuda


_HGX = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")
_PCIE = ("01", "21", "41", "61", "81", "A1", "C1", "E1")

# The eight-GPU node types of a typical fleet (facts as NVML reports them).
GPU_MODELS: tuple[GpuModel, ...] = (
    GpuModel("NVIDIA H200", 143771, "9.0", mig="disabled", fan=False, tdp_w=700, bus_ids=_HGX,
             driver="570.133.20", cuda="12.8"),
    GpuModel("NVIDIA H100 80GB HBM3", 81559, "9.0", mig="disabled", fan=False, tdp_w=700, bus_ids=_HGX,
             driver="550.127.08", cuda="12.4"),
    GpuModel("NVIDIA A100-SXM4-80GB", 81920, "8.0", mig="enabled", fan=False, tdp_w=400, bus_ids=_HGX,
             driver="535.216.03", cuda="12.2"),
    GpuModel("NVIDIA L40S", 46068, "8.9", mig="disabled", fan=True, tdp_w=350, bus_ids=_PCIE,
             driver="550.127.08", cuda="12.4"),
)  # fmt: skip

_GPU_NAMESPACE = uuid.UUID("9c1f0a52-3b9e-4d7a-a8a4-0f5b2c7d9e31")
T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def node_key(i: int) -> str:
    return f"bench-node-{i:06d}"


def model_of(i: int) -> GpuModel:
    return GPU_MODELS[i % len(GPU_MODELS)]


def gpu_uuid(node: int, index: int) -> str:
    return f"GPU-{uuid.uuid5(_GPU_NAMESPACE, f'{node}/{index}')}"


def accelerator_telemetry(model: GpuModel, rng: random.Random) -> dict[str, Fact]:
    util = rng.randint(0, 100)
    used = rng.randint(1, model.memory_total // MIB) * MIB
    mig = model.mig == "enabled"
    return {
        "memory_used_bytes": Known(used),
        "memory_total_bytes": Known(model.memory_total),
        # NVML answers NotSupported for utilization while MIG is enabled.
        "utilization_gpu_percent": UNSUPPORTED if mig else Known(util),
        "utilization_memory_percent": UNSUPPORTED if mig else Known(rng.randint(0, 100)),
        "temperature_celsius": Known(rng.randint(28, 84)),
        "power_watts": Known(round(60 + model.tdp_w * util / 100 * rng.uniform(0.7, 1.0), 3)),
        "clock_graphics_mhz": Known(rng.choice((210, 1410, 1755, 1980))),
        "clock_sm_mhz": Known(rng.choice((210, 1410, 1755, 1980))),
        "clock_memory_mhz": Known(rng.choice((1215, 2619, 3201))),
        "fan_speed_percent": Known(rng.randint(0, 100)) if model.fan else UNSUPPORTED,
        "performance_state": Known(0 if util else 8),
    }


def node_observation(i: int, rng: random.Random, *, gpus: int = 8) -> HardwareObservation:
    """One refresh of node `i`: an eight-GPU server of one of the fleet's types."""
    model = model_of(i)
    ubuntu = ("22.04", "5.15.0-126-generic") if i % 3 else ("24.04", "6.8.0-49-generic")
    mem_total = (1024 + 1024 * (i % 2)) * GIB
    host = HostObservation(
        hostname=f"gpu-r{i // 32:03d}-u{i % 32:02d}.dc1.example.net",
        os=OsInfo(
            name=Known("Ubuntu"), version=Known(ubuntu[0]), kernel=Known(ubuntu[1]),
            architecture=Known("x86_64"),
        ),
        cpu=CpuInfo(
            model=Known("AMD EPYC 9454 48-Core Processor" if i % 2 else "Intel(R) Xeon(R) Platinum 8480+"),
            sockets=Known(2), physical_cores=Known(96 if i % 2 else 112),
            logical_cores=Known(192 if i % 2 else 224),
        ),
        memory_total_bytes=Known(mem_total),
        telemetry={
            "memory_available_bytes": Known(rng.randint(mem_total // 8, mem_total)),
            "memory_total_bytes": Known(mem_total),
        },
        storage=[
            StorageObservation(mount="/", used_bytes=Known(rng.randint(50, 400) * GIB),
                               total_bytes=Known(894 * GIB)),
            StorageObservation(mount="/var/lib/modelforge", used_bytes=Known(rng.randint(1, 30_000) * GIB),
                               total_bytes=Known(30_720 * GIB)),
        ],
    )  # fmt: skip
    accelerators = [
        AcceleratorObservation(
            uuid=gpu_uuid(i, g),
            index=Known(g),
            name=Known(model.name),
            pci_bus_id=Known(f"00000000:{model.bus_ids[g % 8]}:00.0"),
            memory_total_bytes=Known(model.memory_total),
            compute_capability=Known(model.cc),
            mig_mode=Known(model.mig),
            telemetry=accelerator_telemetry(model, rng),
        )
        for g in range(gpus)
    ]
    return HardwareObservation(
        observed_at=T0,
        host=host,
        nvml=NvmlScan(
            status="complete",
            reason=None,
            driver_version=Known(model.driver),
            cuda_driver_version=Known(model.cuda),
            accelerators=accelerators,
        ),
    )


def summarize_pyspy(raw: str, *, top: int = 18) -> str:
    """Inclusive and leaf shares of a `py-spy record -f raw` file (collapsed stacks)."""
    import collections

    inclusive: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    total = 0
    with open(raw, encoding="utf-8", errors="replace") as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack or not n.isdigit():
                continue
            count = int(n)
            total += count
            frames = stack.split(";")
            for frame in set(frames):
                inclusive[frame] += count
            leaf[frames[-1]] += count
    if not total:
        return "  (no samples)"
    out = [f"  {total} samples; inclusive share of the busiest frames:"]
    skip = (
        "<module>",
        "_run_module",
        "_run_code",
        "run (asyncio",
        "run_until_complete",
        "run_forever",
        "_run_once",
        "_run (asyncio/events",
        "serve (uvicorn",
        "main (",
        "Server.serve",
        "Runner.run",
    )
    shown = 0
    for frame, count in inclusive.most_common():
        if any(s in frame for s in skip):
            continue
        out.append(f"    {100 * count / total:5.1f}%  {frame}")
        shown += 1
        if shown >= top:
            break
    out.append("  leaf (self) share:")
    for frame, count in leaf.most_common(top // 2):
        out.append(f"    {100 * count / total:5.1f}%  {frame}")
    return "\n".join(out)
