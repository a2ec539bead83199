"""Group commit: units of work of concurrent callers share one transaction and its statements.

An agent report is one short unit of work on its node's stream. Run one transaction each, every
report paid its own BEGIN and COMMIT, its own WAL flush and five statements of its own; at fleet
rates that overhead is most of the work. `GroupCommit.run(key, item)` queues an item and returns
its outcome once the transaction that handled it has committed, so an acknowledgement still means
"stored" (a server killed mid-batch acknowledged none of it, and the agents retry).

    * Batches form naturally, without a timer: while `concurrency` batches are running, new items
      wait; when one ends, the next takes what is waiting (up to `max_batch`, one item per key:
      a later item of the same key waits for the next batch, so it sees the first one's writes).
      With `share=True` a batch takes only its share of what waits when other lanes are free
      too, so that callers who come back together (answered by one batch, like a fixed set of
      writers) fill transactions that run side by side rather than one after the other. Without
      it (callers that arrive independently, like HTTP requests) a lane beyond the first opens
      only once a full batch (`max_batch`) waits: while one transaction runs, what arrives waits
      for the next, so batches stay as large as they come, which costs both sides less per item
      (a free lane taking whatever waits makes several small transactions where one would do:
      docs/capacity.md), and a lane held up (a lock, a slow commit) holds the rest up for at
      most a batch's worth of arrivals.
      At low load an item runs at once, alone.
    * The handler gets the batch's items sorted by key (stream ids) and one connection inside
      the batch's transaction, and returns one outcome per item: its result, or the exception
      that refuses it. A refused item must have written nothing (refusals are decided before the
      writes); the others are committed together. Sorted keys mean batches take stream locks in
      one global order and never deadlock each other.
    * An optional `outside` handler gets the batch first, on a connection outside a transaction
      block: a handler whose writes are one statement (its own transaction) answers there, or
      answers None having written nothing, and the batch goes to `handler` in a transaction.
      One that raises must have written nothing either (its statement failed whole): the batch
      is handled as below.
    * A handler that raises (an unexpected database error, a conflict) fails nobody else: the
      batch is rolled back and each of its items is handled again alone, in a transaction of its
      own, so every caller gets the outcome its item has alone. Handlers must therefore decide
      only on what they read inside the transaction, or raise TryAgain once they find that what
      they decided on was not what the transaction reads (the item then runs again alone).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

import asyncpg
import structlog

log = structlog.get_logger(__name__)

I = TypeVar("I")  # noqa: E741 - the item type
R = TypeVar("R")


class TryAgain(Exception):
    """Raised by a handler that found, after writing, that it decided on something no longer
    true (a guess it confirms late, like a kept copy of a row): the transaction is rolled back and
    the item handled again, alone. The handler must have dropped what misled it, so that the next
    run decides on what it reads; an item that asks again on its last run fails with this."""


# A handler that asks to try again has dropped its guess: the second run reads, so two suffice.
_ATTEMPTS_ALONE = 2

Handler = Callable[[asyncpg.Connection, Sequence[I]], Awaitable[Sequence[R | BaseException]]]
# A handler outside a transaction block: the outcomes, or None where it wrote nothing.
OutsideHandler = Callable[[asyncpg.Connection, Sequence[I]], Awaitable[Sequence[R | BaseException] | None]]


def _fail(future: asyncio.Future[R], exc: BaseException) -> None:
    if future.done():
        return
    if isinstance(exc, asyncio.CancelledError):
        future.cancel()
    else:
        future.set_exception(exc)


class _Pending(Generic[I, R]):
    __slots__ = ("future", "item", "key")

    def __init__(self, key: str, item: I, future: asyncio.Future[R]) -> None:
        self.key = key
        self.item = item
        self.future = future


class GroupCommit(Generic[I, R]):
    def __init__(
        self,
        pool: asyncpg.Pool,
        handler: Handler[I, R],
        *,
        max_batch: int = 32,
        concurrency: int = 2,
        share: bool = False,
        outside: OutsideHandler[I, R] | None = None,
    ) -> None:
        if max_batch < 1 or concurrency < 1:
            raise ValueError("max_batch and concurrency must be at least 1")
        self.pool = pool
        self.handler = handler
        self.outside = outside
        self.max_batch = max_batch
        self.concurrency = concurrency
        self.share = share
        self._waiting: list[_Pending[I, R]] = []
        self._running = 0
        self._busy = 0  # lanes inside a transaction
        self._drains: set[asyncio.Task[None]] = set()  # referenced, so none is collected midway
        self._loop: asyncio.AbstractEventLoop | None = None
        # Observability (the server's /metrics): transactions committed and items they committed.
        self.batches = 0
        self.units = 0

    async def run(self, key: str, item: I) -> R:
        """Handle `item` in a transaction shared with other callers' items; its result once that
        transaction committed, or the exception that refused it."""
        # The loop this runs on, asked of asyncio only when the one kept is not running (a new
        # loop: tests start one each): asking costs a system call (getpid) every time.
        loop = self._loop
        if loop is None or not loop.is_running():
            loop = self._loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._waiting.append(_Pending(key, item, future))
        if self._running == 0 or (
            self._running < self.concurrency and (self.share or len(self._waiting) >= self.max_batch)
        ):
            self._running += 1
            drain = loop.create_task(self._drain())
            self._drains.add(drain)
            drain.add_done_callback(self._drains.discard)
        return await future

    def _take(self) -> list[_Pending[I, R]]:
        limit = self.max_batch
        if self.share:
            # This lane's share of what waits: the lanes not inside a transaction (this one too) split it.
            free = max(1, self.concurrency - self._busy)
            limit = min(limit, -(-len(self._waiting) // free))
        batch: list[_Pending[I, R]] = []
        keys: set[str] = set()
        rest: list[_Pending[I, R]] = []
        for pending in self._waiting:
            if len(batch) < limit and pending.key not in keys:
                keys.add(pending.key)
                batch.append(pending)
            else:
                rest.append(pending)
        self._waiting = rest
        return sorted(batch, key=lambda p: p.key)

    async def _drain(self) -> None:
        batch: list[_Pending[I, R]] = []
        try:
            while self._waiting:
                batch = self._take()
                self._busy += 1
                try:
                    if len(batch) == 1 or not await self._together(batch):
                        for pending in batch:
                            await self._alone(pending)
                finally:
                    self._busy -= 1
        except BaseException as exc:
            # Cancelled (the server stops) or a bug here: no caller of this batch waits forever.
            for pending in batch:
                _fail(pending.future, exc)
            raise
        finally:
            self._running -= 1

    async def _together(self, batch: list[_Pending[I, R]]) -> bool:
        """Handle the batch in one statement (`outside`) or one transaction; False (nothing
        committed, nobody answered) when a handler raised or the transaction failed."""
        try:
            async with self.pool.acquire() as conn:
                outcomes = await self._outside(conn, batch)
                if outcomes is None:
                    async with conn.transaction():
                        outcomes = self._checked(batch, await self.handler(conn, [p.item for p in batch]))
        except Exception as exc:  # any failure: every item is handled again, alone
            log.debug("group_commit.split", units=len(batch), error=type(exc).__name__)
            return False
        self._answer(batch, outcomes)
        return True

    async def _outside(
        self, conn: asyncpg.Connection, batch: list[_Pending[I, R]]
    ) -> Sequence[R | BaseException] | None:
        if self.outside is None:
            return None
        outcomes = await self.outside(conn, [p.item for p in batch])
        if outcomes is not None and len(outcomes) != len(batch):
            # Committed already: answered as a defect, never handled again.
            exc = RuntimeError(f"the handler answered {len(outcomes)} of {len(batch)} items")
            return [exc] * len(batch)
        return outcomes

    @staticmethod
    def _checked(
        batch: list[_Pending[I, R]], outcomes: Sequence[R | BaseException]
    ) -> Sequence[R | BaseException]:
        # Inside the transaction: a handler that answers the wrong number of items commits nothing.
        if len(outcomes) != len(batch):
            raise RuntimeError(f"the handler answered {len(outcomes)} of {len(batch)} items")
        return outcomes

    async def _alone(self, pending: _Pending[I, R]) -> None:
        for attempt in range(1, _ATTEMPTS_ALONE + 1):
            try:
                async with self.pool.acquire() as conn:
                    outcomes = await self._outside(conn, [pending]) if attempt == 1 else None
                    if outcomes is None:
                        async with conn.transaction():
                            outcomes = self._checked([pending], await self.handler(conn, [pending.item]))
            except TryAgain as exc:
                log.debug("group_commit.try_again", attempt=attempt, reason=str(exc))
                if attempt < _ATTEMPTS_ALONE:
                    continue
                _fail(pending.future, exc)
                return
            except BaseException as exc:
                _fail(pending.future, exc)
                if not isinstance(exc, Exception):
                    raise
                return
            self._answer([pending], outcomes)
            return

    def _answer(self, batch: list[_Pending[I, R]], outcomes: Sequence[R | BaseException]) -> None:
        self.batches += 1
        for pending, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if not pending.future.done():
                    pending.future.set_exception(outcome)
                continue
            self.units += 1
            if not pending.future.done():  # a caller that went away is not answered
                pending.future.set_result(outcome)
