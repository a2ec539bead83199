"""The operator CLI against a real database: migrate, refresh --json, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ledger.schema import LATEST_SCHEMA_VERSION


def cli(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_migrate_twice_and_refresh_json(database_dsn: str, tmp_path: Path) -> None:
    for _ in range(2):
        r = cli("migrate", "--database-url", database_dsn)
        assert r.returncode == 0, r.stderr
        assert f"schema is at version {LATEST_SCHEMA_VERSION}" in r.stdout
    env = {"MODELFORGE_NODE_ID": "cli-node", "MODELFORGE_STATE_DIR": str(tmp_path)}
    r = cli("refresh", "--json", "--database-url", database_dsn, env_extra=env)
    assert r.returncode == 0, r.stderr
    outcome = json.loads(r.stdout)
    assert outcome["outcome"] == "succeeded"
    types = [e["event_type"] for e in outcome["events"]]
    assert types[0] == "NODE_DISCOVERED" and "NODE_TELEMETRY_OBSERVED" in types
    # this machine has no NVIDIA driver: NVML is unavailable, the inventory is degraded, not failed
    assert outcome["nvml_status"] == "unavailable" and outcome["inventory_status"] == "degraded"
    again = json.loads(cli("refresh", "--json", "--database-url", database_dsn, env_extra=env).stdout)
    assert again["node_id"] == outcome["node_id"]
    assert all(e["event_class"] == "observation" for e in again["events"])


def test_errors_are_one_line_with_a_hint() -> None:
    r = cli("migrate", "--database-url", "postgresql://nobody@127.0.0.1:1/nothing")
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.startswith("modelforge-hw:")]
    assert len(lines) == 1 and "MODELFORGE_DATABASE_URL" in lines[0]
    assert "Traceback" not in r.stderr


def test_version() -> None:
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("modelforge-hw ")


def test_one_node_flag_everywhere_accepts_a_prefix_or_a_hostname(database_dsn: str, tmp_path: Path) -> None:
    import socket

    env = {"MODELFORGE_NODE_ID": "cli-node", "MODELFORGE_STATE_DIR": str(tmp_path)}
    node_id = json.loads(cli("refresh", "--json", "--database-url", database_dsn, env_extra=env).stdout)[
        "node_id"
    ]
    hostname = socket.gethostname()
    db = ("--database-url", database_dsn)
    for ref in (node_id[:8], hostname, "cli-node"):
        r = cli("lease", "list", ref, *db, env_extra=env)
        assert r.returncode == 0 and f"node {node_id} holds no work lease" in r.stdout, (ref, r.stderr)
        r = cli("lease", "list", "--node", ref, *db, env_extra=env)
        assert r.returncode == 0 and node_id in r.stdout, (ref, r.stderr)
    r = cli("decommission", "preview", "--node", node_id[:8], "--json", *db, env_extra=env)
    assert r.returncode == 0 and json.loads(r.stdout)["node_id"] == node_id
    replay = cli("replay", "--node", hostname, "--since", "1h", "--format", "jsonl", *db, env_extra=env)
    assert replay.returncode == 0 and {json.loads(x)["node_id"] for x in replay.stdout.splitlines()} == {
        node_id
    }
    unknown = cli("lease", "list", "--node", "nope-host", *db, env_extra=env)
    assert unknown.returncode == 5 and "nope-host" in unknown.stderr
    missing = cli("lease", "list", *db, env_extra=env)
    assert missing.returncode == 2 and "--node" in missing.stderr


def test_lists_have_headers_and_say_when_empty(database_dsn: str, tmp_path: Path) -> None:
    env = {"MODELFORGE_STATE_DIR": str(tmp_path), "COLUMNS": "200"}
    db = ("--database-url", database_dsn)
    assert cli("token", "list", *db, env_extra=env).stdout.startswith("no enrollment tokens")
    assert cli("credential", "list", *db, env_extra=env).stdout == "no node credentials\n"
    assert (
        cli("token", "create", "--ttl", "1h", "--description", "rack 7", *db, env_extra=env).returncode == 0
    )
    lines = cli("token", "list", *db, env_extra=env).stdout.splitlines()
    assert lines[0].split() == ["TOKEN", "ID", "STATUS", "USES", "LEFT", "EXPIRES", "DESCRIPTION"]
    assert "1/1" in lines[1] and "rack 7" in lines[1]


def test_token_create_without_a_ttl_lives_an_hour(database_dsn: str, tmp_path: Path) -> None:
    """The documented default lifetime, not a crash on the default's own type."""
    env = {"MODELFORGE_STATE_DIR": str(tmp_path)}
    before = datetime.now(UTC)
    r = cli("token", "create", "--json", "--database-url", database_dsn, env_extra=env)
    assert r.returncode == 0, r.stderr
    expires = datetime.fromisoformat(json.loads(r.stdout)["expires_at"])
    assert timedelta(minutes=59) < expires - before < timedelta(minutes=61)


def test_every_option_default_goes_through_its_own_parser() -> None:
    """Typer passes an option's default through the option's parser too: a parser that takes
    only what an operator types (text) would crash every run that leaves the option out."""
    import typer.main

    from api.cli.main import app

    def commands(cmd: Any, path: str) -> list[tuple[str, Any]]:
        if hasattr(cmd, "commands"):  # a group
            return [c for name, sub in cmd.commands.items() for c in commands(sub, f"{path} {name}")]
        return [(path, cmd)]

    checked = 0
    for path, cmd in commands(typer.main.get_command(app), "modelforge-hw"):
        ctx = cmd.context_class(cmd)
        for param in cmd.params:
            default = param.get_default(ctx)
            if default is None:
                continue
            try:
                param.process_value(ctx, default)
            except Exception as exc:
                raise AssertionError(f"{path} {param.opts}: default {default!r}: {exc!r}") from exc
            checked += 1
    assert checked > 50
