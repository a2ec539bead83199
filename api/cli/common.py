"""What every subcommand module of the CLI shares: the configuration from flags and environment,
a migrated database for one command, and the one table from the services' error kinds to exit
codes."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from api.config import ServerConfig
from api.services.errors import Conflict, DomainError, Gone, NotFound
from ledger.db import Database
from ledger.settings import add_flag


class CliError(Exception):
    """One line for the operator: what went wrong and what to do next."""


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
