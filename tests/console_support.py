"""A small fleet for the console tests, reconciled through the real service into a real database:
an online node whose GPUs read a measured 0 % fan, an unsupported fan, an unavailable power reading
and (after a second report) a missing GPU; a stale node; an offline node without GPUs.

GPU health: the 0 %-fan GPU is healthy, the unsupported-fan one degraded (a row remap pending and
XID 63), the missing A100 sends no signals (an older agent), the stale node's GPU has failed
(uncorrectable ECC errors). Hopper GPUs retire no pages: those signals are unsupported."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import asyncpg
import msgspec

from api.services.inventory import HardwareInventoryService
from api.wiring import event_store
from collectors.facts import UNSUPPORTED, Known, Unavailable
from collectors.gpu_health import RETIRED_PAGES, XidOccurrence
from collectors.identity import NodeIdentity
from collectors.observations import AcceleratorObservation, HardwareObservation
from domain.node import node_id_for
from ledger.events import AcceleratorSample, EventMetadata, NewEvent, NodeTelemetryObserved
from ledger.store import EventStore
from projections.inventory import ALL_PROJECTIONS
from tests.builders import gpu, host, pending_remap, scan, signals, uncorrected_ecc, with_health

ZERO_FAN_GPU = "GPU-00000000-0000-4000-8000-000000000001"
NO_FAN_GPU = "GPU-00000000-0000-4000-8000-000000000002"
MISSING_GPU = "GPU-00000000-0000-4000-8000-000000000003"
FAILED_GPU = "GPU-00000000-0000-4000-8000-000000000007"  # the stale node's
ONLINE, STALE, OFFLINE = "gpu-a01", "gpu-b02", "cpu-c03"


def node_id(hostname: str) -> str:
    return node_id_for(f"console-test/{hostname}")


NO_RETIREMENT = {"retired_pages": {n: UNSUPPORTED for n in RETIRED_PAGES}}


def _gpus(with_missing: bool, xid_at: datetime) -> list[AcceleratorObservation]:
    zero = with_health(gpu(1, fan=Known(0)), signals(**NO_RETIREMENT))
    no_fan = gpu(2)
    no_fan = msgspec.structs.replace(
        no_fan, telemetry={**no_fan.telemetry, "power_watts": Unavailable("NVML: NoPermission")}
    )
    # The same occurrence in both reports (a resend): recorded once.
    no_fan = with_health(no_fan, pending_remap(xids=[XidOccurrence(code=63, at=xid_at)], **NO_RETIREMENT))
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
    xid_at = datetime.now(UTC) - timedelta(seconds=2)
    await report(service, ONLINE, _gpus(with_missing=True, xid_at=xid_at), ago=1)
    await report(service, STALE, [with_health(gpu(7), uncorrected_ecc(**NO_RETIREMENT))], ago=120)
    await report(service, OFFLINE, [], ago=900)
    # A whole second between the two, so the moment survives a form that keeps only seconds.
    before_changes = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=1)
    await asyncio.sleep((before_changes - datetime.now(UTC)).total_seconds() + 0.05)
    # The A100 is gone from the next complete enumeration (missing); the kernel was upgraded.
    await report(service, ONLINE, _gpus(with_missing=False, xid_at=xid_at), kernel="6.8.0-50-generic")
    await caught_up(pool)
    return before_changes


CHART_HOST = "chart-host"


async def seed_chart_history(pool: asyncpg.Pool) -> str:
    """A GPU without a power sensor on CHART_HOST, with 50 minutes of samples every 15 s up to now
    and ten silent minutes (20 to 30 minutes ago) among them; returns its accelerator id."""
    base = gpu(42)
    sensorless = msgspec.structs.replace(base, telemetry={**base.telemetry, "power_watts": UNSUPPORTED})
    await report(HardwareInventoryService(EventStore(pool, ALL_PROJECTIONS)), CHART_HOST, [sensorless])
    async with pool.acquire() as conn:
        acc_id: str = await conn.fetchval(
            "SELECT accelerator_id FROM hw_accelerators WHERE uuid = $1", sensorless.uuid
        )
    now = datetime.now(UTC)
    events = []
    for k in range(199, 0, -1):  # oldest first, as an agent sends them
        at = now - timedelta(seconds=15 * k)
        if timedelta(minutes=20) <= now - at < timedelta(minutes=30):
            continue
        sample = AcceleratorSample(
            accelerator_id=acc_id,
            uuid=sensorless.uuid,
            telemetry={"temperature_celsius": Known(40 + k % 7), "power_watts": UNSUPPORTED},
        )
        payload = NodeTelemetryObserved(
            telemetry={"memory_available_bytes": Known(3 * 2**30 + k)}, storage=[], accelerators=[sample]
        )
        meta = EventMetadata(received_at=at, source="agent", observed_at=at)
        events.append(NewEvent(payload=payload, metadata=meta))
    await event_store(pool).append(node_id(CHART_HOST), None, events)
    return acc_id
