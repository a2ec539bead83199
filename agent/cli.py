"""`modelforge-hw agent enroll|run`: the compute-node agent's command line.

    modelforge-hw agent enroll --server URL --token TOKEN [--state-dir DIR] [--node-id ID] [--force]
    modelforge-hw agent run [--server URL ...] [--interval S] [--once] ...

Every option has a `MODELFORGE_*` environment variable (see `--help`). Exit codes: 0 ok; 1 reports
left unsent (`--once`) or server unreachable at enrollment; 2 usage (not enrolled, enrollment
refused, unusable state directory); 78 publishing stopped for good (credential revoked, node
decommissioned, or this host's identity is not the credential's): do not restart automatically.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from agent.runner import AgentConfig, AgentError, enroll, parse_servers, run_agent


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


def cmd_run(args: argparse.Namespace) -> int:
    servers = parse_servers(args.server or [os.environ.get("MODELFORGE_SERVER_URL", "")])
    config = AgentConfig(
        servers=servers,
        state_dir=_state_dir(args),
        node_id=args.node_id or os.environ.get("MODELFORGE_NODE_ID") or None,
        interval=args.interval
        if args.interval is not None
        else _env_float("MODELFORGE_AGENT_INTERVAL", 10.0),
        inventory_every=args.inventory_every or _env_int("MODELFORGE_AGENT_INVENTORY_EVERY", 30),
        spool_max=args.spool_max or _env_int("MODELFORGE_AGENT_SPOOL_MAX", 1000),
        backoff_initial=args.backoff_initial or _env_float("MODELFORGE_AGENT_BACKOFF_INITIAL", 1.0),
        backoff_max=args.backoff_max or _env_float("MODELFORGE_AGENT_BACKOFF_MAX", 60.0),
        request_timeout=args.request_timeout or _env_float("MODELFORGE_AGENT_REQUEST_TIMEOUT", 10.0),
        collector_timeout=args.collector_timeout or _env_float("MODELFORGE_COLLECTOR_TIMEOUT", 10.0),
        ca_file=args.ca_file or os.environ.get("MODELFORGE_CA_FILE") or None,
        once=args.once,
    )
    if config.interval <= 0:
        return _fail(AgentError("--interval must be positive"))
    try:
        return asyncio.run(run_agent(config))
    except AgentError as exc:
        return _fail(exc)


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
        "--interval", type=float, help="seconds between reports (env MODELFORGE_AGENT_INTERVAL, 10)"
    )
    p.add_argument("--inventory-every", type=int, help="an inventory report at least every N reports (30)")
    p.add_argument("--spool-max", type=int, help="reports kept while the server is unreachable (1000)")
    p.add_argument("--backoff-initial", type=float, help="first retry delay in seconds (1)")
    p.add_argument("--backoff-max", type=float, help="longest retry delay in seconds (60)")
    p.add_argument("--request-timeout", type=float, help="seconds per HTTP request (10)")
    p.add_argument("--collector-timeout", type=float, help="seconds per collector per report (5)")
    p.add_argument("--once", action="store_true", help="collect one report, send the spool, exit")
    p.set_defaults(func=cmd_run)
