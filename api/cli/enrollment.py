"""`modelforge-hw token ...` and `modelforge-hw credential ...`: enrollment tokens and node
credentials from the server host, straight against the database (as `refresh` and `rebuild` are).
The same operations are operator routes of the HTTP API (api/http/agent.py).

    modelforge-hw token create --ttl 1h --uses 3 [--description TEXT] [--json]
    modelforge-hw token list [--json]
    modelforge-hw token revoke TOKEN_ID [--reason TEXT]
    modelforge-hw credential list [--node NODE] [--json]
    modelforge-hw credential revoke CREDENTIAL_ID [--reason TEXT]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from typing import Any

from api.cli.common import add_node_argument, table

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """'90', '90s', '15m', '1h', '7d' -> seconds."""
    m = _DURATION.match(text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (examples: 90s, 15m, 1h, 7d)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _services(pool: Any) -> Any:
    from api.wiring import build_services

    return build_services(pool)


def _run(args: argparse.Namespace, work: Callable[[Any], Any]) -> int:
    """A refusal (`api.services.errors`) reaches `api.cli.main`, which prints it as one line and
    exits with the code of its kind."""
    from api.cli.common import _config, _with_database, node_ref, resolve_node

    async def wrapped(pool: Any) -> int:
        if hasattr(args, "node"):
            args.node = await resolve_node(pool, node_ref(args))
        return int(await work(_services(pool)))

    return _with_database(_config(args), wrapped)


def _print_json(value: Any) -> None:
    import msgspec

    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")


def cmd_token_create(args: argparse.Namespace) -> int:
    async def work(services: Any) -> int:
        created = await services.enrollment.create_token(
            args.ttl, args.uses, args.description or "", actor="cli"
        )
        if args.json:
            _print_json(created)
        else:
            print(created.token)
            print(
                f"enrollment token {created.token_id}: {created.uses} use(s), expires "
                f"{created.expires_at.isoformat()} (shown once; give it to `modelforge-hw agent enroll`)",
                file=sys.stderr,
            )
        return 0

    return _run(args, work)


def cmd_token_list(args: argparse.Namespace) -> int:
    async def work(services: Any) -> int:
        tokens = await services.enrollment.list_tokens()
        if args.json:
            _print_json(tokens)
        elif not tokens:
            print("no enrollment tokens (create one with `modelforge-hw token create`)")
        else:
            table(
                ["TOKEN ID", "STATUS", "USES LEFT", "EXPIRES", "DESCRIPTION"],
                [
                    [
                        t.token_id,
                        t.status,
                        f"{t.uses_left}/{t.uses}",
                        t.expires_at.isoformat(timespec="seconds") if t.expires_at else "never",
                        t.description,
                    ]
                    for t in tokens
                ],
            )
        return 0

    return _run(args, work)


def cmd_token_revoke(args: argparse.Namespace) -> int:
    async def work(services: Any) -> int:
        token = await services.enrollment.revoke_token(args.token_id, args.reason, actor="cli")
        print(f"enrollment token {token.token_id}: {token.status}")
        return 0

    return _run(args, work)


def cmd_credential_list(args: argparse.Namespace) -> int:
    async def work(services: Any) -> int:
        credentials = await services.credentials.list_credentials(args.node)
        if args.json:
            _print_json(credentials)
        elif not credentials:
            print("no node credentials" + (f" for node {args.node}" if args.node else ""))
        else:
            table(
                ["CREDENTIAL ID", "STATUS", "NODE", "HOSTNAME", "ISSUED"],
                [
                    [
                        c.credential_id,
                        c.status,
                        c.node_id,
                        c.hostname,
                        c.issued_at.isoformat(timespec="seconds"),
                    ]
                    for c in credentials
                ],
                ids=(0, 2),
            )
        return 0

    return _run(args, work)


def cmd_credential_revoke(args: argparse.Namespace) -> int:
    async def work(services: Any) -> int:
        credential = await services.credentials.revoke_credential(
            args.credential_id, args.reason, actor="cli"
        )
        print(f"credential {credential.credential_id} of node {credential.node_id}: {credential.status}")
        return 0

    return _run(args, work)


def register(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add `token ...` and `credential ...` to the `modelforge-hw` parser."""
    token = sub.add_parser("token", help="enrollment tokens for agents")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    p = token_sub.add_parser("create", help="create an enrollment token (printed once)")
    common(p)
    p.add_argument(
        "--ttl", type=parse_duration, default=3600.0, help="lifetime: 90s, 15m, 1h, 7d (default 1h)"
    )
    p.add_argument("--uses", type=int, default=1, help="how many agents may enroll with it (default 1)")
    p.add_argument("--description", help="what the token is for (shown in `token list`)")
    p.add_argument("--json", action="store_true", help="print the token and its details as JSON")
    p.set_defaults(func=cmd_token_create)
    p = token_sub.add_parser("list", help="enrollment tokens (never their secrets)")
    common(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_token_list)
    p = token_sub.add_parser("revoke", help="revoke an enrollment token")
    common(p)
    p.add_argument("token_id")
    p.add_argument("--reason", default="revoked by an operator")
    p.set_defaults(func=cmd_token_revoke)

    cred = sub.add_parser("credential", help="node credentials of enrolled agents")
    cred_sub = cred.add_subparsers(dest="credential_command", required=True)
    p = cred_sub.add_parser("list", help="node credentials (never their secrets)")
    common(p)
    add_node_argument(p, required=False)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_credential_list)
    p = cred_sub.add_parser("revoke", help="revoke a node credential (its agent gets 401 and stops)")
    common(p)
    p.add_argument("credential_id")
    p.add_argument("--reason", default="revoked by an operator")
    p.set_defaults(func=cmd_credential_revoke)
