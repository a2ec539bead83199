"""Audit: point in time, tamper evidence, bounded telemetry, /metrics."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import asyncpg
from prometheus_client.parser import text_string_to_metric_families

from api.services.inventory import HardwareInventoryService
from collectors.identity import NodeIdentity
from collectors.observations import HardwareObservation
from ledger.events import EventMetadata, NodeTelemetryObserved
from ledger.reading import EVENT_COLUMNS, event_from_row
from ledger.retention import prune_observations
from ledger.store import EventStore
from projections.inventory import ALL_PROJECTIONS
from projections.rebuild import rebuild
from tests.builders import gpu, host, scan
from tests.fixtures_nvml import multi_gpu_scenario, rtx_4090_driver_535
from tests.sample_reads import latest_temperatures


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *args], capture_output=True, text=True, env=env, timeout=120
    )


async def db_now(pool: asyncpg.Pool) -> datetime:
    async with pool.acquire() as conn:
        moment: datetime = await conn.fetchval("SELECT clock_timestamp()")
    return moment


def comparable(items: list[dict]) -> list[dict]:  # type: ignore[type-arg]
    return [{k: v for k, v in i.items() if k not in ("as_of_position", "liveness")} for i in items]


async def test_as_of_returns_exactly_the_inventory_of_each_step(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(3))
    steps: list[tuple[str, datetime, list, list]] = []  # type: ignore[type-arg]

    async def snapshot(name: str) -> None:
        await asyncio.sleep(0.01)
        moment = await db_now(api.pool)
        nodes = (await api.get("/api/v1/hardware/nodes")).json()["items"]
        accs = (await api.get("/api/v1/hardware/accelerators")).json()["items"]
        steps.append((name, moment, nodes, accs))
        await asyncio.sleep(0.01)

    await api.refresh()
    await snapshot("discovered")
    api.scenario.driver_version = "580.95.05"
    await api.refresh()
    await snapshot("driver upgraded")
    gone = api.scenario.gpus.pop(1)
    await api.refresh()
    await snapshot("gpu missing")
    api.scenario.gpus.insert(1, gone)
    await api.refresh()
    await snapshot("gpu back")

    fingerprints = {s[2][0]["fingerprint"] for s in steps}
    assert len(fingerprints) == 3  # upgrade and missing change it; back restores the second one
    for name, moment, nodes, accs in steps:
        page = (await api.get("/api/v1/hardware/nodes", params={"as_of": moment.isoformat()})).json()
        assert comparable(page["items"]) == comparable(nodes), name
        assert page["as_of_position"] > 0
        one = (
            await api.get(f"/api/v1/hardware/nodes/{nodes[0]['id']}", params={"as_of": moment.isoformat()})
        ).json()
        assert comparable([one]) == comparable(nodes), name
        acc_page = (
            await api.get("/api/v1/hardware/accelerators", params={"as_of": moment.isoformat()})
        ).json()
        assert comparable(acc_page["items"]) == comparable(accs), name
    missing_step = steps[2]
    statuses = {a["uuid"]: a["status"] for a in missing_step[3]}
    assert statuses[gone.uuid] == "missing"
    before = (await api.get("/api/v1/hardware/nodes", params={"as_of": "2000-01-01T00:00:00Z"})).json()
    assert before["items"] == []


async def test_replay_cli_filters_and_as_of(make_api, database_dsn: str) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(2))
    await api.refresh()
    moment = await db_now(api.pool)
    await asyncio.sleep(0.01)
    gone = api.scenario.gpus.pop()
    await api.refresh()

    out = await asyncio.to_thread(
        cli, "replay", "--database-url", database_dsn, "--class", "lifecycle", "--format", "jsonl"
    )
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert [e["event_type"] for e in events][:1] == ["NODE_DISCOVERED"]
    assert all(e["class"] == "lifecycle" for e in events)
    assert {"global_position", "stream_version", "metadata", "recorded_at", "data"} <= set(events[0])
    out = await asyncio.to_thread(
        cli,
        "replay",
        "--database-url",
        database_dsn,
        "--accelerator",
        gone.uuid,
        "--type",
        "ACCELERATOR_MISSING",
        "--format",
        "jsonl",
    )
    assert [json.loads(line)["data"]["uuid"] for line in out.stdout.splitlines()] == [gone.uuid]
    out = await asyncio.to_thread(
        cli, "replay", "--database-url", database_dsn, "--as-of", moment.isoformat(), "--format", "table"
    )
    assert out.returncode == 0, out.stderr
    assert (
        "folded to global position" in out.stdout and gone.uuid in out.stdout and "missing" not in out.stdout
    )
    table = await asyncio.to_thread(
        cli, "replay", "--database-url", database_dsn, "--format", "table", "--type", "NODE_DISCOVERED"
    )
    assert "POSITION" in table.stdout and "NODE_DISCOVERED" in table.stdout


async def test_verify_detects_an_edited_event_and_a_rewritten_head(make_api, database_dsn: str) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(2))
    await api.refresh()
    api.scenario.driver_version = "580.95.05"
    await api.refresh()
    ok = await asyncio.to_thread(cli, "verify", "--database-url", database_dsn)
    assert ok.returncode == 0, ok.stdout + ok.stderr

    async with api.pool.acquire() as conn:
        victim = await conn.fetchrow(
            "SELECT stream_id, stream_version, global_position FROM events "
            "WHERE event_type = 'ACCELERATOR_DISCOVERED' ORDER BY global_position LIMIT 1"
        )
        await conn.execute("ALTER TABLE events DISABLE TRIGGER events_lifecycle_immutable")
        await conn.execute(
            "UPDATE events SET data = jsonb_set(data, '{name,value}', '\"NVIDIA H100\"') WHERE global_position = $1",
            victim["global_position"],
        )
        await conn.execute("ALTER TABLE events ENABLE TRIGGER events_lifecycle_immutable")
    bad = await asyncio.to_thread(cli, "verify", "--database-url", database_dsn)
    assert bad.returncode == 1
    assert (
        f"stream {victim['stream_id']} version {victim['stream_version']} position {victim['global_position']}"
        in bad.stdout
    )
    assert "hash_mismatch" in bad.stdout


async def test_verify_catches_an_edit_of_the_newest_event_with_its_hash_rewritten(
    store: EventStore, database_dsn: str
) -> None:
    from ledger.events import InventoryFailed
    from tests.builders import new

    await store.append(
        "s",
        0,
        [new(InventoryFailed(stage="host", reason="a")), new(InventoryFailed(stage="host", reason="b"))],
    )
    async with store.pool.acquire() as conn:
        await conn.execute("ALTER TABLE events DISABLE TRIGGER events_lifecycle_immutable")
        # a careful forger edits the newest event and recomputes its hash: the stream head catches it
        await conn.execute(
            "UPDATE events SET data = jsonb_set(data, '{reason}', '\"forged\"') WHERE stream_version = 2"
        )
        await conn.execute(
            "UPDATE events SET hash = mf_event_hash(prev_hash, stream_id, stream_version, event_id, event_type, "
            "schema_version, data, metadata, recorded_at) WHERE stream_version = 2"
        )
        await conn.execute("ALTER TABLE events ENABLE TRIGGER events_lifecycle_immutable")
    bad = await asyncio.to_thread(cli, "verify", "--database-url", database_dsn)
    assert bad.returncode == 1 and "head_mismatch" in bad.stdout and "stream s" in bad.stdout


async def test_retention_bounds_observation_storage_and_rebuild_still_matches(store: EventStore) -> None:
    """1,000 nodes reporting for 48 simulated hours, time compressed: a report every 6 simulated
    hours (8 per node) under a 24 h policy. The bound the policy promises is the same at any
    interval: per node and kind, the reports of the last 24 h plus the newest."""
    service = HardwareInventoryService(store)
    nodes, reports, interval, keep = 1000, 8, timedelta(hours=6), timedelta(hours=24)
    start = datetime(2026, 11, 1, tzinfo=UTC)
    sem = asyncio.Semaphore(8)

    async def report(n: int, r: int) -> None:
        at = start + r * interval
        gpus = [gpu(0, temp=30 + r)] if not (n == 0 and r >= 2) else []  # node 0 loses its GPU early
        obs = HardwareObservation(observed_at=at, host=host(f"node-{n}", mem_avail=r), nvml=scan(gpus))
        async with sem:
            await service.reconcile_observation(
                NodeIdentity(key=f"sim-{n}", source="configured"),
                obs,
                EventMetadata(received_at=at, source="agent", observed_at=at),
            )

    for r in range(reports):
        await asyncio.gather(*(report(n, r) for n in range(nodes)))
    now = start + (reports - 1) * interval
    async with store.pool.acquire() as conn:
        before = await conn.fetchval("SELECT count(*) FROM events WHERE event_class = 'observation'")
        lifecycle_before = await conn.fetchval("SELECT count(*) FROM events WHERE event_class = 'lifecycle'")
    result = await prune_observations(store.pool, keep=keep, now=now, batch=5000)
    async with store.pool.acquire() as conn:
        after = await conn.fetchval("SELECT count(*) FROM events WHERE event_class = 'observation'")
        lifecycle_after = await conn.fetchval("SELECT count(*) FROM events WHERE event_class = 'lifecycle'")
        oldest = await conn.fetchval(
            "SELECT min(received_at) FROM events WHERE event_class = 'observation' AND stream_id <> $1",
            (await conn.fetchval("SELECT node_id FROM hw_nodes WHERE hostname = 'node-0'")),
        )
        node0 = [
            event_from_row(r)
            for r in await conn.fetch(
                f"SELECT {EVENT_COLUMNS} FROM events JOIN hw_nodes n ON n.node_id = events.stream_id "
                "WHERE n.hostname = 'node-0' AND events.event_type = 'NODE_TELEMETRY_OBSERVED'"
            )
        ]
        lost_gpu_kept = sum(
            1 for e in node0 if isinstance(e.payload, NodeTelemetryObserved) and e.payload.accelerators
        )
    per_window = keep // interval + 1  # reports received within the window, both ends included
    # One snapshot per report; beyond the window, only the lost GPU's newest sample.
    bound = nodes * per_window + 1
    assert result.deleted == before - after > 0
    assert after <= bound, (after, bound)
    assert oldest >= now - keep
    assert lifecycle_after == lifecycle_before
    assert lost_gpu_kept == 1, "the newest telemetry of a GPU gone missing long ago survives"
    report_ = await rebuild(store.pool, ALL_PROJECTIONS, verify=True)
    assert report_.differences == []
    # pruning again changes nothing
    assert (await prune_observations(store.pool, keep=keep, now=now)).deleted == 0


async def test_retention_keeps_the_last_sample_of_a_gpu_an_incomplete_scan_left_out(
    store: EventStore,
) -> None:
    """A node's snapshot samples the GPUs its scan listed. While scans are incomplete (a GPU that
    stopped answering is still `active`), that GPU's latest telemetry is in an older snapshot:
    pruning keeps it, so the read model and a rebuild still show it."""
    service = HardwareInventoryService(store)
    start = datetime(2026, 11, 1, tzinfo=UTC)
    identity = NodeIdentity(key="sim-incomplete", source="configured")
    scans = [scan([gpu(0, temp=30), gpu(1, temp=61)])]
    scans += [scan([gpu(0, temp=30 + r)], status="incomplete", reason="GPU 1 timed out") for r in range(1, 6)]
    for r, nvml in enumerate(scans):
        at = start + r * timedelta(hours=6)
        obs = HardwareObservation(observed_at=at, host=host("node-x", mem_avail=r), nvml=nvml)
        await service.reconcile_observation(
            identity, obs, EventMetadata(received_at=at, source="agent", observed_at=at)
        )
    async with store.pool.acquire() as conn:
        before = await latest_temperatures(conn)
    assert [t for _, t in before] == ["35", "61"]  # GPU 1's last sample is the first report's

    result = await prune_observations(store.pool, keep=timedelta(hours=1), now=start + timedelta(days=3))
    async with store.pool.acquire() as conn:
        kept = await conn.fetchval("SELECT count(*) FROM events WHERE event_type = 'NODE_TELEMETRY_OBSERVED'")
        after = await latest_temperatures(conn)
    assert result.deleted == 4, "the snapshots between GPU 1's last sample and the newest one go"
    assert kept == 2 and after == before
    report = await rebuild(store.pool, ALL_PROJECTIONS, verify=True)
    assert report.differences == []
    async with store.pool.acquire() as conn:
        assert await latest_temperatures(conn) == before


async def test_metrics_export_known_values_only(make_api) -> None:  # type: ignore[no-untyped-def]
    sc = rtx_4090_driver_535()  # fan 0 %
    sc.gpus.append(multi_gpu_scenario(1).gpus[0])  # fan NotSupported
    api = make_api(sc)
    await api.refresh()
    r = await api.client.get("/metrics")
    assert r.status_code == 401
    r = await api.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    fan = {s.labels["UUID"]: s.value for s in families["modelforge_gpu_fan_speed_ratio"].samples}
    assert fan == {sc.gpus[0].uuid: 0.0}, "a known 0 is 0; an unsupported fan is absent"
    temps = families["modelforge_gpu_temperature_celsius"].samples
    assert {s.labels["UUID"] for s in temps} == {g.uuid for g in sc.gpus}
    assert all(s.labels["node_id"] for s in temps)
    assert "modelforge_node_memory_available_bytes" in families
    assert "modelforge_ingest_events" in families
    lag = families["modelforge_projection_lag_events"].samples[0].value
    assert lag == 0
