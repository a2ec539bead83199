"""Test fixtures: always a real PostgreSQL.

The server is `MODELFORGE_TEST_DATABASE_URL` when set (CI sets it), else a throwaway embedded one
(`pgserver`) this session starts. Each test gets its own database cloned from a migrated template,
so tests never see each other's events.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from ledger.db import create_pool
from ledger.schema import migrate
from ledger.store import EventStore
from projections.inventory import ALL_PROJECTIONS


def dsn_for_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


@pytest.fixture(scope="session")
def pg_server_dsn() -> Iterator[str]:
    configured = os.environ.get("MODELFORGE_TEST_DATABASE_URL")
    if configured:
        yield configured
        return
    import pgserver

    tmp = Path(tempfile.mkdtemp(prefix="mf-test-pg-"))
    server = pgserver.get_server(tmp, cleanup_mode="delete")
    try:
        yield str(server.get_uri())
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
async def template_database(pg_server_dsn: str) -> AsyncIterator[str]:
    name = f"mf_template_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(pg_server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        conn = await asyncpg.connect(dsn_for_database(pg_server_dsn, name))
        try:
            await migrate(conn)
        finally:
            await conn.close()
        # As `migrate`/`serve` leave a new database: its read models built at the code's versions.
        from projections.rebuild import rebuild_outdated

        # rebuild holds three connections at once (control, read, write)
        pool = await create_pool(dsn_for_database(pg_server_dsn, name), min_size=1, max_size=4)
        try:
            await rebuild_outdated(pool, ALL_PROJECTIONS)
        finally:
            await pool.close()
        yield name
    finally:
        rows = await admin.fetch(
            "SELECT datname FROM pg_database WHERE datname LIKE $1 OR datname = $2",
            f"mf_test_{name[-12:]}_%",
            name,
        )
        for row in rows:
            await admin.execute(f'DROP DATABASE IF EXISTS "{row["datname"]}" WITH (FORCE)')
        await admin.close()


@pytest.fixture
async def database_dsn(pg_server_dsn: str, template_database: str) -> AsyncIterator[str]:
    """A fresh, migrated database for one test."""
    name = f"mf_test_{template_database[-12:]}_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(pg_server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"')
        yield dsn_for_database(pg_server_dsn, name)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture
async def empty_database(pg_server_dsn: str) -> AsyncIterator[str]:
    """A database with nothing in it, not even the schema."""
    name = f"mf_empty_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(pg_server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield dsn_for_database(pg_server_dsn, name)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture
async def pool(database_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await create_pool(database_dsn, min_size=1, max_size=10)
    try:
        yield p
    finally:
        await p.close()


@pytest.fixture
async def store(pool: asyncpg.Pool) -> EventStore:
    return EventStore(pool, ALL_PROJECTIONS)


# --- the HTTP API over a real database and a fake NVML -------------------------------------------

OPERATOR_TOKEN = "test-operator-token"


class ApiHarness:
    """An app on a fresh database, refreshing 'this host' through the real collectors with the
    fake NVML at the pynvml boundary."""

    def __init__(
        self,
        client: object,
        nvml: object,
        scenario: object,
        pool: asyncpg.Pool,
        config: object,
        context: object = None,
    ) -> None:
        self.client = client
        self.context = context  # the app's AppContext
        self.nvml = nvml
        self.scenario = scenario
        self.pool = pool
        self.config = config
        self.auth = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}

    async def get(self, path: str, **kw: object):  # type: ignore[no-untyped-def]
        if path.startswith("/api/v1/hardware/events"):
            await self.settle()
        return await self.client.get(path, headers=self.auth, **kw)  # type: ignore[attr-defined]

    async def settle(self, within_seconds: float = 60) -> None:
        """Wait until every event written so far is below the cluster's xmin horizon, i.e. readable
        by the gap-safe read. Another session's open transaction on the same PostgreSQL (a parallel
        suite, a server still shutting down) holds the horizon back for a while; the log then
        delays, never loses, and a test that reads it right after a write must wait the same way."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_seconds
        async with self.pool.acquire() as conn:
            while await conn.fetchval(
                "SELECT coalesce(max(events.tx_id) >= pg_snapshot_xmin(pg_current_snapshot()), false) "
                "FROM events"
            ):
                assert loop.time() < deadline, "the xmin horizon never passed the newest event"
                await asyncio.sleep(0.05)

    async def post(self, path: str, **kw: object):  # type: ignore[no-untyped-def]
        return await self.client.post(path, headers=self.auth, **kw)  # type: ignore[attr-defined]

    async def refresh(self) -> dict:  # type: ignore[type-arg]
        r = await self.post("/api/v1/hardware/refresh")
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    async def lifecycle_types(self) -> list[str]:
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                "SELECT event_type FROM events WHERE event_class = 'lifecycle' ORDER BY global_position"
            )
        return [r["event_type"] for r in rows]


@pytest.fixture
def make_api(pool: asyncpg.Pool, tmp_path: Path):  # type: ignore[no-untyped-def]
    import httpx

    from api.config import ServerConfig
    from api.http.app import create_app
    from api.http.context import AppContext
    from api.services.reads.repository import HardwareRepository
    from api.wiring import build_service
    from runtime.secrets import digest
    from tests.fakes.fake_pynvml import FakeNvml
    from tests.fixtures_nvml import multi_gpu_scenario

    clients: list[httpx.AsyncClient] = []

    def make(scenario: object = None, node_id: str = "test-node-1") -> ApiHarness:
        sc = scenario if scenario is not None else multi_gpu_scenario(2)
        nvml = FakeNvml(sc)  # type: ignore[arg-type]
        config = ServerConfig(state_dir=tmp_path / "state", node_id=node_id, collector_timeout=5.0)
        service = build_service(pool, config, nvml=nvml)
        context = AppContext(
            pool=pool,
            service=service,
            repository=HardwareRepository(pool),
            admin_token_hash=digest(OPERATOR_TOKEN),
        )
        app = create_app(context)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        clients.append(client)
        return ApiHarness(client, nvml, sc, pool, config, context)

    yield make
