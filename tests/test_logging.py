"""One log stream: with logs going to a file (not a TTY), every line the server
writes is one JSON object: our events, uvicorn's, pgserver's. No `pg_ctl`
command lines, no XDG_RUNTIME_DIR warning on a CLI command."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import structlog

from runtime.logs import QUIET_LOGGERS, configure_logging
from tests.test_serve import free_port, stop, wait_healthy


def json_lines(text: str) -> list[dict]:  # type: ignore[type-arg]
    lines = [line for line in text.splitlines() if line.strip()]
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError as exc:
            raise AssertionError(f"not a JSON log line: {line!r}\nwhole log:\n{text}") from exc
    return out


def env_without_runtime_dir(state: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_") and k != "XDG_RUNTIME_DIR"}
    env.update(MODELFORGE_STATE_DIR=str(state), MODELFORGE_ADMIN_TOKEN="log-test", PYTHONUNBUFFERED="1")
    return env


def migrate(state: Path) -> subprocess.CompletedProcess[str]:
    """`modelforge-hw migrate` on the state directory's embedded PostgreSQL, as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "api.cli", "migrate"],
        env=env_without_runtime_dir(state),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # Outside pytest's base temp dir: as root, pgserver runs PostgreSQL as user `pgserver`, which
    # must traverse the path, and a pytest session started meanwhile (another checkout on this
    # machine) resets /tmp/pytest-of-<user> to mode 0700.
    path = Path(tempfile.mkdtemp(prefix="mf-log-test-"))
    try:
        yield path / "state"
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_server_and_cli_write_one_json_stream(tmp_path: Path, state_dir: Path) -> None:
    state = state_dir
    port = free_port()
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    proc = subprocess.Popen(
        [sys.executable, "-m", "api.cli", "serve", "--port", str(port), "--no-startup-refresh"],
        env=env_without_runtime_dir(state),
        stdout=out.open("wb"),
        stderr=err.open("wb"),
        start_new_session=True,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, err)
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": "Bearer log-test"})
        assert r.status_code == 200
    finally:
        assert stop(proc) == 0, err.read_text()
    events = json_lines(err.read_text())
    names = [e["event"] for e in events]
    assert "embedded_postgres.started" in names and "server.starting" in names
    uvicorn = [e for e in events if e.get("logger", "").startswith("uvicorn")]
    assert any("Uvicorn running" in e["event"] for e in uvicorn), names
    assert all({"level", "timestamp"} <= set(e) for e in events)
    text = err.read_text() + out.read_text()
    assert "Running commandline" not in text and "Successful postgres command" not in text
    assert not [e for e in events if e.get("logger") == "pgserver" and e["level"] == "info"]
    assert "XDG_RUNTIME_DIR" not in text

    done = migrate(state)
    assert done.returncode == 0, done.stderr
    assert "XDG_RUNTIME_DIR" not in done.stderr
    assert [e["event"] for e in json_lines(done.stderr)] == [
        "embedded_postgres.started",
        "embedded_postgres.stopped",
    ]


def test_a_command_beside_a_running_embedded_postgres_says_it_left_it_running(state_dir: Path) -> None:
    from ledger.db import EmbeddedPostgres
    from runtime.supervisor import postmaster_running

    held = EmbeddedPostgres(state_dir)  # as the server holds it
    held.start()
    try:
        done = migrate(state_dir)
        assert done.returncode == 0, done.stderr
        # not "started" then "stopped": PostgreSQL runs on for the process that started it
        events = [e["event"] for e in json_lines(done.stderr)]
        assert (events[0], events[-1]) == ("embedded_postgres.joined", "embedded_postgres.released"), events
        assert "embedded_postgres.stopped" not in events
        assert postmaster_running(held.data_dir)
    finally:
        held.stop()
    assert not postmaster_running(held.data_dir)


def test_foreign_loggers_and_warnings_render_like_our_events() -> None:
    stream = io.StringIO()
    saved_config, root = structlog.get_config(), logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    saved_levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    configure_logging(level="INFO", json=True, stream=stream)
    try:
        structlog.get_logger("ours").info("ours.event", node_id="n1", token="s3cret")
        logging.getLogger("uvicorn.error").info("Uvicorn running on %s", "http://x")
        logging.getLogger("pgserver").info("Running commandline: pg_ctl start")
        logging.getLogger("pgserver").error("Failed postgres command")
    finally:
        # the logging setup is process-wide: give the other tests theirs back
        logging.captureWarnings(False)
        structlog.configure(**saved_config)
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        for name, level in saved_levels.items():
            logging.getLogger(name).setLevel(level)
    events = json_lines(stream.getvalue())
    assert [e["event"] for e in events][:2] == ["ours.event", "Uvicorn running on http://x"]
    assert events[0]["token"] == "[redacted]"
    assert events[1]["logger"] == "uvicorn.error" and events[1]["level"] == "info"
    assert not any("pg_ctl" in e["event"] for e in events), "pgserver's INFO narration is held back"
    assert any(e["event"] == "Failed postgres command" and e["level"] == "error" for e in events)
