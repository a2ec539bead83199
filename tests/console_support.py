"""A small fleet for the console tests, reconciled through the real service into a real database:
an online node whose GPUs read a measured 0 % fan, an unsupported fan, an unavailable power reading
and (after a second report) a missing GPU; a stale node; an offline node without GPUs."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import asyncpg
import msgspec

from api.services.inventory import HardwareInventoryService
from collectors.facts import UNSUPPORTED, Known, Unavailable
from collectors.identity import NodeIdentity
from collectors.observations import AcceleratorObservation, HardwareObservation
from ledger.events import EventMetadata
from ledger.node import node_id_for
from ledger.store import EventStore
from projections.inventory import ALL_PROJECTIONS
from tests.builders import gpu, host, scan

ZERO_FAN_GPU = "GPU-00000000-0000-4000-8000-000000000001"
NO_FAN_GPU = "GPU-00000000-0000-4000-8000-000000000002"
MISSING_GPU = "GPU-00000000-0000-4000-8000-000000000003"
ONLINE, STALE, OFFLINE = "gpu-a01", "gpu-b02", "cpu-c03"


def node_id(hostname: str) -> str:
    return node_id_for(f"console-test/{hostname}")


def _gpus(with_missing: bool) -> list[AcceleratorObservation]:
    zero = gpu(1, fan=Known(0))
    no_fan = gpu(2)
    no_fan = msgspec.structs.replace(
        no_fan, telemetry={**no_fan.telemetry, "power_watts": Unavailable("NVML: NoPermission")}
    )
    assert no_fan.telemetry["fan_speed_percent"] == UNSUPPORTED
    out = [zero, no_fan]
    if with_missing:
        out.append(msgspec.structs.replace(gpu(3), name=Known("NVIDIA A100-SXM4-40GB")))
    return out


async def report(
    service: HardwareInventoryService,
    hostname: str,
    gpus: list[AcceleratorObservation],
    *,
    ago: float = 0.0,
    kernel: str = "6.8.0-45-generic",
) -> None:
    at = datetime.now(UTC) - timedelta(seconds=ago)
    observation = HardwareObservation(observed_at=at, host=host(hostname, kernel=kernel), nvml=scan(gpus))
    outcome = await service.reconcile_observation(
        NodeIdentity(key=f"console-test/{hostname}", source="configured"),
        observation,
        EventMetadata(received_at=at, source="agent", observed_at=at),
    )
    assert outcome.outcome == "succeeded", outcome


async def caught_up(pool: asyncpg.Pool, within: float = 120.0) -> None:
    """Wait until the gap-safe read (what the timeline and events pages show) reaches the newest
    event: its horizon is the oldest transaction running anywhere on the PostgreSQL server, so a
    busy server (other tests' databases) holds just-written events back for a while."""
    deadline = asyncio.get_running_loop().time() + within
    async with pool.acquire() as conn:
        newest = await conn.fetchval("SELECT max(global_position) FROM events")
        while True:
            visible = await conn.fetchval(
                "SELECT max(global_position) FROM events WHERE tx_id < pg_snapshot_xmin(pg_current_snapshot())"
            )
            if newest is None or (visible is not None and visible >= newest):
                return
            assert asyncio.get_running_loop().time() < deadline, (
                f"events up to {newest} not visible in {within}s"
            )
            await asyncio.sleep(0.1)


async def seed_fleet(pool: asyncpg.Pool) -> datetime:
    """The fleet above; returns a moment after the first reports and before the changes."""
    service = HardwareInventoryService(EventStore(pool, ALL_PROJECTIONS))
    await report(service, ONLINE, _gpus(with_missing=True), ago=1)
    await report(service, STALE, [gpu(7)], ago=120)
    await report(service, OFFLINE, [], ago=900)
    # A whole second between the two, so the moment survives a form that keeps only seconds.
    before_changes = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=1)
    await asyncio.sleep((before_changes - datetime.now(UTC)).total_seconds() + 0.05)
    # The A100 is gone from the next complete enumeration (missing); the kernel was upgraded.
    await report(service, ONLINE, _gpus(with_missing=False), kernel="6.8.0-50-generic")
    await caught_up(pool)
    return before_changes
