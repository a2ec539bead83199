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
import os
import sys
from pathlib import Path
from typing import Any

import msgspec

from agent import runner
from agent.runner import AgentConfig, AgentError, enroll, parse_servers, run_agent
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


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


def _state_dir(args: argparse.Namespace) -> Path:
    from ledger.db import default_state_dir

    return Path(args.state_dir).expanduser() if args.state_dir else default_state_dir()


def _fail(exc: AgentError) -> int:
    print(f"modelforge-hw agent: {exc}", file=sys.stderr)
    return exc.exit_code


def cmd_enroll(args: argparse.Namespace) -> int:
    server = args.server or os.environ.get("MODELFORGE_SERVER_URL")
    if not server:
        return _fail(AgentError("--server URL is required (or MODELFORGE_SERVER_URL)"))
    token = args.token or os.environ.get("MODELFORGE_ENROLLMENT_TOKEN")
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
                node_id=args.node_id or os.environ.get("MODELFORGE_NODE_ID") or None,
                force=args.force,
                ca_file=args.ca_file or os.environ.get("MODELFORGE_CA_FILE") or None,
            )
        )
    except AgentError as exc:
        return _fail(exc)
    print(f"enrolled: node {credential.node_id}, credential kept in {state_dir} (mode 0600)")
    return 0


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """Flags, else `MODELFORGE_*` variables, else the runner's DEFAULT_* constants (also in --help)."""
    servers = parse_servers(args.server or [os.environ.get("MODELFORGE_SERVER_URL", "")])
    return AgentConfig(
        servers=servers,
        state_dir=_state_dir(args),
        node_id=args.node_id or os.environ.get("MODELFORGE_NODE_ID") or None,
        interval=args.interval
        if args.interval is not None
        else _env_float("MODELFORGE_AGENT_INTERVAL", runner.DEFAULT_INTERVAL),
        inventory_every=args.inventory_every
        or _env_int("MODELFORGE_AGENT_INVENTORY_EVERY", runner.DEFAULT_INVENTORY_EVERY),
        spool_max=args.spool_max or _env_int("MODELFORGE_AGENT_SPOOL_MAX", runner.DEFAULT_SPOOL_MAX),
        backoff_initial=args.backoff_initial
        or _env_float("MODELFORGE_AGENT_BACKOFF_INITIAL", runner.DEFAULT_BACKOFF_INITIAL),
        backoff_max=args.backoff_max
        or _env_float("MODELFORGE_AGENT_BACKOFF_MAX", runner.DEFAULT_BACKOFF_MAX),
        request_timeout=args.request_timeout
        or _env_float("MODELFORGE_AGENT_REQUEST_TIMEOUT", runner.DEFAULT_REQUEST_TIMEOUT),
        collector_timeout=args.collector_timeout
        or _env_float("MODELFORGE_COLLECTOR_TIMEOUT", runner.DEFAULT_COLLECTOR_TIMEOUT),
        quarantine_after=args.quarantine_after
        or _env_int("MODELFORGE_AGENT_QUARANTINE_AFTER", runner.DEFAULT_QUARANTINE_AFTER),
        ca_file=args.ca_file or os.environ.get("MODELFORGE_CA_FILE") or None,
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
        p.add_argument("--state-dir", help="state directory (env MODELFORGE_STATE_DIR)")
        p.add_argument("--node-id", help="identity key of this node (env MODELFORGE_NODE_ID)")
        p.add_argument("--ca-file", help="PEM bundle to trust for the server's TLS (env MODELFORGE_CA_FILE)")
        p.add_argument("--log-level", help="log level (env MODELFORGE_LOG_LEVEL)")

    p = agent_sub.add_parser("enroll", help="exchange an enrollment token for this node's credential")
    common(p)
    p.add_argument(
        "--server", help="central API base URL, e.g. https://hw.example.com (env MODELFORGE_SERVER_URL)"
    )
    p.add_argument("--token", help="enrollment token (env MODELFORGE_ENROLLMENT_TOKEN; prefer --token-file)")
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
    p.add_argument(
        "--interval",
        type=float,
        help=f"seconds between reports (env MODELFORGE_AGENT_INTERVAL, {runner.DEFAULT_INTERVAL:g})",
    )
    p.add_argument(
        "--inventory-every",
        type=int,
        help="an inventory report at least every N reports "
        f"(env MODELFORGE_AGENT_INVENTORY_EVERY, {runner.DEFAULT_INVENTORY_EVERY})",
    )
    p.add_argument(
        "--spool-max",
        type=int,
        help="reports kept while the server is unreachable "
        f"(env MODELFORGE_AGENT_SPOOL_MAX, {runner.DEFAULT_SPOOL_MAX})",
    )
    p.add_argument(
        "--backoff-initial",
        type=float,
        help="first retry delay in seconds "
        f"(env MODELFORGE_AGENT_BACKOFF_INITIAL, {runner.DEFAULT_BACKOFF_INITIAL:g})",
    )
    p.add_argument(
        "--backoff-max",
        type=float,
        help="longest retry delay in seconds "
        f"(env MODELFORGE_AGENT_BACKOFF_MAX, {runner.DEFAULT_BACKOFF_MAX:g})",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        help="seconds per HTTP request "
        f"(env MODELFORGE_AGENT_REQUEST_TIMEOUT, {runner.DEFAULT_REQUEST_TIMEOUT:g})",
    )
    p.add_argument(
        "--collector-timeout",
        type=float,
        help="seconds per collector per report "
        f"(env MODELFORGE_COLLECTOR_TIMEOUT, {runner.DEFAULT_COLLECTOR_TIMEOUT:g})",
    )
    p.add_argument(
        "--quarantine-after",
        type=int,
        help="quarantine a report answered HTTP 500 this many times in a row "
        f"(env MODELFORGE_AGENT_QUARANTINE_AFTER, {runner.DEFAULT_QUARANTINE_AFTER})",
    )
    p.add_argument("--once", action="store_true", help="collect one report, send the spool, exit")
    p.set_defaults(func=cmd_run)

    p = agent_sub.add_parser(
        "status", help="spool depth, quarantined reports and the last error of the agent on this host"
    )
    p.add_argument("--state-dir", help="state directory (env MODELFORGE_STATE_DIR)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    p.set_defaults(func=cmd_status)
