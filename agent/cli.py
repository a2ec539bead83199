"""`modelforge-hw agent enroll|run`: the compute-node agent's command line.

    modelforge-hw agent enroll --server URL --token TOKEN [--state-dir DIR] [--node-id ID] [--force]
    modelforge-hw agent run [--server URL ...] [--interval S] [--once] ...
    modelforge-hw agent status [--state-dir DIR] [--json]

Every option has a `MODELFORGE_*` environment variable (see `--help`). Exit codes: 0 ok; 1 reports
left unsent (`--once`) or server unreachable at enrollment; 2 usage (not enrolled, enrollment
refused, unusable state directory, another agent holds the state directory); 78 publishing
stopped for good (credential revoked, node decommissioned, or this host's identity is not the
credential's): do not restart automatically.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import msgspec

from agent.config import AgentConfig, parse_servers
from agent.enrollment import enroll
from agent.errors import AgentError
from agent.runner import run_agent
from agent.spool import Quarantine, Spool
from agent.state import (
    QUARANTINE_DIR,
    SPOOL_DIR,
    LastError,
    StateError,
    load_credential,
    load_status,
    lock_holder,
)
from runtime import settings


def _value(args: argparse.Namespace, name: str, dest: str | None = None) -> Any:
    """The flag, else the option's variable, else its one default (runtime/settings.py)."""
    given = getattr(args, dest or name, None)
    return given if given is not None else settings.from_env(name)


def _state_dir(args: argparse.Namespace) -> Path:
    from ledger.db import default_state_dir

    value = _value(args, "state_dir")
    return Path(value) if value is not None else default_state_dir()


def _fail(exc: AgentError) -> int:
    print(f"modelforge-hw agent: {exc}", file=sys.stderr)
    return exc.exit_code


def cmd_enroll(args: argparse.Namespace) -> int:
    server = _value(args, "server_url", "server")
    if not server:
        return _fail(AgentError("--server URL is required (or MODELFORGE_SERVER_URL)"))
    token = _value(args, "enrollment_token", "token")
    if args.token_file:
        try:
            token = Path(args.token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            return _fail(AgentError(f"cannot read the token file: {exc}"))
    if not token:
        return _fail(
            AgentError(
                "an enrollment token is required: --token, --token-file or MODELFORGE_ENROLLMENT_TOKEN"
            )
        )
    state_dir = _state_dir(args)
    try:
        credential = asyncio.run(
            enroll(
                parse_servers([server])[0],
                token,
                state_dir,
                node_id=_value(args, "node_id"),
                force=args.force,
                ca_file=_value(args, "ca_file"),
            )
        )
    except AgentError as exc:
        return _fail(exc)
    print(f"enrolled: node {credential.node_id}, credential kept in {state_dir} (mode 0600)")
    return 0


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """Flags, else `MODELFORGE_*` variables, else the one model's defaults (also in --help)."""
    servers = parse_servers(args.server or [_value(args, "server_url", "server") or ""])
    return AgentConfig(
        servers=servers,
        state_dir=_state_dir(args),
        node_id=_value(args, "node_id"),
        interval=_value(args, "agent_interval", "interval"),
        inventory_every=_value(args, "agent_inventory_every", "inventory_every"),
        spool_max=_value(args, "agent_spool_max", "spool_max"),
        backoff_initial=_value(args, "agent_backoff_initial", "backoff_initial"),
        backoff_max=_value(args, "agent_backoff_max", "backoff_max"),
        request_timeout=_value(args, "agent_request_timeout", "request_timeout"),
        collector_timeout=_value(args, "collector_timeout"),
        quarantine_after=_value(args, "agent_quarantine_after", "quarantine_after"),
        ca_file=_value(args, "ca_file"),
        once=args.once,
    )


def cmd_run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if config.interval <= 0:
        return _fail(AgentError("--interval must be positive"))
    if config.quarantine_after < 1:
        return _fail(AgentError("--quarantine-after must be at least 1"))
    try:
        return asyncio.run(run_agent(config))
    except AgentError as exc:
        return _fail(exc)


class StatusView(msgspec.Struct, frozen=True):
    """`agent status --json`: what an operator or a monitoring script checks."""

    state_dir: str
    enrolled: bool
    node_id: str | None
    server: str | None
    running_pid: int | None
    spooled: int
    spooled_by_stream: dict[str, int]
    quarantined: int  # kept in the quarantine folder now (the newest ones)
    quarantined_total: int  # ever, by this state directory
    quarantine_dir: str
    last_error: LastError | None


def agent_status(state_dir: Path) -> StatusView:
    """Read-only: works beside a running agent and takes no lock."""
    try:
        credential = load_credential(state_dir)
    except StateError:
        credential = None
    spool_dir, quarantine_dir = state_dir / SPOOL_DIR, state_dir / QUARANTINE_DIR
    spooled = Spool(spool_dir).entries() if spool_dir.is_dir() else []
    by_stream: dict[str, int] = {}
    for entry in spooled:
        by_stream[entry.stream] = by_stream.get(entry.stream, 0) + 1
    quarantined = len(Quarantine(quarantine_dir)) if quarantine_dir.is_dir() else 0
    status = load_status(state_dir)
    return StatusView(
        state_dir=str(state_dir),
        enrolled=credential is not None,
        node_id=credential.node_id if credential else None,
        server=credential.server if credential else None,
        running_pid=lock_holder(state_dir),
        spooled=len(spooled),
        spooled_by_stream=by_stream,
        quarantined=quarantined,
        quarantined_total=max(status.quarantined_total, quarantined),
        quarantine_dir=str(quarantine_dir),
        last_error=status.last_error,
    )


def cmd_status(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args)
    if not state_dir.is_dir():
        return _fail(AgentError(f"no state directory at {state_dir}"))
    view = agent_status(state_dir)
    if args.json:
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


def register(sub: Any) -> None:
    """Add `agent enroll` and `agent run` to the `modelforge-hw` parser."""
    agent = sub.add_parser("agent", help="the compute-node agent (outbound only)")
    agent_sub = agent.add_subparsers(dest="agent_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        settings.add_flag(p, "state_dir", help="Directory for the credential, the spool and the identity.")
        for name in ("node_id", "ca_file", "log_level"):
            settings.add_flag(p, name)

    p = agent_sub.add_parser("enroll", help="exchange an enrollment token for this node's credential")
    common(p)
    settings.add_flag(p, "server_url", dest="server")
    settings.add_flag(p, "enrollment_token", dest="token")
    p.add_argument("--token-file", help="read the enrollment token from this file")
    p.add_argument("--force", action="store_true", help="enroll again; the node's old credential is revoked")
    p.set_defaults(func=cmd_enroll)

    p = agent_sub.add_parser("run", help="collect and publish reports until stopped")
    common(p)
    p.add_argument(
        "--server",
        action="append",
        help="central API base URL; repeat (or comma-separate) for failover (env MODELFORGE_SERVER_URL; "
        "default: the server enrolled with)",
    )
    for name in (
        "agent_interval",
        "agent_inventory_every",
        "agent_spool_max",
        "agent_backoff_initial",
        "agent_backoff_max",
        "agent_request_timeout",
        "collector_timeout",
        "agent_quarantine_after",
    ):
        settings.add_flag(p, name, dest=name.removeprefix("agent_"))
    p.add_argument("--once", action="store_true", help="collect one report, send the spool, exit")
    p.set_defaults(func=cmd_run)

    p = agent_sub.add_parser(
        "status", help="spool depth, quarantined reports and the last error of the agent on this host"
    )
    p.add_argument("--state-dir", help="state directory (env MODELFORGE_STATE_DIR)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    p.set_defaults(func=cmd_status)
