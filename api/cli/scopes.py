"""`modelforge-hw viewer-token create|list|revoke`: read-only operator tokens, from the server
host straight against the database (as `token create` is).

    modelforge-hw viewer-token create [--ttl 30d] [--description TEXT] [--json]
    modelforge-hw viewer-token list [--json]
    modelforge-hw viewer-token revoke TOKEN_ID
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from api.cli.common import CliError, _config, _with_database
from api.cli.enrollment import parse_duration
from api.services.scopes import OperatorTokens, UnknownToken


def _run(args: argparse.Namespace, work: Callable[[Any], Any]) -> int:
    async def wrapped(pool: Any) -> int:
        try:
            return int(await work(OperatorTokens(pool)))
        except (UnknownToken, ValueError) as exc:
            raise CliError(str(exc)) from exc

    return _with_database(_config(args), wrapped)


def _print_json(value: Any) -> None:
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")


def cmd_create(args: argparse.Namespace) -> int:
    async def work(tokens: Any) -> int:
        created = await tokens.create(ttl_seconds=args.ttl, description=args.description or "")
        if args.json:
            _print_json(created)
        else:
            print(created.token)
            expires = created.expires_at.isoformat() if created.expires_at else "never"
            sys.stderr.write(
                f"viewer token {created.token_id}: reads metrics, inventory and events; expires "
                f"{expires} (shown once)\n"
            )
        return 0

    return _run(args, work)


def cmd_list(args: argparse.Namespace) -> int:
    async def work(tokens: Any) -> int:
        items = await tokens.list()
        if args.json:
            _print_json(items)
            return 0
        if not items:
            print("no viewer tokens")
            return 0
        print(f"{'TOKEN ID':32}  {'STATUS':8}  {'EXPIRES':25}  DESCRIPTION")
        for t in items:
            expires = t.expires_at.isoformat(timespec="seconds") if t.expires_at else "never"
            print(f"{t.token_id:32}  {t.status:8}  {expires:25}  {t.description}")
        return 0

    return _run(args, work)


def cmd_revoke(args: argparse.Namespace) -> int:
    async def work(tokens: Any) -> int:
        token = await tokens.revoke(args.token_id)
        print(f"viewer token {token.token_id}: {token.status}")
        return 0

    return _run(args, work)


def register(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    viewer = sub.add_parser("viewer-token", help="read-only operator tokens (metrics, inventory, events)")
    viewer_sub = viewer.add_subparsers(dest="viewer_token_command", required=True)
    p = viewer_sub.add_parser("create", help="mint a viewer token (printed once)")
    common(p)
    p.add_argument("--ttl", type=parse_duration, help="lifetime: 90s, 15m, 1h, 7d (default: no expiry)")
    p.add_argument("--description", help="what the token is for (shown in `viewer-token list`)")
    p.add_argument("--json", action="store_true", help="print the token and its details as JSON")
    p.set_defaults(func=cmd_create)
    p = viewer_sub.add_parser("list", help="viewer tokens (never their secrets)")
    common(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)
    p = viewer_sub.add_parser("revoke", help="revoke a viewer token (it gets 401 from then on)")
    common(p)
    p.add_argument("token_id")
    p.set_defaults(func=cmd_revoke)
