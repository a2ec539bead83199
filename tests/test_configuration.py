"""The one configuration model (runtime/settings.py): one default, one variable, one flag per option;
a bad value is one line naming the variable and what it accepts; server, CLI and agent agree."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.config import AgentConfig
from api.config import ServerConfig
from runtime.settings import ACCEPTS, SETTINGS, SettingError, parse, setting
from tests.test_cli import cli


def test_a_bad_port_variable_is_one_line_naming_it() -> None:
    r = cli("serve", env_extra={"MODELFORGE_PORT": "abc"})
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "modelforge-hw: MODELFORGE_PORT='abc' is not a whole number from 1 to 65535"
    ]


def test_a_bad_flag_names_the_flag() -> None:
    r = cli("serve", "--port", "70000")
    assert r.returncode == 2 and "--port" in r.stderr and "1 to 65535" in r.stderr


def test_a_bad_agent_variable_names_it() -> None:
    r = cli("agent", "run", "--once", env_extra={"MODELFORGE_AGENT_INTERVAL": "soon"})
    assert r.returncode == 2 and "MODELFORGE_AGENT_INTERVAL='soon'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_retention_run_prunes_at_the_configured_hours(database_dsn: str, tmp_path: Path) -> None:
    env = {"MODELFORGE_RETENTION_HOURS": "168", "MODELFORGE_STATE_DIR": str(tmp_path)}
    before = datetime.now(UTC)
    r = cli("retention", "run", "--json", "--database-url", database_dsn, env_extra=env)
    assert r.returncode == 0, r.stderr
    cutoff = datetime.fromisoformat(json.loads(r.stdout)["cutoff"])
    assert before - timedelta(hours=168, minutes=5) < cutoff <= datetime.now(UTC) - timedelta(hours=168)
    # The flag wins over the variable.
    r = cli(
        "retention", "run", "--json", "--retention-hours", "2", "--database-url", database_dsn, env_extra=env
    )
    cutoff = datetime.fromisoformat(json.loads(r.stdout)["cutoff"])
    assert cutoff > datetime.now(UTC) - timedelta(hours=2, minutes=5)


def test_server_and_agent_defaults_are_the_model_s() -> None:
    server = ServerConfig()
    for name in ("host", "port", "collector_timeout", "stale_after", "retention_hours", "retention_interval"):
        assert getattr(server, name) == setting(name).value, name
    agent = AgentConfig(state_dir=Path("/nonexistent"))
    for field, name in (
        ("interval", "agent_interval"),
        ("inventory_every", "agent_inventory_every"),
        ("spool_max", "agent_spool_max"),
        ("backoff_initial", "agent_backoff_initial"),
        ("backoff_max", "agent_backoff_max"),
        ("request_timeout", "agent_request_timeout"),
        ("collector_timeout", "collector_timeout"),
        ("quarantine_after", "agent_quarantine_after"),
    ):
        assert getattr(agent, field) == setting(name).value, field


def test_server_config_reads_every_variable_once() -> None:
    config = ServerConfig.from_env(
        {"MODELFORGE_PORT": "9090", "MODELFORGE_STARTUP_REFRESH": "yes", "MODELFORGE_RETENTION_HOURS": "168"}
    )
    assert (config.port, config.startup_refresh, config.retention_hours) == (9090, True, 168.0)
    assert ServerConfig.from_env({"MODELFORGE_PORT": ""}).port == 8080  # empty counts as unset


def test_every_option_has_one_variable_and_a_documented_default() -> None:
    envs = [s.env for s in SETTINGS]
    assert len(envs) == len(set(envs))
    for s in SETTINGS:
        assert s.default and s.help and s.kind in ACCEPTS, s.name
        if s.value is not None and s.kind != "text":
            assert parse(s, s.default) == s.value, f"{s.env}: the shown default does not parse back"


@given(st.sampled_from([s for s in SETTINGS if s.kind not in ("text", "path")]), st.text(max_size=12))
def test_a_value_is_accepted_or_refused_with_its_variable(s: object, text: str) -> None:
    from runtime.settings import Setting

    assert isinstance(s, Setting)
    try:
        parse(s, text)
    except SettingError as exc:
        assert str(exc).startswith(f"{s.env}=") and s.accepts in str(exc)


def test_refused_values() -> None:
    with pytest.raises(SettingError, match="MODELFORGE_STALE_AFTER"):
        parse(setting("stale_after"), "-1")
    with pytest.raises(SettingError, match="MODELFORGE_AGENT_SPOOL_MAX"):
        parse(setting("agent_spool_max"), "0")
    with pytest.raises(SettingError, match="MODELFORGE_COLLECTOR_TIMEOUT"):
        parse(setting("collector_timeout"), "nan")
