"""Supervision of the embedded PostgreSQL (`pgserver`), for a server that owns it.

- The postmaster is watched once a second. When it is gone (killed, crashed) it is started again
  on the same data directory: PostgreSQL replays its WAL (crash recovery), the pool's broken
  connections are replaced on their next use, and the server serves again. Requests meanwhile
  answer 503 (the API maps connection errors to it).
- When it cannot be started again within `attempts`, `on_give_up` is called: the server then exits
  non-zero, so systemd (`Restart=on-failure`) or compose (`restart:`) starts it afresh.
- pgserver counts the processes using a data directory in `.handle_pids.json` and stops PostgreSQL
  when the last one leaves. A process killed with SIGKILL never leaves, so its pid would keep the
  count above one forever and every later clean stop would leave PostgreSQL running. Pids of
  processes that no longer exist are dropped before a server joins.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import structlog

log = structlog.get_logger(__name__)

HANDLE_PIDS_FILE = ".handle_pids.json"


def _pgserver_lock() -> Any:
    from pgserver.postgres_server import PostgresServer  # heavy; only for the embedded database

    return PostgresServer._lock


def prune_dead_handles(data_dir: Path) -> list[int]:
    """Drop from pgserver's handle list the pids of processes that are gone; returns them."""
    path = data_dir / HANDLE_PIDS_FILE
    if not path.exists():
        return []
    with _pgserver_lock():
        try:
            pids = [int(p) for p in json.loads(path.read_text())]
        except (ValueError, TypeError):
            pids = []  # unreadable: pgserver would fail on it; start from an empty list
        keep = [p for p in pids if p == os.getpid() or _running(p)]
        dead = [p for p in pids if p not in keep]
        if dead:
            path.write_text(json.dumps(keep))
    if dead:
        log.warning("embedded_postgres.stale_handles_dropped", pids=dead, data_dir=str(data_dir))
    return dead


def postmaster_running(data_dir: Path) -> bool:
    """Whether a PostgreSQL runs on the data directory (its postmaster.pid names a live process)."""
    try:
        pid = int((data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return False
    return _running(pid)


def _running(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def postmaster_alive(server: Any) -> bool:
    """Whether the postmaster this pgserver handle started (or joined) still runs. psutil's
    process handle remembers the start time, so a reused pid does not pass for it."""
    info = getattr(server, "_postmaster_info", None)
    process = getattr(info, "process", None)
    if process is None:
        return False
    try:
        if process.status() != psutil.STATUS_ZOMBIE and process.is_running():
            return True
    except psutil.Error:
        return False
    # A zombie: it was our child (we run as PID 1 in a container); reap it.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(process.pid, os.WNOHANG)
    return False


def restart_postmaster(server: Any) -> str:
    """Start PostgreSQL again on the handle's data directory (crash recovery included); its URI."""
    old = getattr(getattr(server, "_postmaster_info", None), "process", None)
    if old is not None:
        # Until the dead postmaster is reaped, pgserver takes it for running and starts nothing.
        with contextlib.suppress(psutil.Error):
            old.wait(timeout=5)
    with _pgserver_lock():
        server.ensure_postgres_running()
    if not postmaster_alive(server):
        raise RuntimeError("the postmaster did not come back")
    return str(server.get_uri())


class EmbeddedSupervisor:
    """Watches one pgserver handle; restarts its postmaster, or gives up via `on_give_up`."""

    def __init__(
        self,
        server: Any,
        dsn: str,
        *,
        on_give_up: Callable[[], None],
        interval: float = 1.0,
        attempts: int = 5,
    ) -> None:
        self.server = server
        self.dsn = dsn
        self.on_give_up = on_give_up
        self.interval = interval
        self.attempts = attempts
        self.restarts = 0
        self.gave_up = False

    async def run(self) -> None:
        while not self.gave_up:
            await asyncio.sleep(self.interval)
            if not await asyncio.to_thread(postmaster_alive, self.server):
                await self.recover()

    async def recover(self) -> None:
        info = getattr(self.server, "_postmaster_info", None)
        log.error("embedded_postgres.died", pid=getattr(info, "pid", None))
        for attempt in range(1, self.attempts + 1):
            try:
                dsn = await asyncio.to_thread(restart_postmaster, self.server)
            except Exception as exc:  # pgserver raises what pg_ctl and its own asserts raise
                log.warning(
                    "embedded_postgres.restart_failed", attempt=attempt, error=f"{type(exc).__name__}: {exc}"
                )
                if attempt < self.attempts:
                    # The dead postmaster's backends may still hold its shared memory for a moment.
                    await asyncio.sleep(min(0.5 * 2**attempt, 8.0))
                continue
            if dsn != self.dsn:
                # The pool cannot follow a new address; a fresh process will find it.
                log.error("embedded_postgres.address_changed", attempt=attempt)
                break
            self.restarts += 1
            log.info("embedded_postgres.restarted", attempt=attempt, restarts=self.restarts)
            return
        self.gave_up = True
        log.error("embedded_postgres.gave_up", attempts=self.attempts)
        self.on_give_up()


async def run_with_supervisor(main: Any, supervisor: EmbeddedSupervisor | None) -> None:
    """Await `main` (the server) with the supervisor watching beside it, stopped with it."""
    task = asyncio.create_task(supervisor.run()) if supervisor is not None else None
    try:
        await main
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
