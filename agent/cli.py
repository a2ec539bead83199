"""`modelforge-hw agent enroll|run|status`: the compute-node agent's command line (a Typer app that
`api.cli.main` mounts as `agent`).

    modelforge-hw agent enroll --server URL --token TOKEN [--state-dir DIR] [--node-id ID] [--force]
    modelforge-hw agent run [--server URL ...] [--interval S] [--once] ...
    modelforge-hw agent status [--state-dir DIR] [--json]

Every option has a `MODELFORGE_*` environment variable (see `--help`). Exit codes: 0 ok; 1 reports
left unsent (`--once`) or server unreachable at enrollment; 2 usage (not enrolled, enrollment
refused, unusable state directory, another agent holds the state directory); 78 publishing
stopped for good (credential revoked, node decommissioned, or this host's identity is not the
credential's): do not restart automatically.

The agent's machinery (agent.runner, its collectors and HTTP client) is imported when a command
runs, not when the command line is read: every TAB of shell completion runs the program.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from runtime import settings
from runtime.logs import configure_logging_from_settings
from runtime.options import setting_option

if TYPE_CHECKING:
    from agent.config import AgentConfig
    from agent.errors import AgentError

agent_app = typer.Typer(no_args_is_help=True, help="the compute-node agent (outbound only)")

StateDir = Annotated[
    Path | None,
    setting_option("state_dir", help="Directory for the credential, the spool and the identity."),
]
NodeId = Annotated[str | None, setting_option("node_id")]
CaFile = Annotated[str | None, setting_option("ca_file")]
LogLevel = Annotated[str | None, setting_option("log_level")]


def _value(given: Any, name: str) -> Any:
    """The flag, else the option's variable, else its one default (runtime/settings.py)."""
    return given if given is not None else settings.from_env(name)


def _state_dir(given: Path | None) -> Path:
    from ledger.db import default_state_dir

    value = _value(given, "state_dir")
    return Path(value) if value is not None else default_state_dir()


def _fail(exc: AgentError) -> int:
    print(f"modelforge-hw agent: {exc}", file=sys.stderr)
    return exc.exit_code


@agent_app.command("enroll")
def enroll_command(
    server: Annotated[str | None, setting_option("server_url")] = None,
    token: Annotated[str | None, setting_option("enrollment_token")] = None,
    token_file: Annotated[
        str | None, typer.Option("--token-file", help="read the enrollment token from this file")
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="enroll again; the node's old credential is revoked")
    ] = False,
    state_dir: StateDir = None,
    node_id: NodeId = None,
    ca_file: CaFile = None,
    log_level: LogLevel = None,
) -> int:
    """exchange an enrollment token for this node's credential"""
    from agent.config import parse_servers
    from agent.enrollment import enroll
    from agent.errors import AgentError

    configure_logging_from_settings(log_level)
    server = _value(server, "server_url")
    if not server:
        return _fail(AgentError("--server URL is required (or MODELFORGE_SERVER_URL)"))
    token = _value(token, "enrollment_token")
    if token_file:
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            return _fail(AgentError(f"cannot read the token file: {exc}"))
    if not token:
        return _fail(
            AgentError(
                "an enrollment token is required: --token, --token-file or MODELFORGE_ENROLLMENT_TOKEN"
            )
        )
    where = _state_dir(state_dir)
    try:
        credential = asyncio.run(
            enroll(
                parse_servers([server])[0],
                token,
                where,
                node_id=_value(node_id, "node_id"),
                force=force,
                ca_file=_value(ca_file, "ca_file"),
            )
        )
    except AgentError as exc:
        return _fail(exc)
    print(f"enrolled: node {credential.node_id}, credential kept in {where} (mode 0600)")
    return 0


def run_config(
    *,
    servers: list[str] | None = None,
    state_dir: Path | None = None,
    node_id: str | None = None,
    interval: float | None = None,
    inventory_every: int | None = None,
    spool_max: int | None = None,
    backoff_initial: float | None = None,
    backoff_max: float | None = None,
    request_timeout: float | None = None,
    collector_timeout: float | None = None,
    quarantine_after: int | None = None,
    ca_file: str | None = None,
    once: bool = False,
) -> AgentConfig:
    """Flags, else `MODELFORGE_*` variables, else the one model's defaults (also in --help)."""
    from agent.config import AgentConfig, parse_servers

    return AgentConfig(
        servers=parse_servers(servers or [_value(None, "server_url") or ""]),
        state_dir=_state_dir(state_dir),
        node_id=_value(node_id, "node_id"),
        interval=_value(interval, "agent_interval"),
        inventory_every=_value(inventory_every, "agent_inventory_every"),
        spool_max=_value(spool_max, "agent_spool_max"),
        backoff_initial=_value(backoff_initial, "agent_backoff_initial"),
        backoff_max=_value(backoff_max, "agent_backoff_max"),
        request_timeout=_value(request_timeout, "agent_request_timeout"),
        collector_timeout=_value(collector_timeout, "collector_timeout"),
        quarantine_after=_value(quarantine_after, "agent_quarantine_after"),
        ca_file=_value(ca_file, "ca_file"),
        once=once,
    )


@agent_app.command("run")
def run_command(
    server: Annotated[
        list[str] | None,
        typer.Option(
            "--server",
            metavar="SERVER",
            help="central API base URL; repeat (or comma-separate) for failover (env "
            "MODELFORGE_SERVER_URL; default: the server enrolled with)",
            show_default=False,
        ),
    ] = None,
    state_dir: StateDir = None,
    node_id: NodeId = None,
    ca_file: CaFile = None,
    log_level: LogLevel = None,
    interval: Annotated[float | None, setting_option("agent_interval")] = None,
    inventory_every: Annotated[int | None, setting_option("agent_inventory_every")] = None,
    spool_max: Annotated[int | None, setting_option("agent_spool_max")] = None,
    backoff_initial: Annotated[float | None, setting_option("agent_backoff_initial")] = None,
    backoff_max: Annotated[float | None, setting_option("agent_backoff_max")] = None,
    request_timeout: Annotated[float | None, setting_option("agent_request_timeout")] = None,
    collector_timeout: Annotated[float | None, setting_option("collector_timeout")] = None,
    quarantine_after: Annotated[int | None, setting_option("agent_quarantine_after")] = None,
    once: Annotated[bool, typer.Option("--once", help="collect one report, send the spool, exit")] = False,
) -> int:
    """collect and publish reports until stopped"""
    from agent.errors import AgentError
    from agent.runner import run_agent

    configure_logging_from_settings(log_level)
    config = run_config(
        servers=server,
        state_dir=state_dir,
        node_id=node_id,
        interval=interval,
        inventory_every=inventory_every,
        spool_max=spool_max,
        backoff_initial=backoff_initial,
        backoff_max=backoff_max,
        request_timeout=request_timeout,
        collector_timeout=collector_timeout,
        quarantine_after=quarantine_after,
        ca_file=ca_file,
        once=once,
    )
    if config.interval <= 0:
        return _fail(AgentError("--interval must be positive"))
    if config.quarantine_after < 1:
        return _fail(AgentError("--quarantine-after must be at least 1"))
    try:
        return asyncio.run(run_agent(config))
    except AgentError as exc:
        return _fail(exc)


@agent_app.command("status")
def status_command(
    state_dir: StateDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object instead of lines")] = False,
) -> int:
    """spool depth, quarantined reports and the last error of the agent on this host"""
    import msgspec

    from agent.errors import AgentError
    from agent.status import agent_status

    where = _state_dir(state_dir)
    if not where.is_dir():
        return _fail(AgentError(f"no state directory at {where}"))
    view = agent_status(where)
    if as_json:
        print(msgspec.json.encode(view).decode())
        return 0
    streams = ", ".join(f"{k} {v}" for k, v in sorted(view.spooled_by_stream.items()))
    error = view.last_error
    lines = [
        f"state directory: {view.state_dir}",
        f"node: {view.node_id} (server {view.server})" if view.enrolled else "node: not enrolled",
        f"agent: running (pid {view.running_pid})" if view.running_pid else "agent: not running",
        f"spool depth: {view.spooled}" + (f" ({streams})" if streams else ""),
        f"quarantined: {view.quarantined_total} (kept in {view.quarantine_dir}: {view.quarantined})",
        "last error: "
        + (f"{error.at.isoformat()} {error.stream} #{error.sequence}: {error.detail}" if error else "none"),
    ]
    print("\n".join(lines))
    return 0
