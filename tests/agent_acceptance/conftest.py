"""The plane every acceptance test of the agent runs against: real PostgreSQL, real `modelforge-hw
serve` processes on 127.0.0.1 and real agent processes (with the fake NVML, tests/agent_wrapper.py),
each with its own state directory and MODELFORGE_NODE_ID. One server process (small liveness
thresholds) serves the whole package on one database; tests use identities of their own, so they
do not see each other's nodes."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest

from ledger.db import create_pool
from tests.agent_acceptance.plane import OFFLINE_AFTER, STALE_AFTER
from tests.agent_support import ServerProcess
from tests.conftest import dsn_for_database


@pytest.fixture(scope="package")
async def plane_dsn(pg_server_dsn: str, template_database: str) -> AsyncIterator[str]:
    name = f"mf_test_{template_database[-12:]}_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(pg_server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"')
    finally:
        await admin.close()
    yield dsn_for_database(pg_server_dsn, name)
    admin = await asyncpg.connect(pg_server_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture(scope="package")
async def db(plane_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await create_pool(plane_dsn, min_size=1, max_size=4)
    yield pool
    await pool.close()


@pytest.fixture(scope="package")
async def server(plane_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ServerProcess]:
    s = ServerProcess(
        plane_dsn, tmp_path_factory.mktemp("plane"), stale_after=STALE_AFTER, offline_after=OFFLINE_AFTER
    ).start()
    try:
        await s.wait_healthy()
        yield s
    finally:
        assert s.stop() == 0, s.log_text()[-4000:]


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=15) as client:
        yield client
