"""The gap-safe read end to end: a fresh embedded PostgreSQL whose transaction ids cross 10,000 while real
refreshes run, then `GET /events` and `replay` followed page by page with small limits; a resumed
cursor; an undecodable event through `/events`, `verify` and `rebuild`; bad cursors."""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import msgspec
import pytest

from tests.fixtures_nvml import multi_gpu_scenario


@pytest.fixture(scope="module")
def fresh_cluster_dsn() -> Iterator[str]:
    """A brand-new cluster (its transaction counter starts below 1,000), not the shared one."""
    import pgserver

    tmp = Path(tempfile.mkdtemp(prefix="mf-xid-pg-"))
    server = pgserver.get_server(tmp, cleanup_mode="delete")
    try:
        yield str(server.get_uri())
    finally:
        server.cleanup()


@pytest.fixture
async def database_dsn(fresh_cluster_dsn: str) -> str:
    """Overrides conftest's: each test's app runs on a new migrated database of the fresh cluster."""
    from ledger.schema import migrate
    from tests.conftest import dsn_for_database

    name = f"mf_xid_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(fresh_cluster_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn = dsn_for_database(fresh_cluster_dsn, name)
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
    finally:
        await conn.close()
    return dsn


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *args], capture_output=True, text=True, env=env, timeout=120
    )


async def current_xid(conn: asyncpg.Connection) -> int:
    value: int = await conn.fetchval("SELECT pg_current_xact_id()")  # autocommitted: burns one
    return value


async def follow(api, limit: int, cursor: str | None = None) -> tuple[list[int], str]:  # type: ignore[no-untyped-def]
    positions: list[int] = []
    while True:
        params: dict[str, object] = {"limit": limit}
        if cursor is not None:
            params["cursor"] = cursor
        r = await api.get("/api/v1/hardware/events", params=params)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["next_cursor"], "every page carries the cursor to resume from"
        positions.extend(e["global_position"] for e in body["items"])
        cursor = body["next_cursor"]
        if not body["has_more"]:
            return positions, cursor


async def test_refreshes_across_xid_10000_are_paged_exactly_once_by_events_and_replay(
    make_api, database_dsn: str
) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(2))
    async with api.pool.acquire() as conn:
        assert await current_xid(conn) < 9_900, "a fresh cluster starts far below 10,000"
        # Burn ids one autocommitted statement at a time up to just below the boundary...
        while await current_xid(conn) < 9_960:
            pass
        # ...then refresh while burning a few more, so the refreshes' own transactions cross it.
        for n in range(25):
            api.scenario.driver_version = "580.95.05" if n % 2 else "550.54.15"
            await api.refresh()
            for _ in range(2):
                await current_xid(conn)
        rows = await conn.fetch("SELECT tx_id, global_position FROM events ORDER BY tx_id, global_position")
    txs = [r["tx_id"] for r in rows]
    assert min(txs) < 10_000 <= max(txs), f"the refreshes did not straddle 10,000: {min(txs)}..{max(txs)}"
    expected = [r["global_position"] for r in rows]
    assert expected != sorted(expected, key=str), "a text sort would reorder these rows"

    whole, _ = await follow(api, 1000)
    assert whole == expected
    for limit in (1, 2, 3, 5, 7):
        paged, _ = await follow(api, limit)
        assert paged == expected, f"limit {limit}: paging lost or repeated events"

    for page_size in ("1", "3", "7"):
        out = await asyncio.to_thread(
            cli, "replay", "--database-url", database_dsn, "--format", "jsonl", "--page-size", page_size
        )
        assert out.returncode == 0, out.stderr
        replayed = [msgspec.json.decode(line)["global_position"] for line in out.stdout.splitlines()]
        assert replayed == expected, f"replay --page-size {page_size}"

    # A poller resumes where it stopped: the next refresh's events, once each, and nothing more.
    _, cursor = await follow(api, 4)
    again, cursor = await follow(api, 4, cursor)
    assert again == []
    api.scenario.driver_version = "535.183.01"
    refresh = await api.refresh()
    new, cursor = await follow(api, 2, cursor)
    assert len(new) == len(refresh["events"]) and len(set(new)) == len(new)
    assert set(new).isdisjoint(expected)
    assert (await follow(api, 2, cursor))[0] == []


async def test_an_undecodable_event_is_named_by_verify_refused_by_rebuild_and_marked_in_events(
    make_api, database_dsn: str
) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(2))
    await api.refresh()
    api.scenario.driver_version = "580.95.05"
    await api.refresh()
    async with api.pool.acquire() as conn:
        victim = await conn.fetchrow(
            "SELECT stream_id, stream_version, global_position FROM events "
            "WHERE event_type = 'HARDWARE_CHANGED' ORDER BY global_position LIMIT 1"
        )
        assert victim is not None
        await conn.execute("ALTER TABLE events DISABLE TRIGGER events_lifecycle_immutable")
        await conn.execute(
            "UPDATE events SET data = jsonb_set(data, '{changes,driver_version,after,state}', "
            "'\"known-tampered\"') WHERE global_position = $1",
            victim["global_position"],
        )
        await conn.execute("ALTER TABLE events ENABLE TRIGGER events_lifecycle_immutable")
        count_before = await conn.fetchval("SELECT count(*) FROM events")
        live_before = await conn.fetch("SELECT * FROM hw_nodes ORDER BY node_id")
    where = (
        f"stream {victim['stream_id']} version {victim['stream_version']} "
        f"position {victim['global_position']}"
    )

    bad = await asyncio.to_thread(cli, "verify", "--database-url", database_dsn)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "Traceback" not in bad.stderr and "ValidationError" not in bad.stderr
    assert f"UNDECODABLE {where}" in bad.stdout
    assert f"BREAK {where}: hash_mismatch" in bad.stdout, "the hash-chain check still ran to the end"

    refused = await asyncio.to_thread(cli, "rebuild", "--database-url", database_dsn)
    assert refused.returncode == 1, refused.stderr
    assert (
        f"stream {victim['stream_id']} version {victim['stream_version']} "
        f"(global position {victim['global_position']})" in refused.stderr
    ), refused.stderr
    assert "nothing was swapped" in refused.stderr
    async with api.pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM events") == count_before
        assert await conn.fetch("SELECT * FROM hw_nodes ORDER BY node_id") == live_before

    r = await api.get("/api/v1/hardware/events", params={"limit": 1000})
    assert r.status_code == 200, r.text
    marked = [e for e in r.json()["items"] if e.get("undecodable")]
    assert [e["global_position"] for e in marked] == [victim["global_position"]]
    assert marked[0]["data"] is None
    assert marked[0]["undecodable"]["stored_data"]["changes"]["driver_version"]["after"]["state"] == (
        "known-tampered"
    )
    out = await asyncio.to_thread(cli, "replay", "--database-url", database_dsn, "--format", "jsonl")
    assert out.returncode == 0, out.stderr
    assert "known-tampered" in out.stdout


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


async def test_malformed_or_foreign_cursors_get_400_problem_json(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(1))
    await api.refresh()
    node_page = (await api.get("/api/v1/hardware/nodes", params={"limit": 1})).json()
    events_page = (await api.get("/api/v1/hardware/events", params={"limit": 1})).json()
    foreign_for_events = [
        "not-base64-!!",
        "%00",
        _b64(b"[1,2]"),
        _b64(b'["log","1",2]'),
        _b64(b'["log",-1,2]'),
        _b64(b'["log",18446744073709551616,2]'),
        _b64(b'["log",1,2,3]'),
        _b64(b'["id","x"]'),
        _b64(b"{}"),
        "\u00e9t\u00e9",
    ]
    for bad in foreign_for_events:
        r = await api.get("/api/v1/hardware/events", params={"cursor": bad})
        assert r.status_code == 400, (bad, r.status_code, r.text)
        assert r.headers["content-type"].startswith("application/problem+json")
        assert r.json()["type"].endswith("invalid-cursor")
    for path in ("/api/v1/hardware/nodes", "/api/v1/hardware/accelerators"):
        for bad in (events_page["next_cursor"], _b64(b'["id",5]'), _b64(b'["id","a\\u0000b"]')):
            r = await api.get(path, params={"cursor": bad})
            assert r.status_code == 400, (path, bad, r.text)
            assert r.headers["content-type"].startswith("application/problem+json")
    assert node_page["next_cursor"] is None or node_page["next_cursor"]
