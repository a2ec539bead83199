"""The product's server processes under load and the client that talks to them: `modelforge-hw
serve` started through the product's console script (this checkout's, or another checkout's for a
before/after run) with a known operator token, in a throwaway work directory, and a minimal
keep-alive HTTP/1.1 client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPERATOR_TOKEN = "bench-operator-token"


class HttpConnection:
    """A minimal keep-alive HTTP/1.1 client: requests pre-encoded, responses with Content-Length
    (what uvicorn sends) or chunked (a streamed one: /metrics). ~0.1 ms of CPU per request, a
    fraction of httpx's, so the load generator does not take the server's CPU on a small machine."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> HttpConnection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def request(
        self, method: bytes, path: bytes, headers: bytes = b"", body: bytes = b""
    ) -> tuple[int, bytes]:
        self.writer.write(
            b"%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\n%sContent-Length: %d\r\n\r\n%s"
            % (method, path, headers, len(body), body)
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        i = head.lower().find(b"\r\ncontent-length:")
        if i >= 0:
            n = int(head[i + 17 : head.index(b"\r\n", i + 2)])
            return status, await self.reader.readexactly(n)
        if b"\r\ntransfer-encoding: chunked\r\n" not in head.lower():
            raise ValueError(f"response without Content-Length or chunks: {head[:200]!r}")
        parts = []
        while n := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
            parts.append(await self.reader.readexactly(n))
            await self.reader.readexactly(2)
        await self.reader.readuntil(b"\r\n")  # the last chunk's line end (no trailers)
        return status, b"".join(parts)

    async def request_counted(
        self, method: bytes, path: bytes, headers: bytes = b""
    ) -> tuple[int, int, int, bytes]:
        """`request` of a body too big to keep: its bytes and lines counted as they arrive, and
        its first 300 bytes kept (for an error). Joined whole, a fleet's 400 MB scrape would hold
        this process's loop, and a probe beside it would count that wait as the server's."""
        self.writer.write(
            b"%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\n%sContent-Length: 0\r\n\r\n" % (method, path, headers)
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        size = lines = 0
        first = b""

        def counted(piece: bytes) -> None:
            nonlocal size, lines, first
            size += len(piece)
            lines += piece.count(b"\n")
            first = first or piece[:300]

        i = head.lower().find(b"\r\ncontent-length:")
        if i >= 0:
            left = int(head[i + 17 : head.index(b"\r\n", i + 2)])
            while left:
                piece = await self.reader.read(min(left, 1 << 20))
                if not piece:
                    raise ConnectionError("the response ended early")
                counted(piece)
                left -= len(piece)
            return status, size, lines, first
        if b"\r\ntransfer-encoding: chunked\r\n" not in head.lower():
            raise ValueError(f"response without Content-Length or chunks: {head[:200]!r}")
        while n := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
            counted(await self.reader.readexactly(n))
            await self.reader.readexactly(2)
        await self.reader.readuntil(b"\r\n")
        return status, size, lines, first

    def close(self) -> None:
        self.writer.close()


def bearer(token: str) -> bytes:
    return b"Authorization: Bearer %s\r\n" % token.encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Process:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def console_script(tree: Path = ROOT) -> list[str]:
    """The `modelforge-hw` entry point: for this checkout, the script installed next to this Python
    (else the entry-point object itself); for another checkout (`tree`, a baseline to compare
    with), the function its pyproject.toml names, imported from that tree by this Python."""
    if tree.resolve() != ROOT.resolve():
        import tomllib

        target = tomllib.loads((tree / "pyproject.toml").read_text())["project"]["scripts"]["modelforge-hw"]
        module, func = target.split(":")
        code = f"import sys; sys.path.insert(0, {str(tree)!r}); import {module} as m; sys.exit(m.{func}())"
        return [sys.executable, "-c", code]
    script = Path(sys.executable).parent / "modelforge-hw"
    if script.exists():
        return [str(script)]
    found = shutil.which("modelforge-hw")
    if found:
        return [found]
    return [
        sys.executable,
        "-c",
        "import sys; from importlib.metadata import entry_points; "
        "sys.exit(entry_points(group='console_scripts')['modelforge-hw'].load()())",
    ]


async def spawn(
    name: str, argv: list[str], port: int, probe: str, workdir: Path, env: dict[str, str], tree: Path = ROOT
) -> Process:
    """A server subprocess (its output into `<workdir>/<name>.log`), ready when `probe` answers 200."""
    log = workdir / f"{name}.log"
    with open(log, "wb") as out:  # noqa: ASYNC230 - before the loop has work
        proc = subprocess.Popen(  # noqa: ASYNC220
            argv,
            cwd=tree,
            env={**os.environ, "PYTHONPATH": str(tree), **env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    p = Process(name, proc, port, log)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, ValueError):
            conn = await HttpConnection.open(port)
            try:
                status, _ = await conn.request(b"GET", probe.encode())
            finally:
                conn.close()
            if status == 200:
                return p
        await asyncio.sleep(0.2)
    p.stop()
    raise RuntimeError(f"{name} did not answer {probe} within 90 s: {log.read_text()[-2000:]}")


async def start_product_server(
    dsn: str,
    workdir: Path,
    name: str = "server",
    *,
    log_level: str = "INFO",
    retention: bool = True,
    tree: Path = ROOT,
    settings: dict[str, str] | None = None,
) -> Process:
    """`modelforge-hw serve` on a free port of 127.0.0.1, on `dsn`, with a known operator token,
    exactly as an operator starts it (migrations, pools, the retention loop; `settings`: more
    MODELFORGE_* variables); from this checkout, or from another one (`tree`) to compare with."""
    port = free_port()
    env = {
        "MODELFORGE_DATABASE_URL": dsn,
        "MODELFORGE_ADMIN_TOKEN": OPERATOR_TOKEN,
        "MODELFORGE_STATE_DIR": str(workdir / f"state-{name}"),
        "MODELFORGE_NODE_ID": f"bench-{name}",
        "MODELFORGE_LOG_LEVEL": log_level,
        "MODELFORGE_LOG_JSON": "1",
    }
    if not retention:
        env["MODELFORGE_RETENTION_INTERVAL"] = "0"
    env.update(settings or {})
    argv = [*console_script(tree), "serve", "--host", "127.0.0.1", "--port", str(port)]
    return await spawn(name, argv, port, "/api/v1/health", workdir, env, tree)


@contextlib.asynccontextmanager
async def workdir(prefix: str, *, keep: bool) -> AsyncIterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=f"mf-bench-{prefix}-"))
    try:
        yield path
    finally:
        if keep:
            print(f"kept server logs in {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)
