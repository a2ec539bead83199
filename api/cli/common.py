"""What every subcommand module of the CLI shares: the configuration from flags and environment,
a migrated database for one command, and the one table from the services' error kinds to exit
codes."""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec

from api.config import ServerConfig
from api.services.errors import Conflict, DomainError, Gone, NotFound
from ledger.db import Database
from runtime.settings import add_flag


class CliError(Exception):
    """One line for the operator: what went wrong and what to do next."""


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_moment(text: str, now: datetime) -> datetime:
    """An ISO 8601 time (without an offset: UTC, the ledger's clock) or a duration before `now`
    (`90s`, `15m`, `1h`, `2d`, `1w`)."""
    match = _DURATION.match(text)
    if match:
        return now - timedelta(seconds=float(match.group(1)) * _UNIT_SECONDS[match.group(2)])
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError as exc:
        raise CliError(
            f"{text!r} is neither an ISO 8601 time (2026-11-24T14:00:00Z) nor a duration (30m, 1h, 2d)"
        ) from exc
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


# The one table from the services' error kinds to exit codes: 3 refused because the state moved
# on or something blocks it; 4 gone for good (a decommissioned node); 5 unknown; 2 any other refusal.
EXIT_CODES: dict[type[DomainError], int] = {Conflict: 3, Gone: 4, NotFound: 5}


def exit_code_of(exc: DomainError) -> int:
    for kind in type(exc).__mro__:
        if kind in EXIT_CODES:
            return EXIT_CODES[kind]
    return 2


def add_setting(p: argparse.ArgumentParser, name: str) -> None:
    """The option's flag (type, variable and default from the one model)."""
    add_flag(p, name)


def _config(args: argparse.Namespace) -> ServerConfig:
    """The variables (or defaults), then every flag given on this command line."""
    config = ServerConfig.from_env()
    for field in msgspec.structs.fields(ServerConfig):
        value = getattr(args, field.name, None)
        if value is not None:
            setattr(config, field.name, value)
    return config


def _with_database(config: ServerConfig, work: Callable[[Any], Awaitable[int]]) -> int:
    """Run `work(pool)` against the configured (or embedded) database, migrated."""
    from api.http.server import open_pool

    database = Database(config.database_url, config.state_dir)

    async def run() -> int:
        pool = await open_pool(config, database)
        try:
            return await work(pool)
        finally:
            await pool.close()

    try:
        return asyncio.run(run())
    finally:
        database.close()


NODE_HELP = "node: id, id prefix, hostname or identity key"


def add_node_argument(p: argparse.ArgumentParser, *, positional: bool = False, required: bool = True) -> None:
    """`--node` names a node on every command; commands that took a positional NODE keep it."""
    if positional:
        p.add_argument("node_ref", nargs="?", metavar="NODE", help=f"{NODE_HELP} (or --node)")
    p.add_argument(
        "--node", dest="node", help=NODE_HELP + ("" if positional or not required else " (required)")
    )
    p.set_defaults(node_required=required)


def node_ref(args: argparse.Namespace) -> str | None:
    ref: str | None = getattr(args, "node", None) or getattr(args, "node_ref", None)
    if ref is None and getattr(args, "node_required", False):
        raise CliError("name a node: --node ID, an id prefix, a hostname or an identity key")
    return ref


async def resolve_node(pool: Any, ref: str | None) -> str | None:
    """One node id for what an operator typed: the id itself, an identity key, an id prefix or a
    hostname. Ambiguous -> a CliError listing the candidates; nothing matches -> `ref` unchanged,
    so that the service answers with its own "no node" refusal."""
    if ref is None:
        return None
    from domain.node import node_id_for

    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT node_id, hostname FROM hw_nodes"
            " WHERE node_id = $1 OR node_id = $2"
            " OR node_id LIKE $3 OR hostname = $1 OR identity_key = $1"
            " ORDER BY node_id LIMIT 11",
            ref,
            node_id_for(ref),
            ref.lower().replace("%", "").replace("_", "") + "%",
        )
    exact = [r["node_id"] for r in rows if r["node_id"] in (ref, node_id_for(ref))]
    if exact:
        return str(exact[0])
    if len(rows) == 1:
        return str(rows[0]["node_id"])
    if len(rows) > 1:
        listed = ", ".join(f"{r['node_id'][:12]} ({r['hostname'] or 'no hostname'})" for r in rows[:10])
        raise CliError(f"{ref!r} matches {len(rows)} nodes: {listed}; give more of the id")
    return ref


def erase_progress() -> None:
    """Clear the progress line a command drew on a terminal, so only results stay on screen."""
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()


def fit_widths(natural: list[int], fixed: set[int], available: int, *, least: int = 3) -> list[int]:
    """Column widths that fit `available`: the `fixed` columns keep their natural width; the widest
    of the others are cut first, down to one common cap (never below `least`)."""
    free = [i for i in range(len(natural)) if i not in fixed]
    budget = available - sum(natural[i] for i in fixed)
    if sum(natural[i] for i in free) <= budget or not free:
        return list(natural)
    cap = max((natural[i] for i in free), default=least)
    while cap > least and sum(min(natural[i], cap) for i in free) > budget:
        cap -= 1
    return [natural[i] if i in fixed else min(natural[i], cap) for i in range(len(natural))]


def table(
    header: list[str], rows: list[list[str]], *, ids: tuple[int, ...] = (0,), wrap: tuple[int, ...] = ()
) -> None:
    """A table as wide as the terminal (or $COLUMNS, else 80 when not a terminal: rich's rule).
    Identifier columns (`ids`) are never cut, so they can be copied; `wrap` columns fold onto more
    lines; the others are cut, widest first, and end in an ellipsis."""
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=False, highlight=False)
    natural = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]
    gaps = 2 * (len(header) - 1)  # the padding rich puts between columns
    widths = fit_widths(natural, set(ids) | set(wrap), console.width - gaps)
    if wrap:
        # A folding column takes what the others leave.
        rest = console.width - gaps - sum(w for i, w in enumerate(widths) if i not in wrap)
        for i in wrap:
            widths[i] = max(10, min(natural[i], rest // len(wrap)))
    t = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for i, h in enumerate(header):
        if i in wrap:
            t.add_column(h, width=widths[i], overflow="fold")
        else:
            t.add_column(h, width=widths[i], no_wrap=True, overflow="ellipsis")
    for r in rows:
        t.add_row(*r)
    console.print(t)
