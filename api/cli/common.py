"""What the commands on the server host share: their options that are settings, the configuration
from flags and variables, a migrated database for one command, and a node named the way an
operator names it.

The command modules import the services and the ledger when a command runs, not when the command
line is read: every TAB of shell completion runs the program."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from api.cli.errors import CliError
from runtime.logs import configure_logging_from_settings
from runtime.options import setting_option

if TYPE_CHECKING:
    from api.config import ServerConfig

# The options every database command takes.
DatabaseUrl = Annotated[str | None, setting_option("database_url")]
StateDir = Annotated[Path | None, setting_option("state_dir")]
LogLevel = Annotated[str | None, setting_option("log_level")]
# Options more than one command takes.
NodeId = Annotated[str | None, setting_option("node_id")]
CollectorTimeout = Annotated[float | None, setting_option("collector_timeout")]
RetentionHours = Annotated[float | None, setting_option("retention_hours")]

NODE_HELP = "node: id, id prefix, hostname or identity key"
NodeOption = Annotated[str | None, typer.Option("--node", help=NODE_HELP, show_default=False)]
# Commands that took a positional NODE keep it beside `--node`.
NodeArgument = Annotated[
    str | None, typer.Argument(metavar="NODE", help=f"{NODE_HELP} (or --node)", show_default=False)
]


def json_flag(help: str | None = None) -> Any:
    return typer.Option("--json", help=help)


def server_config(**flags: object) -> ServerConfig:
    """The variables (or defaults), then every flag given on this command line; logging at the
    level they choose."""
    from api.config import ServerConfig

    config = ServerConfig.from_env()
    for name, value in flags.items():
        if value is not None:
            setattr(config, name, value)
    configure_logging_from_settings(config.log_level)
    return config


def with_database(config: ServerConfig, work: Callable[[Any], Awaitable[int]]) -> int:
    """Run `work(pool)` against the configured (or embedded) database, migrated."""
    from api.http.server import open_pool
    from ledger.db import Database, close_pool

    database = Database(config.database_url, config.state_dir)

    async def run() -> int:
        pool = await open_pool(config, database)
        try:
            return await work(pool)
        finally:
            await close_pool(pool)

    try:
        return asyncio.run(run())
    finally:
        database.close()


def required_node(positional: str | None, option: str | None) -> str:
    """The node a command must name, given as NODE or as `--node`."""
    ref = option or positional
    if ref is None:
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
