"""Test fixtures: always a real PostgreSQL.

The server is `MODELFORGE_TEST_DATABASE_URL` when set (CI sets it), else a throwaway embedded one
(`pgserver`) this session starts. Each test gets its own database cloned from a migrated template,
so tests never see each other's events.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from ledger.db import create_pool, migrate
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
async def pool(database_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await create_pool(database_dsn, min_size=1, max_size=10)
    try:
        yield p
    finally:
        await p.close()


@pytest.fixture
async def store(pool: asyncpg.Pool) -> EventStore:
    return EventStore(pool, ALL_PROJECTIONS)
