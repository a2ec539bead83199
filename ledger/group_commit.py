"""Group commit: units of work of concurrent callers share one transaction.

An agent report is one short unit of work on its node's stream. Run one transaction each, every
report pays its own BEGIN and COMMIT round trips and its own WAL flush; at fleet rates those are
a fifth of the work. `GroupCommit.run` queues a unit of work and returns its result once the
transaction that ran it has committed, so an acknowledgement still means "stored" (a server
killed mid-batch acknowledged none of it, and the agents retry).

    * Batches form naturally, without a timer: while `concurrency` batches are running, new work
      waits; when one ends, the next takes everything waiting (up to `max_batch`). At low load a
      unit of work runs at once, alone.
    * Within a batch the units run one after another on one connection, in the order of their
      keys (stream ids; stable for one key), so batches take stream locks in one global order and
      never deadlock each other. Units of one stream see each other's writes, as in sequence.
    * Per-stream checks stay per stream: each unit locks its stream, reads its version, state and
      tombstone and decides alone. A unit that raises fails nobody else: the batch is rolled back
      and each of its units runs again in a transaction of its own, so every caller gets the
      outcome its unit has alone. Units must therefore be safe to run twice when the first run
      was rolled back (they read everything they decide on inside the transaction).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import asyncpg
import structlog

log = structlog.get_logger(__name__)

T = TypeVar("T")

Work = Callable[[asyncpg.Connection], Awaitable[T]]


class _Pending(Generic[T]):
    __slots__ = ("future", "key", "work")

    def __init__(self, key: str, work: Work[T], future: asyncio.Future[T]) -> None:
        self.key = key
        self.work = work
        self.future = future


class GroupCommit:
    def __init__(self, pool: asyncpg.Pool, *, max_batch: int = 32, concurrency: int = 2) -> None:
        if max_batch < 1 or concurrency < 1:
            raise ValueError("max_batch and concurrency must be at least 1")
        self.pool = pool
        self.max_batch = max_batch
        self.concurrency = concurrency
        self._waiting: list[_Pending[Any]] = []
        self._running = 0
        # Observability (exported by the server's metrics): transactions and units committed.
        self.batches = 0
        self.units = 0

    async def run(self, key: str, work: Work[T]) -> T:
        """Run `work(conn)` inside a transaction shared with other callers' units; its result
        once that transaction committed (its exception, having run alone, if it raised)."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Pending(key, work, future))
        if self._running < self.concurrency:
            self._running += 1
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting[: self.max_batch], self._waiting[self.max_batch :]
                batch.sort(key=lambda p: p.key)  # one lock order for every batch; stable per key
                if len(batch) == 1 or not await self._together(batch):
                    for pending in batch:
                        await self._alone(pending)
        finally:
            self._running -= 1

    async def _together(self, batch: list[_Pending[Any]]) -> bool:
        """Run the batch in one transaction; False (nothing committed, nobody answered) when any
        unit raised or the transaction failed."""
        results: list[Any] = []
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                for pending in batch:
                    results.append(await pending.work(conn))
        except Exception as exc:
            log.debug("group_commit.split", units=len(batch), error=type(exc).__name__)
            return False
        self.batches += 1
        self.units += len(batch)
        for pending, result in zip(batch, results, strict=True):
            if not pending.future.done():  # a caller that went away is not answered
                pending.future.set_result(result)
        return True

    async def _alone(self, pending: _Pending[Any]) -> None:
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                result = await pending.work(conn)
        except BaseException as exc:
            if not pending.future.done():
                pending.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        self.batches += 1
        self.units += 1
        if not pending.future.done():
            pending.future.set_result(result)
