"""The one configuration model of the server, the operator CLI and the agent.

Every option is declared once in `SETTINGS`: its attribute name, its `MODELFORGE_*` variable, its
flag, its default, what it accepts and one line of help. Everything else is derived from it: the
server's `ServerConfig` defaults and environment reading (api/config.py), the command-line options
of the server, the operator CLI and the agent (runtime/options.py), the agent's defaults
(agent/runner.py) and docs/configuration.md. It lives here, in the lowest layer both the server
and the agent import.

Precedence: a flag wins over the variable, which wins over the default. A bad value is refused
with one line naming the variable (or flag) and what it accepts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec

Value = str | int | float | bool | Path | None


class SettingError(ValueError):
    """A value that does not parse: the message names the variable and what it accepts."""


class Setting(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    env: str
    flag: str | None
    # The value used when neither the flag nor the variable is given (None: absent / derived).
    value: Any
    help: str
    kind: str = "text"  # text | path | port | seconds | positive | count | mebibytes | whole | bool
    # How the docs and --help show a default that is derived at run time.
    shown: str | None = None

    @property
    def default(self) -> str:
        if self.shown is not None:
            return self.shown
        if isinstance(self.value, bool):
            return "true" if self.value else "false"
        if isinstance(self.value, float) and self.value.is_integer():
            return str(int(self.value))
        return str(self.value)

    @property
    def accepts(self) -> str:
        return ACCEPTS[self.kind]


ACCEPTS = {
    "text": "any text",
    "path": "a path",
    "port": "a whole number from 1 to 65535",
    "seconds": "a number of seconds, 0 or more",
    "positive": "a number greater than 0",
    "count": "a whole number, 1 or more",
    "mebibytes": "a whole number of MiB, 0 or more",
    "whole": "a whole number, 0 or more",
    "bool": "one of 1, 0, true, false, yes, no, on, off",
}


def _number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def _whole(text: str) -> int:
    return int(text.strip())


PARSERS: dict[str, Callable[[str], Value]] = {
    "text": lambda t: t,
    "path": lambda t: Path(t).expanduser(),
    "port": lambda t: _checked(_whole(t), 1 <= _whole(t) <= 65535),
    "seconds": lambda t: _checked(_number(t), _number(t) >= 0),
    "positive": lambda t: _checked(_number(t), _number(t) > 0),
    "count": lambda t: _checked(_whole(t), _whole(t) >= 1),
    "mebibytes": lambda t: _checked(_whole(t), _whole(t) >= 0),
    "whole": lambda t: _checked(_whole(t), _whole(t) >= 0),
    "bool": lambda t: _boolean(t),
}


def _checked(value: Value, ok: bool) -> Value:
    if not ok:
        raise ValueError(value)
    return value


def _boolean(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


SETTINGS: tuple[Setting, ...] = (
    Setting(
        name="database_url",
        env="MODELFORGE_DATABASE_URL",
        flag="--database-url",
        value=None,
        shown="(embedded PostgreSQL in the state directory)",
        help="PostgreSQL URL of the ledger. Absent: a real PostgreSQL is started in the state directory.",
    ),
    Setting(
        name="read_database_url",
        env="MODELFORGE_READ_DATABASE_URL",
        flag="--read-database-url",
        value=None,
        shown="(none: every read on the primary)",
        help=(
            "PostgreSQL URL of a hot standby that serves the server's reads (nodes, accelerators, "
            "events, the change feed); writes stay on MODELFORGE_DATABASE_URL."
        ),
    ),
    Setting(
        name="state_dir",
        env="MODELFORGE_STATE_DIR",
        flag="--state-dir",
        value=None,
        kind="path",
        shown="~/.local/state/modelforge",
        help="Directory for the embedded database, the admin token file and the node identity.",
    ),
    Setting(
        name="node_id",
        env="MODELFORGE_NODE_ID",
        flag="--node-id",
        value=None,
        shown="(derived: state file in containers, else machine ID)",
        help="Explicit identity key of this host as a compute node; highest priority.",
    ),
    Setting(
        name="admin_token",
        env="MODELFORGE_ADMIN_TOKEN",
        flag=None,  # a secret: never on a command line, where `ps` shows it
        value=None,
        shown="(generated at first start into <state dir>/admin-token)",
        help="Operator bearer token the server accepts for the HTTP API.",
    ),
    Setting(
        name="host",
        env="MODELFORGE_HOST",
        flag="--host",
        value="127.0.0.1",
        help="Address the API server listens on.",
    ),
    Setting(
        name="port",
        env="MODELFORGE_PORT",
        flag="--port",
        value=8080,
        kind="port",
        help="Port the API server listens on.",
    ),
    Setting(
        name="startup_refresh",
        env="MODELFORGE_STARTUP_REFRESH",
        flag="--startup-refresh/--no-startup-refresh",
        value=False,
        kind="bool",
        help="Refresh the local host's inventory once at start (the API host is not implicitly a node).",
    ),
    Setting(
        name="collector_timeout",
        env="MODELFORGE_COLLECTOR_TIMEOUT",
        flag="--collector-timeout",
        value=10.0,
        kind="positive",
        help="Seconds a collector may take per refresh before its facts become temporarily_failed.",
    ),
    Setting(
        name="stale_after",
        env="MODELFORGE_STALE_AFTER",
        flag="--stale-after",
        value=60.0,
        kind="positive",
        help="Seconds without a received report after which an agent node is `stale`.",
    ),
    Setting(
        name="offline_after",
        env="MODELFORGE_OFFLINE_AFTER",
        flag="--offline-after",
        value=300.0,
        kind="positive",
        help="Seconds without a received report after which an agent node is `offline`.",
    ),
    Setting(
        name="retention_hours",
        env="MODELFORGE_RETENTION_HOURS",
        flag="--retention-hours",
        value=24.0,
        kind="positive",
        help=(
            "Observation events (telemetry) are kept at least this long, then pruned (a day's "
            "segment goes once all of its day is older); the newest per node and GPU stays."
        ),
    ),
    Setting(
        name="retention_interval",
        env="MODELFORGE_RETENTION_INTERVAL",
        flag="--retention-interval",
        value=300.0,
        kind="seconds",
        help="Seconds between the server's background retention passes (0 disables them).",
    ),
    Setting(
        name="telemetry_hours_interval",
        env="MODELFORGE_TELEMETRY_HOURS_INTERVAL",
        flag="--telemetry-hours-interval",
        value=10.0,
        kind="seconds",
        help=(
            "Seconds between the server's passes that store each node's closed telemetry hours as "
            "columns for the history reads (docs/telemetry.md); 0 disables them (the reads then "
            "decode the log's snapshots)."
        ),
    ),
    Setting(
        name="rendered_reads_mib",
        env="MODELFORGE_RENDERED_READS_MIB",
        flag="--rendered-reads-mib",
        value=256,
        kind="mebibytes",
        help=(
            "Memory for node and accelerator-page renderings kept until their node's stream changes "
            "(never stale; docs/architecture.md, Rendered reads); 0 keeps none."
        ),
    ),
    Setting(
        name="report_transactions",
        env="MODELFORGE_REPORT_TRANSACTIONS",
        flag="--report-transactions",
        value=3,
        kind="count",
        help=(
            "Agent-report transactions the server runs at most at once, each on a connection of its "
            "own; reports that arrive while one runs wait and go together in the next, and another "
            "runs beside it only once a full batch (32 reports) waits (group commit; docs/capacity.md)."
        ),
    ),
    Setting(
        name="state_cache_streams",
        env="MODELFORGE_STATE_CACHE_STREAMS",
        flag="--state-cache-streams",
        value=10_000,
        kind="whole",
        help=(
            "Folded node states the server keeps after writing them, so that the next report of a "
            "node neither fetches nor decodes its state (about 17 KB each at 8 GPUs; "
            "docs/capacity.md); 0 keeps none."
        ),
    ),
    # Webhook delivery (docs/integrations.md): the server's delivery worker; environment only.
    Setting(
        name="webhook_source",
        env="MODELFORGE_WEBHOOK_SOURCE",
        flag=None,
        value="urn:modelforge:hardware",
        help="The CloudEvents `source` of every webhook delivery: this ledger's identity to receivers.",
    ),
    Setting(
        name="webhook_max_attempts",
        env="MODELFORGE_WEBHOOK_MAX_ATTEMPTS",
        flag=None,
        value=8,
        kind="count",
        help=(
            "Failed attempts in a row at one event (down, timeout, 5xx, 408, 429) after which a "
            "subscription is `failing`; it is then retried every MODELFORGE_WEBHOOK_BACKOFF_MAX."
        ),
    ),
    Setting(
        name="webhook_backoff_initial",
        env="MODELFORGE_WEBHOOK_BACKOFF_INITIAL",
        flag=None,
        value=1.0,
        kind="positive",
        help="Seconds before the first retry of a webhook delivery; doubled per attempt, with jitter.",
    ),
    Setting(
        name="webhook_backoff_max",
        env="MODELFORGE_WEBHOOK_BACKOFF_MAX",
        flag=None,
        value=300.0,
        kind="positive",
        help="Longest wait between webhook delivery attempts, and a failing subscription's probe interval.",
    ),
    Setting(
        name="webhook_timeout",
        env="MODELFORGE_WEBHOOK_TIMEOUT",
        flag=None,
        value=10.0,
        kind="positive",
        help="Seconds a webhook receiver has to answer one delivery before it counts as failed.",
    ),
    Setting(
        name="webhook_allow_private",
        env="MODELFORGE_WEBHOOK_ALLOW_PRIVATE",
        flag=None,
        value=False,
        kind="bool",
        help=(
            "Allow webhook destinations on loopback, link-local and private addresses (refused by "
            "default: a subscription must not make the server probe its own network)."
        ),
    ),
    Setting(
        name="log_level",
        env="MODELFORGE_LOG_LEVEL",
        flag="--log-level",
        value="INFO",
        help="structlog level.",
    ),
    Setting(
        name="log_json",
        env="MODELFORGE_LOG_JSON",
        flag=None,  # read before any command line is parsed, so that parse errors log alike
        value=None,
        kind="bool",
        shown="(JSON when stderr is not a TTY)",
        help="Force JSON logs (1) or console lines (0).",
    ),
    # The operator CLI over HTTP (`modelforge-hw node|gpu|events`).
    Setting(
        name="server",
        env="MODELFORGE_SERVER",
        flag="--server",
        value=None,
        shown="(required)",
        help="Operator CLI: base URL of the API server, e.g. http://127.0.0.1:8080.",
    ),
    Setting(
        name="token",
        env="MODELFORGE_TOKEN",
        flag="--token",
        value=None,
        shown="(none; prefer --token-file)",
        help="Operator CLI: bearer token (operator or viewer) for the API server.",
    ),
    Setting(
        name="token_file",
        env="MODELFORGE_TOKEN_FILE",
        flag="--token-file",
        value=None,
        kind="path",
        shown="(none)",
        help="Operator CLI: file holding the bearer token.",
    ),
    # The agent (`modelforge-hw agent enroll|run`).
    Setting(
        name="server_url",
        env="MODELFORGE_SERVER_URL",
        flag="--server",
        value=None,
        shown="(required)",
        help="Agent: central API base URL; comma-separate or repeat --server for failover.",
    ),
    Setting(
        name="enrollment_token",
        env="MODELFORGE_ENROLLMENT_TOKEN",
        flag="--token",
        value=None,
        shown="(none; prefer --token-file)",
        help="Agent: the one-time enrollment token exchanged for a node credential.",
    ),
    Setting(
        name="ca_file",
        env="MODELFORGE_CA_FILE",
        flag="--ca-file",
        value=None,
        shown="(system trust store)",
        help="Agent: PEM bundle to trust for the server's TLS certificate.",
    ),
    Setting(
        name="agent_interval",
        env="MODELFORGE_AGENT_INTERVAL",
        flag="--interval",
        value=10.0,
        kind="positive",
        help="Agent: seconds between reports.",
    ),
    Setting(
        name="agent_inventory_every",
        env="MODELFORGE_AGENT_INVENTORY_EVERY",
        flag="--inventory-every",
        value=30,
        kind="count",
        help="Agent: an inventory report at least every N reports (telemetry in between).",
    ),
    Setting(
        name="agent_spool_max",
        env="MODELFORGE_AGENT_SPOOL_MAX",
        flag="--spool-max",
        value=1000,
        kind="count",
        help="Agent: reports kept in the durable spool while the server is unreachable.",
    ),
    Setting(
        name="agent_backoff_initial",
        env="MODELFORGE_AGENT_BACKOFF_INITIAL",
        flag="--backoff-initial",
        value=1.0,
        kind="positive",
        help="Agent: first retry delay in seconds (exponential, with jitter).",
    ),
    Setting(
        name="agent_backoff_max",
        env="MODELFORGE_AGENT_BACKOFF_MAX",
        flag="--backoff-max",
        value=60.0,
        kind="positive",
        help="Agent: longest retry delay in seconds.",
    ),
    Setting(
        name="agent_request_timeout",
        env="MODELFORGE_AGENT_REQUEST_TIMEOUT",
        flag="--request-timeout",
        value=10.0,
        kind="positive",
        help="Agent: seconds one HTTP request to the server may take.",
    ),
    Setting(
        name="agent_quarantine_after",
        env="MODELFORGE_AGENT_QUARANTINE_AFTER",
        flag="--quarantine-after",
        value=5,
        kind="count",
        help="Agent: quarantine a report answered HTTP 500 this many times in a row (502-504 never count).",
    ),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def setting(name: str) -> Setting:
    return BY_NAME[name]


def default(name: str) -> Any:
    """The one default of an option (None where it is absent or derived at run time)."""
    return BY_NAME[name].value


def parse(s: Setting, text: str, *, source: str | None = None) -> Value:
    """`text` as the option's type, or a SettingError naming `source` (the variable by default)."""
    try:
        return PARSERS[s.kind](text)
    except (ValueError, TypeError):
        raise SettingError(f"{source or s.env}={text!r} is not {s.accepts}") from None


def from_env(name: str, env: Mapping[str, str] | None = None) -> Value:
    """The option's value from its variable (empty counts as unset), else its default."""
    s = BY_NAME[name]
    text = (os.environ if env is None else env).get(s.env)
    if text is None or text == "":
        return s.value  # type: ignore[no-any-return]
    return parse(s, text)
