"""schema.sql and its parts: the functions and triggers live one per file under ledger/sql/, each
included once by schema.sql, and schema.sql alone (as psql would run it) makes the schema that
`migrate` gives a new database, at the latest version."""

from __future__ import annotations

import asyncio
import re
import subprocess
from pathlib import Path

import asyncpg
import pytest

from ledger.schema import LATEST_SCHEMA_VERSION, code_sql, schema_sql
from tests import debian
from tests.schema_catalog import catalog

ROOT = Path(__file__).resolve().parent.parent
LEDGER = ROOT / "ledger"
# psql's include relative to the including file, read here independently of ledger/schema.py.
INCLUDE = re.compile(r"^\\ir (\S+)$", re.MULTILINE)
STATEMENT = re.compile(r"^(CREATE|ALTER|DROP|DO|INSERT|UPDATE|DELETE|COMMENT|GRANT)\b.*$", re.MULTILINE)


def schema_text() -> str:
    return (LEDGER / "schema.sql").read_text(encoding="utf-8")


def included() -> list[str]:
    return INCLUDE.findall(schema_text())


def expanded() -> str:
    return INCLUDE.sub(
        lambda m: (LEDGER / m.group(1)).read_text(encoding="utf-8").rstrip("\n"), schema_text()
    )


def test_the_package_schema_is_the_repository_schema() -> None:
    # The package ships ledger/schema.sql; the repository shows it at its root.
    assert (LEDGER / "schema.sql").read_bytes() == (ROOT / "schema.sql").read_bytes()


def test_every_file_under_ledger_sql_is_included_once_and_nothing_else() -> None:
    files = sorted(p.relative_to(LEDGER).as_posix() for p in (LEDGER / "sql").rglob("*") if p.is_file())
    assert all(f.endswith(".sql") for f in files), files
    assert sorted(included()) == files
    assert len(set(included())) == len(included())
    # every trigger after every function: a trigger names its function
    kinds = [path.split("/")[1] for path in included()]
    assert kinds == sorted(kinds, key=lambda k: k == "triggers")


@pytest.mark.parametrize(
    "path", sorted(p.relative_to(LEDGER).as_posix() for p in (LEDGER / "sql").rglob("*.sql"))
)
def test_each_file_holds_one_object_named_as_the_file(path: str) -> None:
    text = (LEDGER / path).read_text(encoding="utf-8")
    kind, name = path.split("/")[1], Path(path).stem
    statements = STATEMENT.findall(text)
    if kind == "functions":
        # overloads of one function (another argument list) count as that function
        assert set(re.findall(r"^CREATE OR REPLACE FUNCTION (\w+)\(", text, re.MULTILINE)) == {name}
        assert statements and set(statements) == {"CREATE"}, statements
        assert len(statements) == len(re.findall(r"^CREATE OR REPLACE FUNCTION ", text, re.MULTILINE))
    else:
        assert kind == "triggers", path
        assert re.findall(r"^CREATE OR REPLACE TRIGGER (\w+)$", text, re.MULTILINE) == [name]
        assert statements == ["CREATE"], statements


def test_schema_sql_records_the_latest_version() -> None:
    text = schema_text()
    assert f"schema version {LATEST_SCHEMA_VERSION}," in text.splitlines()[0]
    assert f"INSERT INTO schema_version (version) SELECT generate_series(1, {LATEST_SCHEMA_VERSION});" in text


def test_migrate_runs_what_schema_sql_includes() -> None:
    assert schema_sql() == expanded()
    # every migrate installs the functions and triggers again, in schema.sql's order
    assert code_sql() == "\n\n".join((LEDGER / path).read_text(encoding="utf-8") for path in included())


async def test_schema_sql_alone_makes_the_schema_of_a_new_database(
    empty_database: str, database_dsn: str
) -> None:
    made = await asyncpg.connect(empty_database)
    migrated = await asyncpg.connect(database_dsn)
    try:
        await made.execute(expanded())
        assert [r[0] for r in await made.fetch("SELECT version FROM schema_version ORDER BY 1")] == list(
            range(1, LATEST_SCHEMA_VERSION + 1)
        )
        assert await catalog(made) == await catalog(migrated)
    finally:
        await made.close()
        await migrated.close()


async def test_psql_runs_the_package_schema_as_it_is(empty_database: str, database_dsn: str) -> None:
    debian.require("psql", "postgresql-client")
    done = await asyncio.to_thread(
        subprocess.run,
        ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-f", "ledger/schema.sql", empty_database],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    made = await asyncpg.connect(empty_database)
    migrated = await asyncpg.connect(database_dsn)
    try:
        assert await catalog(made) == await catalog(migrated)
    finally:
        await made.close()
        await migrated.close()
