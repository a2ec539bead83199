"""Counting the SQL statements, round trips and transactions a client sends PostgreSQL, on the
wire (docs/performance.md, "Counting SQL statements")."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit


@dataclass
class Statements:
    """Frontend messages seen by the counting proxy. `executions`: Execute messages plus simple
    Query messages (an `executemany` of 8 rows is 8 executions); `round_trips`: Sync messages
    plus simple queries (the times a client waits for PostgreSQL); `transactions`: COMMITs, plus
    statements run outside BEGIN (each its own implicit transaction, ended by its Sync)."""

    executions: int = 0
    round_trips: int = 0
    transactions: int = 0

    def __sub__(self, o: Statements) -> Statements:
        return Statements(
            self.executions - o.executions,
            self.round_trips - o.round_trips,
            self.transactions - o.transactions,
        )

    def copy(self) -> Statements:
        return Statements(self.executions, self.round_trips, self.transactions)


class StatementCounter:
    """A TCP proxy in front of PostgreSQL that parses the frontend side of the wire protocol and
    counts statements. pg_stat_statements would be the usual tool, but it must be preloaded at
    server start, which a shared PostgreSQL cannot be asked to do; counting on the wire is exact
    for every client that talks through the proxy, whatever the server's settings. It costs this
    process CPU and adds a hop, so it is used only in windows whose timings are not reported."""

    _SSL_REQUEST = 80877103
    _GSS_REQUEST = 80877104

    def __init__(self, target: str) -> None:
        u = urlsplit(target)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 5432
        # An embedded server (pgserver) is reached on a Unix socket named in the `host` parameter.
        socket_dir = dict(parse_qsl(u.query)).get("host", "")
        self.unix_socket = f"{socket_dir}/.s.PGSQL.{self.port}" if socket_dir.startswith("/") else None
        self.target = target
        self.counts = Statements()
        self.server: asyncio.base_events.Server | None = None
        self.listen_port = 0

    async def __aenter__(self) -> StatementCounter:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.listen_port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2):
                    await self.server.wait_closed()

    @property
    def dsn(self) -> str:
        """The target's DSN through this proxy (no TLS: the proxy must read the messages)."""
        u = urlsplit(self.target)
        auth = u.netloc.rsplit("@", 1)[0] + "@" if "@" in u.netloc else ""
        query = dict(parse_qsl(u.query))
        query.pop("host", None)
        query["sslmode"] = "disable"
        return urlunsplit((u.scheme, f"{auth}127.0.0.1:{self.listen_port}", u.path, urlencode(query), ""))

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.unix_socket is not None:
            up_reader, up_writer = await asyncio.open_unix_connection(self.unix_socket)
        else:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)

        async def downstream() -> None:
            with contextlib.suppress(Exception):
                while data := await up_reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        down = asyncio.create_task(downstream())
        try:
            # Untyped startup messages first (SSLRequest, GSSENCRequest, then StartupMessage).
            while True:
                head = await reader.readexactly(8)
                length, code = struct.unpack("!ii", head)
                rest = await reader.readexactly(length - 8)
                up_writer.write(head + rest)
                if code not in (self._SSL_REQUEST, self._GSS_REQUEST):
                    break
            in_block, implicit = False, False
            while True:
                head = await reader.readexactly(5)
                kind, length = head[:1], struct.unpack("!i", head[1:])[0]
                body = await reader.readexactly(length - 4)
                if kind == b"E":
                    self.counts.executions += 1
                    implicit = implicit or not in_block
                elif kind == b"S":
                    self.counts.round_trips += 1
                    self.counts.transactions += implicit
                    implicit = False
                elif kind == b"Q":
                    self.counts.executions += 1
                    self.counts.round_trips += 1
                    verb = body[:8].upper()
                    if verb.startswith((b"BEGIN", b"START")):
                        in_block = True
                    elif verb.startswith((b"COMMIT", b"ROLLBACK", b"END")):
                        in_block = False
                        self.counts.transactions += verb.startswith((b"COMMIT", b"END"))
                    elif not in_block:
                        self.counts.transactions += 1
                up_writer.write(head + body)
                await up_writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            up_writer.close()
            await asyncio.wait({down}, timeout=2)
            writer.close()
