"""Property: for any sequence of observations across nodes, the live read models equal a rebuild
from the log, row for row; and `rebuild --verify` notices a tampered read model."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid

import asyncpg
import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectors.facts import UNSUPPORTED, Known, TemporarilyFailed
from collectors.gpu_health import (
    CLOCK_EVENT_REASONS,
    ECC_COUNTERS,
    RETIRED_PAGES,
    AcceleratorHealthSignals,
    XidOccurrence,
)
from collectors.identity import NodeIdentity
from collectors.observations import HardwareObservation
from domain.node import node_id_for
from domain.reconcile import reconcile
from ledger.store import EventStore
from projections.inventory import ALL_PROJECTIONS, INVENTORY
from projections.rebuild import rebuild
from tests.builders import T0, gpu, host, meta, scan

# One step of a node's life: which of 4 GPUs NVML sees, how the scan went, the driver, a kernel,
# a temperature, and whether one fact flickers to temporarily_failed.
steps = st.fixed_dictionaries(
    {
        "gpus": st.sets(st.integers(0, 3)),
        "status": st.sampled_from(["complete", "complete", "complete", "incomplete", "unavailable"]),
        "driver": st.sampled_from(["550.54.15", "580.95.05"]),
        "kernel": st.sampled_from(["6.8.0-45-generic", "6.8.0-49-generic"]),
        "temp": st.integers(0, 95),
        "swap_pci": st.booleans(),
        "flicker": st.booleans(),
        "fan_zero": st.booleans(),
        # GPU health: what the GPUs' signals say at this step.
        "health": st.sampled_from(["none", "clean", "clean", "pending_remap", "thermal", "xid79", "xid13"]),
    }
)
histories = st.lists(st.tuples(st.integers(0, 2), steps), min_size=1, max_size=12)


def plain_step(**changes: object) -> dict[str, object]:
    """One step of `steps` with nothing unusual: two GPUs, a complete scan, no health signal."""
    return {
        "gpus": {0, 1},
        "status": "complete",
        "driver": "550.54.15",
        "kernel": "6.8.0-45-generic",
        "temp": 40,
        "swap_pci": False,
        "flicker": False,
        "fan_zero": False,
        "health": "none",
        **changes,
    }


def health_of(kind: str, n: int) -> AcceleratorHealthSignals | None:
    """Signals of GPU `n`; only GPU 1 ever has a problem, so verdicts differ between GPUs."""
    if kind == "none":
        return None
    problem = kind if n == 1 else "clean"
    reasons = {
        name: Known(name == "hw_thermal_slowdown" and problem == "thermal") for name in CLOCK_EVENT_REASONS
    }
    xids = [XidOccurrence(code=int(problem[3:]), at=T0)] if problem.startswith("xid") else []
    return AcceleratorHealthSignals(
        clock_event_reasons=reasons,
        ecc_mode=Known("enabled"),
        ecc_errors=dict.fromkeys(ECC_COUNTERS, Known(0)),
        remapped_rows={
            "correctable": Known(0),
            "uncorrectable": Known(0),
            "pending": Known(problem == "pending_remap"),
            "failure": Known(False),
        },
        retired_pages=dict.fromkeys(RETIRED_PAGES, UNSUPPORTED),
        pcie_replay_count=Known(n),
        xid_events=Known(True),
        xids=xids,
    )


def observation_of(step: dict) -> HardwareObservation:  # type: ignore[type-arg]
    gpus = []
    for n in sorted(step["gpus"]):
        g = gpu(
            n,
            temp=step["temp"],
            fan=Known(0) if step["fan_zero"] else None,
            pci=f"00000000:{0x40 + n:02X}:00.0" if step["swap_pci"] else None,
        )
        if step["flicker"]:
            g = type(g)(
                **{
                    **{f: getattr(g, f) for f in g.__struct_fields__},
                    "name": TemporarilyFailed("GPU is lost"),
                }
            )
        health = health_of(step.get("health", "none"), n)
        if health is not None:
            g = msgspec.structs.replace(g, health=health)
        gpus.append(g)
    status = step["status"]
    nvml = scan(
        gpus if status != "unavailable" else [],
        status=status,
        reason=None if status == "complete" else "NVML said no",
        driver=step["driver"],
    )
    if status == "unavailable":
        nvml = type(nvml)(
            status="unavailable",
            reason="NVML library not found",
            driver_version=UNSUPPORTED,
            cuda_driver_version=UNSUPPORTED,
            accelerators=[],
        )
    return HardwareObservation(observed_at=T0, host=host(kernel=step["kernel"]), nvml=nvml)


async def apply_history(store: EventStore, prefix: str, history: list) -> None:  # type: ignore[type-arg]
    for node_no, step in history:
        identity = NodeIdentity(key=f"{prefix}-{node_no}", source="configured")
        node_id = node_id_for(identity.key)
        async with store.pool.acquire() as conn, conn.transaction():
            info = await store.lock_stream(conn, node_id)
            state = await INVENTORY.load_state(conn, node_id)
            payloads = reconcile(observation_of(step), state, identity)
            from ledger.events import NewEvent

            await store.append(
                node_id, info.version, [NewEvent(p, meta()) for p in payloads], conn=conn, locked=True
            )


async def test_live_read_models_equal_a_rebuild_for_any_history(store: EventStore) -> None:
    loop = asyncio.get_running_loop()
    failures: list[object] = []

    @settings(
        max_examples=int(os.environ.get("MF_PROPERTY_EXAMPLES", "30")),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(history=histories)
    def prop(history: list) -> None:  # type: ignore[type-arg]
        # hypothesis drives a sync function; run each example on the test's own event loop
        # from a worker thread.
        prefix = uuid.uuid4().hex[:8]

        async def example() -> None:
            await apply_history(store, prefix, history)
            report = await rebuild(store.pool, ALL_PROJECTIONS, verify=True)
            assert report.differences == [], report.differences

        asyncio.run_coroutine_threadsafe(example(), loop).result()

    try:
        await asyncio.to_thread(prop)
    except Exception as exc:  # surfaced with hypothesis' own minimal example
        failures.append(exc)
        raise


async def test_rebuild_verify_cli_exits_0_then_1_after_tampering(
    store: EventStore, database_dsn: str
) -> None:
    history = [
        (
            0,
            plain_step(fan_zero=True),
        ),
        (
            1,
            {
                "gpus": {2},
                "status": "incomplete",
                "driver": "580.95.05",
                "kernel": "6.8.0-45-generic",
                "temp": 41,
                "swap_pci": True,
                "flicker": True,
                "fan_zero": False,
            },
        ),
    ]
    await apply_history(store, "cli", history)

    def verify() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "api.cli", "rebuild", "--verify", "--database-url", database_dsn],
            capture_output=True,
            text=True,
            timeout=120,
        )

    ok = await asyncio.to_thread(verify)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    async with store.pool.acquire() as conn:
        await conn.execute("UPDATE hw_accelerators SET status = 'missing' WHERE uuid LIKE '%0001'")
    bad = await asyncio.to_thread(verify)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "hw_accelerators" in bad.stdout and "DIFFERENCE" in bad.stdout
    # a real rebuild repairs it, and verify is clean again
    fixed = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "api.cli", "rebuild", "--database-url", database_dsn],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert fixed.returncode == 0, fixed.stderr
    assert (await asyncio.to_thread(verify)).returncode == 0


async def test_rebuild_swap_keeps_serving_and_index_names(store: EventStore, pool: asyncpg.Pool) -> None:
    await apply_history(
        store,
        "swap",
        [
            (
                0,
                {
                    "gpus": {0},
                    "status": "complete",
                    "driver": "1",
                    "kernel": "k",
                    "temp": 1,
                    "swap_pci": False,
                    "flicker": False,
                    "fan_zero": False,
                },
            )
        ],
    )
    async with pool.acquire() as conn:
        before = await conn.fetch("SELECT indexname FROM pg_indexes WHERE tablename = 'hw_nodes' ORDER BY 1")
    report = await rebuild(pool, ALL_PROJECTIONS)
    assert report.swapped
    async with pool.acquire() as conn:
        after = await conn.fetch("SELECT indexname FROM pg_indexes WHERE tablename = 'hw_nodes' ORDER BY 1")
        assert await conn.fetchval("SELECT count(*) FROM hw_nodes") == 1
    assert before == after
    # and appends keep working on the swapped-in tables
    await apply_history(
        store,
        "swap",
        [
            (
                0,
                {
                    "gpus": set(),
                    "status": "complete",
                    "driver": "1",
                    "kernel": "k",
                    "temp": 1,
                    "swap_pci": False,
                    "flicker": False,
                    "fan_zero": False,
                },
            )
        ],
    )
    assert (await rebuild(pool, ALL_PROJECTIONS, verify=True)).differences == []
