"""The change feed: wait for the log to move, then read it with the one gap-safe read.

A statement-level trigger on `events` sends `NOTIFY mf_log` (ledger/sql/functions/mf_notify_log.sql)
while some process listens (a listening feed registers its backend in `mf_feed_listeners`:
notifying transactions commit one at a time, so appends do not notify when nobody waits);
PostgreSQL delivers it when the appending transaction commits, to every server sharing the
database. A notification only wakes waiters: `read_log` still decides what is delivered, so a
wake-up that finds nothing (an older transaction still holds the horizon back) simply waits again.
Waiters also re-read on a short fallback interval, because the horizon can be released by a
transaction that appended nothing (and so notified nobody), and because a listening connection
can be lost.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import structlog

from ledger.reading import Checkpoint, LogFilter, LogPage, read_log

log = structlog.get_logger(__name__)

CHANNEL = "mf_log"
FALLBACK_POLL_SECONDS = 1.0


class LogFeed:
    """One LISTEN connection per process while anyone waits, fanned out to every waiter. With no
    waiter it holds no connection, so closing the pool never waits on the feed."""

    def __init__(self, pool: asyncpg.Pool, *, fallback_poll: float = FALLBACK_POLL_SECONDS) -> None:
        self.pool = pool
        self.fallback_poll = fallback_poll
        self._listener: asyncpg.Connection | None = None
        self._waiters = 0
        self._changed = asyncio.Event()
        self._lock = asyncio.Lock()
        self.polling = False  # the pool is a hot standby's: no notifications, only re-reads
        self.released = False  # the process is stopping: no wait holds

    def release(self) -> None:
        """The process is stopping: every waiter returns what it has now (an empty page resumes
        where it asked), and no later wait holds. A server's graceful shutdown waits for every
        request in flight, which a held page would hold up for as long as its `wait`."""
        self.released = True
        self._notified()

    def _notified(self, *_: Any) -> None:
        # Wake every current waiter; each re-reads and, if nothing is new, waits on a fresh event.
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _listen(self) -> None:
        async with self._lock:
            if self.polling or (self._listener is not None and not self._listener.is_closed()):
                return
            try:
                conn = await self.pool.acquire()
            except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
                log.warning("feed.listen_failed", error=str(exc))
                return
            settled = False  # kept as the listener, or handed back
            try:
                try:
                    await conn.add_listener(CHANNEL, self._notified)
                    # Appends notify only while a listener is registered (mf_notify_log); rows of
                    # backends that went away without deregistering are cleared on the way.
                    await conn.execute(
                        "DELETE FROM mf_feed_listeners l WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity a "
                        "WHERE a.pid = l.pid AND a.backend_start = l.backend_start)"
                    )
                    await conn.execute(
                        "INSERT INTO mf_feed_listeners (pid, backend_start) SELECT pid, backend_start "
                        "FROM pg_stat_activity WHERE pid = pg_backend_pid() ON CONFLICT (pid) DO UPDATE "
                        "SET backend_start = EXCLUDED.backend_start"
                    )
                except (OSError, asyncpg.PostgresError) as exc:
                    with contextlib.suppress(OSError, asyncpg.PostgresError):
                        await conn.remove_listener(CHANNEL, self._notified)
                    settled = True
                    await self.pool.release(conn)
                    if isinstance(exc, asyncpg.ReadOnlySQLTransactionError):
                        # A hot standby (a read standby) can neither LISTEN nor register: its waiters
                        # re-read every `fallback_poll` seconds instead, which is what they get anyway.
                        self.polling = True
                        log.info("feed.polling_standby", every_seconds=self.fallback_poll)
                        return
                    log.warning("feed.listen_failed", error=str(exc))
                    return
                self._listener = conn
                settled = True
            finally:
                if not settled:
                    await self._discard(conn)

    async def _unlisten(self) -> None:
        async with self._lock:
            conn, self._listener = self._listener, None
            if conn is None:
                return
            settled = False
            try:
                if not conn.is_closed():
                    with contextlib.suppress(OSError, asyncpg.PostgresError):
                        await conn.execute("DELETE FROM mf_feed_listeners WHERE pid = pg_backend_pid()")
                        await conn.remove_listener(CHANNEL, self._notified)
                settled = True
                await self.pool.release(conn)
            finally:
                if not settled:
                    await self._discard(conn)

    async def _discard(self, conn: asyncpg.Connection) -> None:
        """The waiter was cancelled half way through registering or deregistering: the connection
        may still listen or be registered, so it is closed, not pooled (its registration ends with
        its backend), and handed back all the same, or closing the pool would wait on it for ever.
        The pool's release is shielded from cancellation."""
        conn.terminate()
        await self.pool.release(conn)

    @contextlib.asynccontextmanager
    async def _waiting(self) -> AsyncIterator[None]:
        self._waiters += 1
        try:
            await self._listen()
            yield
        finally:
            self._waiters -= 1
            if self._waiters == 0:
                await self._unlisten()

    async def _read(self, after: Checkpoint, limit: int, where: LogFilter | None) -> LogPage:
        async with self.pool.acquire() as conn:
            return await read_log(conn, after, limit=limit, where=where)

    async def wait(
        self,
        after: Checkpoint,
        *,
        limit: int,
        where: LogFilter | None = None,
        wait_seconds: float,
        any_commit: bool = False,
    ) -> LogPage:
        """The next page after `after`: at once if the log already holds events past it, else as
        soon as one commits, else an empty page (resuming at `after`) once `wait_seconds` have passed.
        `any_commit`: also return at the first notification, even when the read does not deliver
        its events yet (an older transaction holds the horizon), for a waiter that only needs to
        know the log moved and must not keep appends notifying while it does."""
        page = await self._read(after, limit, where)
        if page.entries or wait_seconds <= 0 or self.released:
            return page
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_seconds
        async with self._waiting():
            while True:
                changed = self._changed  # taken before the read: a commit during it still wakes us
                page = await self._read(after, limit, where)
                remaining = deadline - loop.time()
                if page.entries or remaining <= 0 or self.released:
                    return page
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(remaining, self.fallback_poll)):
                        await changed.wait()
                if any_commit and changed.is_set():
                    return await self._read(after, limit, where)
                if not self.polling and (self._listener is None or self._listener.is_closed()):
                    await self._listen()  # the listening connection was lost: take another
