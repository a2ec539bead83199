"""The database schema: a new database is made from schema.sql, an older one is brought to it.

schema.sql is the schema of this release whole, at version `LATEST_SCHEMA_VERSION`. Its functions
and triggers are one per file under ledger/sql/, included by psql's `\\ir` lines in a fixed order;
`schema_sql` expands them, so the text run is what `psql -f ledger/schema.sql` runs.

`migrate` creates a new database from that text in one transaction. A database made by an older
release gets the numbered steps of ledger/migrations/ it has not recorded, each in its own
transaction with its row in `schema_version`. Then every migrate installs the functions and
triggers again (`code_sql`, the included files in schema.sql's order), so a release's new
function bodies reach an existing database without a step.
"""

from __future__ import annotations

import re
from importlib import resources
from importlib.resources.abc import Traversable

import asyncpg
import msgspec
import structlog

from ledger.segments import ensure_segments

log = structlog.get_logger(__name__)

_MIGRATE_LOCK_KEY = 7305820112
# psql's include relative to the including file: the one form of include schema.sql uses.
_INCLUDE = re.compile(r"^\\ir (\S+)$", re.MULTILINE)
# Where the files that every migrate installs again live (functions, then triggers).
_CODE_FOLDER = "sql/"
_STEP_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


def _package() -> Traversable:
    return resources.files("ledger")


def _read(relative: str) -> str:
    node = _package()
    for part in relative.split("/"):
        node = node.joinpath(part)
    return node.read_text(encoding="utf-8")


def schema_text() -> str:
    """schema.sql as written, its `\\ir` lines as they are."""
    return _read("schema.sql")


def included_files() -> list[str]:
    """The files schema.sql includes, relative to ledger/, in its order."""
    return _INCLUDE.findall(schema_text())


def schema_sql() -> str:
    """What a new database is made from: schema.sql with every `\\ir` line replaced by its file."""
    return _INCLUDE.sub(lambda m: _read(m.group(1)).rstrip("\n"), schema_text())


def code_sql() -> str:
    """The functions and triggers, in schema.sql's order: what every migrate installs again."""
    return "\n\n".join(_read(path) for path in included_files() if path.startswith(_CODE_FOLDER))


class MigrationStep(msgspec.Struct, frozen=True):
    version: int
    name: str
    sql: str


def migration_steps() -> list[MigrationStep]:
    """The numbered steps in ledger/migrations/, in order. Step N brings a database at version N-1
    to version N; a new database gets none of them (schema.sql is the latest version already)."""
    steps = []
    for entry in _package().joinpath("migrations").iterdir():
        m = _STEP_NAME.match(entry.name)
        if m:
            steps.append(MigrationStep(int(m.group(1)), m.group(2), entry.read_text(encoding="utf-8")))
    steps.sort(key=lambda s: s.version)
    numbers = [s.version for s in steps]
    if numbers != list(range(2, 2 + len(steps))):
        raise RuntimeError(f"migration steps must be numbered 0002, 0003, ... without gaps: {numbers}")
    return steps


LATEST_SCHEMA_VERSION = 1 + len(migration_steps())


async def migrate(conn: asyncpg.Connection) -> int:
    """Bring the database to the latest schema under a session lock, so two servers starting
    together do not race. Idempotent: on a database at the latest version it only installs the
    functions and triggers again. Returns the schema version now recorded.

    A hot standby (read-only, in recovery) is never written: it has its primary's schema, which
    must be this release's (the read commands, `replay`, run against a standby)."""
    if await conn.fetchval("SELECT pg_is_in_recovery()"):
        return await _standby_version(conn)
    await conn.execute("SELECT pg_advisory_lock($1)", _MIGRATE_LOCK_KEY)
    try:
        # Quiet the NOTICEs of statements that find nothing to do (DROP ... IF EXISTS).
        await conn.execute("SET client_min_messages = warning")
        if await conn.fetchval("SELECT to_regclass('schema_version') IS NULL"):
            current = await _create(conn)
        else:
            current = await _upgrade(conn)
        await conn.execute("RESET client_min_messages")
        # The log's day segments, ahead of the appends that will land on them.
        today = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
        await ensure_segments(conn, today)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _MIGRATE_LOCK_KEY)
    return current


async def _standby_version(conn: asyncpg.Connection) -> int:
    recorded = None
    if await conn.fetchval("SELECT to_regclass('schema_version') IS NOT NULL"):
        recorded = await conn.fetchval("SELECT max(version) FROM schema_version")
    if recorded != LATEST_SCHEMA_VERSION:
        raise RuntimeError(
            f"this database is a hot standby at schema version {recorded}, and a standby cannot be "
            f"migrated: run `modelforge-hw migrate` against its primary (this release's schema "
            f"version is {LATEST_SCHEMA_VERSION})"
        )
    log.info("schema.standby", version=recorded)
    return LATEST_SCHEMA_VERSION


async def _create(conn: asyncpg.Connection) -> int:
    async with conn.transaction():
        await conn.execute(schema_sql())
        versions = [r[0] for r in await conn.fetch("SELECT version FROM schema_version ORDER BY 1")]
        if versions != list(range(1, LATEST_SCHEMA_VERSION + 1)):
            raise RuntimeError(
                f"schema.sql records versions {versions}, but the release's steps reach version "
                f"{LATEST_SCHEMA_VERSION}: schema.sql and ledger/migrations/ disagree"
            )
    log.info("schema.created", version=LATEST_SCHEMA_VERSION)
    return LATEST_SCHEMA_VERSION


async def _upgrade(conn: asyncpg.Connection) -> int:
    recorded = await conn.fetchval("SELECT max(version) FROM schema_version")
    if recorded is None:
        raise RuntimeError("schema_version records no version: not a database `migrate` made")
    current = int(recorded)
    if current > LATEST_SCHEMA_VERSION:
        raise RuntimeError(
            f"the database is at schema version {current}, newer than this release knows "
            f"({LATEST_SCHEMA_VERSION}): upgrade modelforge-hardware"
        )
    for step in migration_steps():
        if step.version <= current:
            continue
        async with conn.transaction():
            await conn.execute(step.sql)
            await conn.execute("INSERT INTO schema_version (version) VALUES ($1)", step.version)
        log.info("schema.migrated", version=step.version, step=step.name)
        current = step.version
    async with conn.transaction():
        await conn.execute(code_sql())
    return current
