"""Server configuration: flags override `MODELFORGE_*` environment variables override defaults.

Every option is declared once, in `runtime.settings.SETTINGS` (re-exported here), which also gives
the flags, the agent's defaults and the configuration reference in docs/ (tests fail when that
page drifts from the model).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from collectors.statefiles import write_private
from ledger.db import default_state_dir
from runtime.secrets import digest, mint_unnamed
from runtime.settings import SETTINGS, Setting, SettingError, default, from_env

# The one configuration model: declared in runtime/settings.py (the agent reads it too).
__all__ = ["SETTINGS", "ServerConfig", "Setting", "SettingError"]


def _d(name: str) -> Any:
    return default(name)


class ServerConfig(msgspec.Struct, kw_only=True):
    database_url: str | None = _d("database_url")
    read_database_url: str | None = _d("read_database_url")
    state_dir: Path = msgspec.field(default_factory=default_state_dir)
    node_id: str | None = _d("node_id")
    admin_token: str | None = _d("admin_token")
    host: str = _d("host")
    port: int = _d("port")
    startup_refresh: bool = _d("startup_refresh")
    collector_timeout: float = _d("collector_timeout")
    stale_after: float = _d("stale_after")
    offline_after: float = _d("offline_after")
    retention_hours: float = _d("retention_hours")
    retention_interval: float = _d("retention_interval")
    telemetry_hours_interval: float = _d("telemetry_hours_interval")
    rendered_reads_mib: int = _d("rendered_reads_mib")
    state_cache_streams: int = _d("state_cache_streams")
    report_transactions: int = _d("report_transactions")
    log_level: str = _d("log_level")
    webhook_source: str = _d("webhook_source")
    webhook_max_attempts: int = _d("webhook_max_attempts")
    webhook_backoff_initial: float = _d("webhook_backoff_initial")
    webhook_backoff_max: float = _d("webhook_backoff_max")
    webhook_timeout: float = _d("webhook_timeout")
    webhook_allow_private: bool = _d("webhook_allow_private")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ServerConfig:
        """Every field from its variable, else its default; a bad value raises SettingError."""
        values: dict[str, Any] = {}
        for field in msgspec.structs.fields(cls):
            value = from_env(field.name, env)
            if value is not None:
                values[field.name] = value
        return cls(**values)


def load_or_create_admin_token(config: ServerConfig) -> tuple[str, Path | None]:
    """The operator token: configured, else read from (or created once in) the state directory
    with mode 0600. Returns the token's hash and the file path when one is used."""
    if config.admin_token:
        return digest(config.admin_token), None
    path = config.state_dir / "admin-token"
    if path.exists():
        return digest(path.read_text(encoding="utf-8").strip()), path
    token = mint_unnamed("mfop")
    write_private(path, (token + "\n").encode("utf-8"))
    return digest(token), path
