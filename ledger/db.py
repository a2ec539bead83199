"""Connections: the asyncpg pool (msgspec-backed jsonb codecs) and the embedded PostgreSQL used
when no `MODELFORGE_DATABASE_URL` is configured. The schema and `migrate`: ledger/schema.py."""

from __future__ import annotations

import asyncio
import os
import warnings
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import structlog

log = structlog.get_logger(__name__)

_encode = msgspec.json.encode
_decode = msgspec.json.decode


def _jsonb_encode(value: Any) -> bytes:
    # jsonb's binary wire format is a version byte (1) followed by the JSON text.
    return b"\x01" + _encode(value)


def _jsonb_decode(data: bytes) -> Any:
    return _decode(data[1:])


async def init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec(
        "jsonb", encoder=_jsonb_encode, decoder=_jsonb_decode, schema="pg_catalog", format="binary"
    )
    await conn.set_type_codec(
        "json", encoder=lambda v: _encode(v).decode(), decoder=_decode, schema="pg_catalog"
    )


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """Release without the default reset query (a round trip on every release). Our code leaves no
    session state behind: transactions are context-managed (asyncpg rolls back an open one anyway),
    session advisory locks and settings are undone in `finally` blocks."""


# Seconds one connection attempt may take, for each way round the hosts of a multi-host URL.
CONNECT_TIMEOUT = 10.0


def hosts_rotated(dsn: str, turn: int) -> str:
    """The URL with its host list (`h1:p1,h2:p2`) turned so that host number `turn` comes first;
    a URL of one host, or not of the URL form, unchanged."""
    scheme, sep, rest = dsn.partition("://")
    if not sep:
        return dsn
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    userinfo, at, hosts = netloc.rpartition("@")
    parts = hosts.split(",")
    if len(parts) < 2:
        return dsn
    k = turn % len(parts)
    return f"{scheme}://{userinfo}{at}{','.join(parts[k:] + parts[:k])}{tail}"


class HostRotation:
    """asyncpg's connect timeout covers every host of a multi-host URL together, tried in order:
    a first host that drops packets (a failed primary not yet fenced) would use it all up on every
    new connection, and the promoted standby behind it would never be tried. So an attempt that
    times out is made again with the hosts turned by one, and later connections start from the
    host that answered."""

    def __init__(self, timeout: float = CONNECT_TIMEOUT) -> None:
        self.timeout = timeout
        self.first = 0

    async def connect(self, dsn: str, **kwargs: Any) -> asyncpg.Connection:
        hosts = len(dsn.partition("://")[2].split("/")[0].split("?")[0].split(","))
        for attempt in range(hosts):
            turn = self.first + attempt
            try:
                conn = await asyncpg.connect(hosts_rotated(dsn, turn), timeout=self.timeout, **kwargs)
            except TimeoutError:
                if attempt == hosts - 1:
                    raise
                log.warning("db.connect_timed_out", host_turn=turn % hosts, seconds=self.timeout)
                continue
            self.first = turn % hosts
            return conn
        raise AssertionError("unreachable")


async def create_pool(dsn: str, *, min_size: int = 1, max_size: int = 10) -> asyncpg.Pool:
    pool = await asyncpg.create_pool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        init=init_connection,
        reset=_keep_session,
        connect=HostRotation().connect,
    )
    assert pool is not None
    return pool


# Seconds a pool's close waits for its connections to be handed back before it cuts them.
POOL_CLOSE_SECONDS = 10.0


async def close_pool(pool: asyncpg.Pool, *, within: float | None = None) -> None:
    """Close `pool`: asyncpg's close waits for every connection to be handed back, for ever, so a
    connection some task never released would hold a process's shutdown. After `within` seconds
    (POOL_CLOSE_SECONDS) the connections still out are terminated (their transactions roll back),
    and that is logged."""
    within = POOL_CLOSE_SECONDS if within is None else within
    in_use = pool.get_size() - pool.get_idle_size()
    try:
        async with asyncio.timeout(within):
            await pool.close()
    except TimeoutError:
        pool.terminate()  # asyncpg's close terminates when cancelled too; this does not rely on it
        log.warning("pool.close_terminated", within_seconds=within, in_use_when_closing=in_use)


class EmbeddedPostgres:
    """A real PostgreSQL server (the `pgserver` package) whose data lives in the state directory.

    Started on demand, stopped by `stop()`; data survives restarts. It listens on a Unix socket
    only, so nothing needs to be free on 5432.
    """

    def __init__(self, state_dir: Path) -> None:
        self.data_dir = state_dir / "postgres"
        self._server: Any = None

    def start(self) -> str:
        with warnings.catch_warnings():
            # pgserver asks platformdirs for a runtime directory (for one lock file) when it is
            # imported; without XDG_RUNTIME_DIR (containers, cron, sudo) platformdirs warns and
            # falls back to /tmp/runtime-$UID, which serves. Not worth a warning per command.
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
            import pgserver  # a heavy import, and only needed without MODELFORGE_DATABASE_URL

        from runtime.supervisor import postmaster_running, prune_dead_handles

        self.data_dir.mkdir(parents=True, exist_ok=True)
        prune_dead_handles(self.data_dir)  # a killed process's pid would keep PostgreSQL running
        # pgserver reuses a server already running on this data directory (a CLI command beside
        # the server), else starts one; the log says which.
        running = postmaster_running(self.data_dir)
        self._server = pgserver.get_server(self.data_dir, cleanup_mode="stop")  # type: ignore[attr-defined]
        uri = str(self._server.get_uri())
        log.info(
            "embedded_postgres.joined" if running else "embedded_postgres.started",
            data_dir=str(self.data_dir),
        )
        return uri

    @property
    def server(self) -> Any:
        """The pgserver handle while started (runtime.supervisor watches it)."""
        return self._server

    def stop(self) -> None:
        """Leave PostgreSQL: pgserver stops it when this is the last process using it."""
        if self._server is not None:
            from runtime.supervisor import postmaster_running

            try:
                self._server.cleanup()
            finally:
                self._server = None
                event = (
                    "embedded_postgres.released"  # another process (the server) still uses it
                    if postmaster_running(self.data_dir)
                    else "embedded_postgres.stopped"
                )
                log.info(event, data_dir=str(self.data_dir))


def default_state_dir() -> Path:
    configured = os.environ.get("MODELFORGE_STATE_DIR")
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "modelforge"


class Database:
    """Resolves where the database is: `MODELFORGE_DATABASE_URL`, else the embedded server."""

    def __init__(self, url: str | None, state_dir: Path) -> None:
        self.url = url
        self.state_dir = state_dir
        self.embedded: EmbeddedPostgres | None = None

    def dsn(self) -> str:
        if self.url:
            return self.url
        if self.embedded is None:
            self.embedded = EmbeddedPostgres(self.state_dir)
        return self.embedded.start()

    def close(self) -> None:
        if self.embedded is not None:
            self.embedded.stop()
