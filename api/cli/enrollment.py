"""`modelforge-hw token ...` and `modelforge-hw credential ...`: enrollment tokens and node
credentials from the server host, straight against the database (as `refresh` and `rebuild` are).
The same operations are operator routes of the HTTP API (api/http/agent.py).

    modelforge-hw token create --ttl 1h --uses 3 [--description TEXT] [--json]
    modelforge-hw token list [--json]
    modelforge-hw token revoke TOKEN_ID [--reason TEXT]
    modelforge-hw credential list [--node NODE] [--json]
    modelforge-hw credential revoke CREDENTIAL_ID [--reason TEXT]

A refusal (`api.services.errors`) reaches `api.cli.main`, which prints it as one line and exits
with the code of its kind.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from api.cli.common import (
    DatabaseUrl,
    LogLevel,
    NodeOption,
    StateDir,
    json_flag,
    resolve_node,
    server_config,
    with_database,
)
from api.cli.moments import duration_option
from api.cli.rendering import listing, print_json

token_app = typer.Typer(no_args_is_help=True, help="enrollment tokens for agents")
credential_app = typer.Typer(no_args_is_help=True, help="node credentials of enrolled agents")

Reason = Annotated[str, typer.Option("--reason")]


def _run(
    database_url: str | None,
    state_dir: Path | None,
    log_level: str | None,
    work: Callable[[Any, Any], Awaitable[int]],
) -> int:
    """`work(services, pool)` against the database."""
    from api.wiring import build_services

    config = server_config(database_url=database_url, state_dir=state_dir, log_level=log_level)

    async def wrapped(pool: Any) -> int:
        return await work(build_services(pool), pool)

    return with_database(config, wrapped)


@token_app.command("create")
def token_create(
    database_url: DatabaseUrl = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
    ttl: Annotated[
        float,
        duration_option("--ttl", "lifetime: 90s, 15m, 1h, 7d (default 1h)"),
    ] = 3600.0,
    uses: Annotated[int, typer.Option("--uses", help="how many agents may enroll with it (default 1)")] = 1,
    description: Annotated[
        str | None, typer.Option("--description", help="what the token is for (shown in `token list`)")
    ] = None,
    as_json: Annotated[bool, json_flag("print the token and its details as JSON")] = False,
) -> int:
    """create an enrollment token (printed once)"""

    async def work(services: Any, _pool: Any) -> int:
        created = await services.enrollment.create_token(ttl, uses, description or "", actor="cli")
        if as_json:
            print_json(created)
        else:
            print(created.token)
            print(
                f"enrollment token {created.token_id}: {created.uses} use(s), expires "
                f"{created.expires_at.isoformat()} (shown once; give it to `modelforge-hw agent enroll`)",
                file=sys.stderr,
            )
        return 0

    return _run(database_url, state_dir, log_level, work)


@token_app.command("list")
def token_list(
    database_url: DatabaseUrl = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
    as_json: Annotated[bool, json_flag()] = False,
) -> int:
    """enrollment tokens (never their secrets)"""

    async def work(services: Any, _pool: Any) -> int:
        listing(
            await services.enrollment.list_tokens(),
            as_json=as_json,
            none="no enrollment tokens (create one with `modelforge-hw token create`)",
            header=["TOKEN ID", "STATUS", "USES LEFT", "EXPIRES", "DESCRIPTION"],
            row=lambda t: [
                t.token_id,
                t.status,
                f"{t.uses_left}/{t.uses}",
                t.expires_at.isoformat(timespec="seconds") if t.expires_at else "never",
                t.description,
            ],
        )
        return 0

    return _run(database_url, state_dir, log_level, work)


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[str, typer.Argument(metavar="TOKEN_ID", show_default=False)],
    database_url: DatabaseUrl = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
    reason: Reason = "revoked by an operator",
) -> int:
    """revoke an enrollment token"""

    async def work(services: Any, _pool: Any) -> int:
        token = await services.enrollment.revoke_token(token_id, reason, actor="cli")
        print(f"enrollment token {token.token_id}: {token.status}")
        return 0

    return _run(database_url, state_dir, log_level, work)


@credential_app.command("list")
def credential_list(
    database_url: DatabaseUrl = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
    node: NodeOption = None,
    as_json: Annotated[bool, json_flag()] = False,
) -> int:
    """node credentials (never their secrets)"""

    async def work(services: Any, pool: Any) -> int:
        node_id = await resolve_node(pool, node)
        listing(
            await services.credentials.list_credentials(node_id),
            as_json=as_json,
            none="no node credentials" + (f" for node {node_id}" if node_id else ""),
            header=["CREDENTIAL ID", "STATUS", "NODE", "HOSTNAME", "ISSUED"],
            row=lambda c: [
                c.credential_id,
                c.status,
                c.node_id,
                c.hostname,
                c.issued_at.isoformat(timespec="seconds"),
            ],
            ids=(0, 2),
        )
        return 0

    return _run(database_url, state_dir, log_level, work)


@credential_app.command("revoke")
def credential_revoke(
    credential_id: Annotated[str, typer.Argument(metavar="CREDENTIAL_ID", show_default=False)],
    database_url: DatabaseUrl = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
    reason: Reason = "revoked by an operator",
) -> int:
    """revoke a node credential (its agent gets 401 and stops)"""

    async def work(services: Any, _pool: Any) -> int:
        credential = await services.credentials.revoke_credential(credential_id, reason, actor="cli")
        print(f"credential {credential.credential_id} of node {credential.node_id}: {credential.status}")
        return 0

    return _run(database_url, state_dir, log_level, work)
