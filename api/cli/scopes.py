"""`modelforge-hw viewer-token create|list|revoke`: read-only operator tokens, from the server
host straight against the database (as `token create` is).

    modelforge-hw viewer-token create [--ttl 30d] [--description TEXT] [--json]
    modelforge-hw viewer-token list [--json]
    modelforge-hw viewer-token revoke TOKEN_ID
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from api.cli.common import DatabaseUrl, LogLevel, StateDir, json_flag, server_config, with_database
from api.cli.errors import CliError
from api.cli.moments import duration_option
from api.cli.rendering import print_json

if TYPE_CHECKING:
    from api.services.scopes import OperatorTokens

viewer_app = typer.Typer(no_args_is_help=True, help="read-only operator tokens (metrics, inventory, events)")


def _run(
    database_url: str | None,
    state_dir: Path | None,
    log_level: str | None,
    work: Callable[[OperatorTokens], Awaitable[int]],
) -> int:
    from api.services.scopes import OperatorTokens, UnknownToken

    config = server_config(database_url=database_url, state_dir=state_dir, log_level=log_level)

    async def wrapped(pool: Any) -> int:
        try:
            return await work(OperatorTokens(pool))
        except (UnknownToken, ValueError) as exc:
            raise CliError(str(exc)) from exc

    return with_database(config, wrapped)


@viewer_app.command("create")
def create(
    database_url: DatabaseUrl = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
    ttl: Annotated[
        float | None,
        duration_option("--ttl", "lifetime: 90s, 15m, 1h, 7d (default: no expiry)"),
    ] = None,
    description: Annotated[
        str | None, typer.Option("--description", help="what the token is for (shown in `viewer-token list`)")
    ] = None,
    as_json: Annotated[bool, json_flag("print the token and its details as JSON")] = False,
) -> int:
    """mint a viewer token (printed once)"""

    async def work(tokens: OperatorTokens) -> int:
        created = await tokens.create(ttl_seconds=ttl, description=description or "")
        if as_json:
            print_json(created)
        else:
            print(created.token)
            expires = created.expires_at.isoformat() if created.expires_at else "never"
            sys.stderr.write(
                f"viewer token {created.token_id}: reads metrics, inventory and events; expires "
                f"{expires} (shown once)\n"
            )
        return 0

    return _run(database_url, state_dir, log_level, work)


@viewer_app.command("list")
def list_tokens(
    database_url: DatabaseUrl = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
    as_json: Annotated[bool, json_flag()] = False,
) -> int:
    """viewer tokens (never their secrets)"""

    async def work(tokens: OperatorTokens) -> int:
        items = await tokens.list()
        if as_json:
            print_json(items)
            return 0
        if not items:
            print("no viewer tokens")
            return 0
        print(f"{'TOKEN ID':32}  {'STATUS':8}  {'EXPIRES':25}  DESCRIPTION")
        for t in items:
            expires = t.expires_at.isoformat(timespec="seconds") if t.expires_at else "never"
            print(f"{t.token_id:32}  {t.status:8}  {expires:25}  {t.description}")
        return 0

    return _run(database_url, state_dir, log_level, work)


@viewer_app.command("revoke")
def revoke(
    token_id: Annotated[str, typer.Argument(metavar="TOKEN_ID", show_default=False)],
    database_url: DatabaseUrl = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
) -> int:
    """revoke a viewer token (it gets 401 from then on)"""

    async def work(tokens: OperatorTokens) -> int:
        token = await tokens.revoke(token_id)
        print(f"viewer token {token.token_id}: {token.status}")
        return 0

    return _run(database_url, state_dir, log_level, work)
