"""Server configuration: flags override `MODELFORGE_*` environment variables override defaults.

Every setting is declared once in `SETTINGS`, which also renders the configuration reference in
docs/ (tests fail when that page drifts from this table).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

import msgspec

from collectors.statefiles import write_private
from ledger.db import default_state_dir


class Setting(msgspec.Struct, frozen=True):
    env: str
    flag: str | None
    default: str
    help: str


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "MODELFORGE_DATABASE_URL",
        "--database-url",
        "(embedded PostgreSQL in the state directory)",
        "PostgreSQL URL of the ledger. Absent: a real PostgreSQL is started in the state directory.",
    ),
    Setting(
        "MODELFORGE_STATE_DIR",
        "--state-dir",
        "~/.local/state/modelforge",
        "Directory for the embedded database, the admin token file and the node identity.",
    ),
    Setting(
        "MODELFORGE_NODE_ID",
        "--node-id",
        "(derived: state file in containers, else machine ID)",
        "Explicit identity key of this host as a compute node; highest priority.",
    ),
    Setting(
        "MODELFORGE_ADMIN_TOKEN",
        None,
        "(generated at first start into <state dir>/admin-token)",
        "Operator bearer token for the HTTP API.",
    ),
    Setting("MODELFORGE_HOST", "--host", "127.0.0.1", "Address the API server listens on."),
    Setting("MODELFORGE_PORT", "--port", "8080", "Port the API server listens on."),
    Setting(
        "MODELFORGE_STARTUP_REFRESH",
        "--startup-refresh/--no-startup-refresh",
        "false",
        "Refresh the local host's inventory once at start (the API host is not implicitly a node).",
    ),
    Setting(
        "MODELFORGE_COLLECTOR_TIMEOUT",
        "--collector-timeout",
        "10",
        "Seconds a collector may take per refresh before its facts become temporarily_failed.",
    ),
    Setting(
        "MODELFORGE_STALE_AFTER",
        "--stale-after",
        "60",
        "Seconds without a received report after which an agent node is `stale`.",
    ),
    Setting(
        "MODELFORGE_OFFLINE_AFTER",
        "--offline-after",
        "300",
        "Seconds without a received report after which an agent node is `offline`.",
    ),
    Setting(
        "MODELFORGE_RETENTION_HOURS",
        "--retention-hours",
        "24",
        "Observation events (telemetry) older than this are pruned; the newest per node and GPU stays.",
    ),
    Setting(
        "MODELFORGE_RETENTION_INTERVAL",
        "--retention-interval",
        "300",
        "Seconds between the server's background retention passes (0 disables them).",
    ),
    Setting("MODELFORGE_LOG_LEVEL", "--log-level", "INFO", "structlog level."),
    # The agent (`modelforge-hw agent enroll|run`).
    Setting(
        "MODELFORGE_SERVER_URL",
        "--server",
        "(required)",
        "Agent: central API base URL; comma-separate or repeat --server for failover.",
    ),
    Setting(
        "MODELFORGE_ENROLLMENT_TOKEN",
        "--token",
        "(none; prefer --token-file)",
        "Agent: the one-time enrollment token exchanged for a node credential.",
    ),
    Setting(
        "MODELFORGE_CA_FILE",
        "--ca-file",
        "(system trust store)",
        "Agent: PEM bundle to trust for the server's TLS certificate.",
    ),
    Setting("MODELFORGE_AGENT_INTERVAL", "--interval", "10", "Agent: seconds between reports."),
    Setting(
        "MODELFORGE_AGENT_INVENTORY_EVERY",
        "--inventory-every",
        "30",
        "Agent: an inventory report at least every N reports (telemetry in between).",
    ),
    Setting(
        "MODELFORGE_AGENT_SPOOL_MAX",
        "--spool-max",
        "1000",
        "Agent: reports kept in the durable spool while the server is unreachable.",
    ),
    Setting(
        "MODELFORGE_AGENT_BACKOFF_INITIAL",
        "--backoff-initial",
        "1",
        "Agent: first retry delay in seconds (exponential, with jitter).",
    ),
    Setting("MODELFORGE_AGENT_BACKOFF_MAX", "--backoff-max", "60", "Agent: longest retry delay in seconds."),
    Setting(
        "MODELFORGE_AGENT_REQUEST_TIMEOUT",
        "--request-timeout",
        "10",
        "Agent: seconds one HTTP request to the server may take.",
    ),
    Setting(
        "MODELFORGE_AGENT_QUARANTINE_AFTER",
        "--quarantine-after",
        "5",
        "Agent: quarantine a report answered HTTP 500 this many times in a row (502-504 never count).",
    ),
    Setting("MODELFORGE_LOG_JSON", None, "(JSON when stderr is not a TTY)", "Force JSON logs: 1 or 0."),
)


class ServerConfig(msgspec.Struct, kw_only=True):
    database_url: str | None = None
    state_dir: Path = msgspec.field(default_factory=default_state_dir)
    node_id: str | None = None
    admin_token: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    startup_refresh: bool = False
    collector_timeout: float = 10.0
    stale_after: float = 60.0
    offline_after: float = 300.0
    retention_hours: float = 24.0
    retention_interval: float = 300.0
    log_level: str = "INFO"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ServerConfig:
        e = os.environ if env is None else env
        state_dir = (
            Path(e["MODELFORGE_STATE_DIR"]).expanduser()
            if e.get("MODELFORGE_STATE_DIR")
            else default_state_dir()
        )
        return cls(
            database_url=e.get("MODELFORGE_DATABASE_URL") or None,
            state_dir=state_dir,
            node_id=e.get("MODELFORGE_NODE_ID") or None,
            admin_token=e.get("MODELFORGE_ADMIN_TOKEN") or None,
            host=e.get("MODELFORGE_HOST", "127.0.0.1"),
            port=int(e.get("MODELFORGE_PORT", "8080")),
            startup_refresh=e.get("MODELFORGE_STARTUP_REFRESH", "false").lower() in ("1", "true", "yes"),
            collector_timeout=float(e.get("MODELFORGE_COLLECTOR_TIMEOUT", "10")),
            stale_after=float(e.get("MODELFORGE_STALE_AFTER", "60")),
            offline_after=float(e.get("MODELFORGE_OFFLINE_AFTER", "300")),
            retention_hours=float(e.get("MODELFORGE_RETENTION_HOURS", "24")),
            retention_interval=float(e.get("MODELFORGE_RETENTION_INTERVAL", "300")),
            log_level=e.get("MODELFORGE_LOG_LEVEL", "INFO"),
        )


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def tokens_match(presented: str, expected_hash: str) -> bool:
    """Constant-time comparison of a presented token with a stored hash."""
    return hmac.compare_digest(token_hash(presented), expected_hash)


def load_or_create_admin_token(config: ServerConfig) -> tuple[str, Path | None]:
    """The operator token: configured, else read from (or created once in) the state directory
    with mode 0600. Returns the token's hash and the file path when one is used."""
    if config.admin_token:
        return token_hash(config.admin_token), None
    path = config.state_dir / "admin-token"
    if path.exists():
        return token_hash(path.read_text(encoding="utf-8").strip()), path
    token = "mfop_" + secrets.token_urlsafe(32)
    write_private(path, (token + "\n").encode("utf-8"))
    return token_hash(token), path
