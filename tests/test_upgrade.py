"""Upgrades: a database created and filled by 0.1.0 (schema version 1) is migrated forward by
`modelforge-hw migrate` through every numbered step, keeps every event, passes `verify` and
`rebuild --verify`, and ends with the catalog a new database gets from schema.sql.

tests/fixtures/schema-0.1.0.sql is schema.sql as released in 0.1.0 (commit 1d2b71f);
tests/fixtures/modelforge-0.1.0.sql is `pg_dump --column-inserts` of a database 0.1.0 made and
filled (two local refreshes, two enrolled agents with three reports each), passed through
tests/fixtures/renumber_xids.py so it restores into any cluster.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest

from api.services.inventory import HardwareInventoryService
from api.services.positions import recent_digests
from api.services.reads.samples import samples_at
from api.services.reads.telemetry import TelemetryReads
from collectors.identity import NodeIdentity
from collectors.observations import HardwareObservation
from domain.telemetry_history import window
from ledger.compact import FORMAT_2, FORMAT_3, FORMAT_4, encode_body_of, gpu_set
from ledger.compact_decode import decode_body
from ledger.db import create_pool
from ledger.events import EventMetadata, RecordedEvent
from ledger.reading import EVENT_COLUMNS, entry_from_row
from ledger.retention import prune_observations
from ledger.schema import LATEST_SCHEMA_VERSION, migrate, migration_steps
from ledger.store import EventStore
from projections.inventory import ALL_PROJECTIONS
from projections.pointintime import inventory_as_of
from tests.builders import gpu, host, scan, signals, with_health
from tests.compact_format_1 import encode_body_1
from tests.sample_reads import latest_temperatures
from tests.schema_catalog import catalog

FIXTURES = Path(__file__).resolve().parent / "fixtures"
EVENTS = (
    "SELECT global_position, tx_id::text AS tx, event_id, stream_id, stream_version, event_type, "
    "data::text AS data_json, metadata::text AS metadata_json, recorded_at, hash FROM events "
    "ORDER BY global_position"
)


async def run_sql_file(dsn: str, path: Path) -> None:
    # A connection of its own: the dump empties search_path for its session.
    sql = await asyncio.to_thread(path.read_text, encoding="utf-8")
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    env["MODELFORGE_DATABASE_URL"] = dsn
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


async def test_a_filled_0_1_0_database_migrates_forward_keeping_every_event(empty_database: str) -> None:
    await run_sql_file(empty_database, FIXTURES / "modelforge-0.1.0.sql")
    conn = await asyncpg.connect(empty_database)
    try:
        assert await conn.fetchval("SELECT max(version) FROM schema_version") == 1
        before = await conn.fetch(EVENTS)
        assert len(before) >= 40 and {r["event_type"] for r in before} >= {
            "NODE_DISCOVERED",
            "ACCELERATOR_DISCOVERED",
            "CREDENTIAL_ISSUED",
            "HOST_TELEMETRY_OBSERVED",
        }
    finally:
        await conn.close()

    done = cli(empty_database, "migrate")
    assert done.returncode == 0, done.stderr
    assert f"schema is at version {LATEST_SCHEMA_VERSION}" in done.stdout

    conn = await asyncpg.connect(empty_database)
    try:
        after = await conn.fetch(EVENTS)
        versions = [r["version"] for r in await conn.fetch("SELECT version FROM schema_version ORDER BY 1")]
    finally:
        await conn.close()
    assert [dict(r) for r in after] == [dict(r) for r in before], "every event kept, byte for byte"
    assert versions == list(range(1, LATEST_SCHEMA_VERSION + 1))

    verify = cli(empty_database, "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    rebuilt = cli(empty_database, "rebuild", "--verify")
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    # the upgraded database serves its old inventory
    conn = await asyncpg.connect(empty_database)
    try:
        assert await conn.fetchval("SELECT count(*) FROM hw_nodes") == 3
        assert await conn.fetchval("SELECT count(*) FROM hw_accelerators") == 6
        # an agent stream's recent digests converted entry for entry (0008): an unchanged retry
        # sent across the upgrade is still recognised
        position = await conn.fetchrow(
            "SELECT recent, last_sequence FROM agent_stream_positions "
            "WHERE node_id = 'abea93e7-7a8b-5a6f-a013-a166c5533f2a' AND stream = 'inventory'"
        )
        assert recent_digests(position["recent"], position["last_sequence"]) == {
            1: "a1a33f4f69cb4d9cd569406345e7315ae86813253441e2d258cffec3670e115d",
            2: "b5bb2c060d9ae2107c433b7c35ba1a6dae43fceef19274b82b278a77606d29cc",
            3: "f4edbc00af999876b466fcee32e281fbb6cf473cd1ca3006418edac09b676bae",
        }
        # 0.1.0 logged each GPU's sample as its own ACCELERATOR_TELEMETRY_OBSERVED: the telemetry
        # rows (0006: a position, no copy) find every GPU's metrics in those events, one at a
        # time and all at once (the API's pages and /metrics read them so)
        rows = await conn.fetch(
            "SELECT a.uuid, t.position FROM hw_accelerator_telemetry t JOIN hw_accelerators a "
            "USING (accelerator_id) ORDER BY 1"
        )
        samples = await samples_at(conn, [r["position"] for r in rows])
        assert len(rows) == 6 and all(samples[(r["position"], r["uuid"])].metrics for r in rows)
        # the old log is the permanent segment of a partitioned one (0004), and appends go on
        # after its last position: lifecycle events there, today's observations on today's day
        assert await conn.fetchval("SELECT relkind::text FROM pg_class WHERE relname = 'events'") == "p"
        assert await conn.fetchval("SELECT count(*) FROM events_permanent") == len(before)
        await conn.execute(
            "SELECT * FROM mf_append('upgrade-probe', 0, "
            "ARRAY[gen_random_uuid(), gen_random_uuid()], ARRAY['INVENTORY_FAILED', 'HOST_TELEMETRY_OBSERVED'], "
            "ARRAY['lifecycle', 'observation'], ARRAY[1, 1], ARRAY['{}'::jsonb, '{}'::jsonb], "
            "ARRAY['{}'::jsonb, jsonb_build_object('received_at', now())])"
        )
        probe = await conn.fetch(
            "SELECT global_position, segment::text AS seg FROM events WHERE stream_id = 'upgrade-probe' "
            "ORDER BY stream_version"
        )
        today = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date::text")
        assert [r["seg"] for r in probe] == ["infinity", today]
        assert probe[0]["global_position"] > max(r["global_position"] for r in before)
    finally:
        await conn.close()


async def test_migrated_0_1_0_schema_equals_a_fresh_one(empty_database: str, database_dsn: str) -> None:
    # Version 1 through every step ends where schema.sql starts a new database: the same tables,
    # columns (in order, with types, defaults and compression), constraints, indexes, storage
    # settings, partitions, triggers and functions (tests/schema_catalog.py).
    await run_sql_file(empty_database, FIXTURES / "schema-0.1.0.sql")
    old = await asyncpg.connect(empty_database)
    fresh = await asyncpg.connect(database_dsn)
    try:
        assert await migrate(old) == LATEST_SCHEMA_VERSION
        assert await catalog(old) == await catalog(fresh)
        # and again: a migrated database is left alone
        assert await migrate(old) == LATEST_SCHEMA_VERSION
        assert await old.fetchval("SELECT count(*) FROM schema_version") == LATEST_SCHEMA_VERSION
        assert await catalog(old) == await catalog(fresh)
    finally:
        await old.close()
        await fresh.close()


async def test_a_database_newer_than_the_release_is_refused(database_dsn: str) -> None:
    conn = await asyncpg.connect(database_dsn)
    try:
        await conn.execute("INSERT INTO schema_version (version) VALUES ($1)", LATEST_SCHEMA_VERSION + 1)
        with pytest.raises(RuntimeError, match="newer than this release"):
            await migrate(conn)
    finally:
        await conn.close()


def test_steps_are_numbered_in_order_from_two() -> None:
    steps = migration_steps()
    assert [s.version for s in steps] == list(range(2, LATEST_SCHEMA_VERSION + 1))
    assert all(s.sql.strip() for s in steps)


async def test_a_server_starting_beside_a_backup_neither_waits_for_it_nor_blocks_the_log(
    database_dsn: str,
) -> None:
    # A backup's pg_dump holds a shared lock on every table for its whole length. A server that
    # starts meanwhile runs migrate, which installs the functions and triggers again: on a current
    # database it must take no lock that waits for that reader (and so no lock every append would
    # then queue behind).
    reader = await asyncpg.connect(database_dsn)
    starting = await asyncpg.connect(database_dsn)
    try:
        tables = [
            r[0] for r in await reader.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        ]
        assert {"events", "hw_accelerators", "projection_state"} <= set(tables)
        async with reader.transaction(isolation="repeatable_read"):
            for table in tables:
                await reader.execute(f'SELECT 1 FROM "{table}" LIMIT 1')
            await starting.execute("SET lock_timeout = '2s'")
            assert await migrate(starting) == LATEST_SCHEMA_VERSION
    finally:
        await reader.close()
        await starting.close()


async def test_a_version_7_log_holding_jsonb_snapshots_reads_the_same_with_compact_ones_after_it(
    empty_database: str,
) -> None:
    """A database the previous release filled (schema version 7: every telemetry snapshot jsonb)
    is migrated, takes compact snapshots after its jsonb ones, and every reader treats the two
    alike: verify, rebuild --verify, the catch-up read, as-of, the telemetry history, retention;
    the compact ones of every format, as the releases that wrote formats 1 and 2 stored them."""
    await run_sql_file(empty_database, FIXTURES / "modelforge-schema-7.sql")
    conn = await asyncpg.connect(empty_database)
    try:
        assert await conn.fetchval("SELECT max(version) FROM schema_version") == 7
        before = await conn.fetch(EVENTS)
    finally:
        await conn.close()
    done = cli(empty_database, "migrate")
    assert done.returncode == 0, done.stderr

    pool = await create_pool(empty_database)
    try:
        service = HardwareInventoryService(EventStore(pool, ALL_PROJECTIONS))
        last_jsonb = max(r["recorded_at"] for r in before)
        # The reports after the upgrade follow the fixture's own clock, not today's: the health
        # policy counts an XID for a window after it was seen, so against the wall clock the
        # fixture's XID would age out and this test's verdicts would change with the date.
        async with pool.acquire() as conn:
            fixture_clock = await conn.fetchval("SELECT max(received_at) FROM events")
        start = fixture_clock + timedelta(minutes=30)
        for n, name in enumerate(("gpu-host-a", "gpu-host-b")):
            identity = NodeIdentity(key=f"fixture-v7-{name}", source="configured")
            for r in range(2):
                at = start + timedelta(minutes=10 * r + n)
                gpus = [
                    with_health(gpu(0, temp=70 + r), signals()),
                    with_health(gpu(1, temp=80 + r), signals()),
                ]
                obs = HardwareObservation(observed_at=at, host=host(name, mem_avail=200 + r), nvml=scan(gpus))
                await service.reconcile_observation(
                    identity, obs, EventMetadata(received_at=at, source="agent", observed_at=at)
                )
        async with pool.acquire() as conn:
            # the first as the releases that wrote format 1 stored it, the second and third as
            # those that wrote formats 2 and 3 did, the fourth as this one writes it (format 4)
            for k, row in enumerate(
                await conn.fetch(
                    "SELECT global_position, stream_id, body, "
                    "(SELECT gpus FROM gpu_sets g WHERE g.sampled = events.sampled) AS gpus "
                    "FROM events WHERE body IS NOT NULL ORDER BY global_position LIMIT 3"
                )
            ):
                assert row["body"][1] == FORMAT_4
                payload, meta = decode_body(row["body"], row["stream_id"], row["gpus"])
                await conn.execute(
                    "UPDATE events SET body = $2 WHERE global_position = $1",
                    row["global_position"],
                    encode_body_1(payload, meta)
                    if k == 0
                    else encode_body_of(
                        (FORMAT_2, FORMAT_3)[k - 1], payload, meta, row["stream_id"], gpu_set(payload)
                    )[0],
                )
            formats = await conn.fetchval(
                "SELECT array_agg(get_byte(body, 1) ORDER BY global_position) FROM events WHERE body IS NOT NULL"
            )
            after = await conn.fetch(EVENTS + " LIMIT $1", len(before))
            forms = await conn.fetchrow(
                "SELECT count(*) FILTER (WHERE body IS NOT NULL) AS compact, "
                "count(*) FILTER (WHERE body IS NULL AND event_type = 'NODE_TELEMETRY_OBSERVED') AS jsonb "
                "FROM events"
            )
            # (every event, not the catch-up read: its horizon waits for any transaction open in
            # the cluster, other databases' too)
            logged = [entry_from_row(r) for r in await conn.fetch(f"SELECT {EVENT_COLUMNS} FROM events")]
            old = await inventory_as_of(conn, last_jsonb)
            new = await inventory_as_of(conn, datetime.now(UTC))
            gpu0 = await conn.fetchval(
                "SELECT accelerator_id FROM hw_accelerators WHERE uuid = $1 LIMIT 1", gpu(0).uuid
            )
        assert [dict(r) for r in after] == [dict(r) for r in before], (
            "the jsonb events are kept byte for byte"
        )
        assert (forms["compact"], forms["jsonb"]) == (4, 8)
        assert formats == [1, 2, 3, 4]
        # the log's reader decodes both forms: every event, none left as undecodable
        assert len(logged) == len(before) + 4 and all(isinstance(e, RecordedEvent) for e in logged)
        temps = {
            s.hostname: sorted(
                t.metrics["temperature_celsius"].value  # type: ignore[union-attr]
                for t in s.accelerator_telemetry.values()
            )
            for s in old.nodes
        }
        assert temps == {"gpu-host-a": [43, 53], "gpu-host-b": [43, 53]}
        assert {
            s.hostname: sorted(
                t.metrics["temperature_celsius"].value  # type: ignore[union-attr]
                for t in s.accelerator_telemetry.values()
            )
            for s in new.nodes
        } == {"gpu-host-a": [71, 81], "gpu-host-b": [71, 81]}
        # the history of one GPU runs through both forms
        history = await TelemetryReads(pool).accelerator(
            gpu0, window(datetime(2026, 12, 1, tzinfo=UTC), datetime.now(UTC) + timedelta(minutes=1), 86_400)
        )
        assert history.samples == 6
        verify = cli(empty_database, "verify")
        assert verify.returncode == 0, verify.stdout + verify.stderr
        rebuilt = cli(empty_database, "rebuild", "--verify")
        assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
        # retention over both forms keeps each GPU's newest sample: the compact one
        await prune_observations(pool, keep=timedelta(minutes=1), now=datetime.now(UTC) + timedelta(days=2))
        async with pool.acquire() as conn:
            kept = await conn.fetch(
                "SELECT body IS NOT NULL AS compact FROM events WHERE event_type = 'NODE_TELEMETRY_OBSERVED'"
            )
            assert [r["compact"] for r in kept] == [True, True]
            assert [t for _, t in await latest_temperatures(conn)] == ["71", "71", "81", "81"]
        rebuilt = cli(empty_database, "rebuild", "--verify")
        assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    finally:
        await pool.close()
