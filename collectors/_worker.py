"""A bounded, single-flight worker thread for collection calls that may hang.

NVML calls (and `statvfs` on a dead network mount) can block in the kernel for minutes and cannot
be interrupted from Python. So the work runs in a daemon thread and the caller waits at most the
deadline; a hung thread is left to finish on its own, and no second one is started behind it, so a
wedged driver costs one thread, not one per refresh.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class WorkerBusy(Exception):
    """The previous call has not returned yet (it is hung); nothing new was started."""


class WorkerTimeout(Exception):
    """The call did not return within the deadline; it keeps running in its thread."""


class SingleFlightWorker(Generic[T]):
    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._in_flight: Future[T] | None = None

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._in_flight is not None and not self._in_flight.done()

    def _start(self, work: Callable[[], T]) -> Future[T]:
        with self._lock:
            if self._in_flight is not None and not self._in_flight.done():
                raise WorkerBusy(f"{self._name}: previous call still running")
            future: Future[T] = Future()
            future.set_running_or_notify_cancel()
            self._in_flight = future

        def run() -> None:
            try:
                result = work()
            except BaseException as err:  # handed to the waiter, who decides what it means
                future.set_exception(err)
            else:
                future.set_result(result)

        # Daemon: a thread stuck in the driver must not keep the process from exiting.
        threading.Thread(target=run, name=self._name, daemon=True).start()
        return future

    def call(self, work: Callable[[], T], timeout_seconds: float) -> T:
        """Run `work` in the worker thread; raise WorkerTimeout or WorkerBusy instead of blocking."""
        future = self._start(work)
        try:
            return future.result(timeout=timeout_seconds)
        except TimeoutError:
            if future.done():  # the work itself raised TimeoutError
                return future.result()
            raise WorkerTimeout(f"{self._name}: no answer within {timeout_seconds}s") from None

    async def call_async(self, work: Callable[[], T], timeout_seconds: float) -> T:
        """As `call`, without blocking the event loop."""
        future = self._start(work)
        wrapped = asyncio.wrap_future(future)
        # After a timeout nobody awaits `wrapped`; mark its outcome retrieved so a late failure is
        # not logged as "exception was never retrieved".
        wrapped.add_done_callback(_consume)
        try:
            # shield: a timeout must not try to cancel the (uncancellable) running thread's future.
            async with asyncio.timeout(timeout_seconds):
                return await asyncio.shield(wrapped)
        except TimeoutError:
            if future.done():
                return future.result()
            raise WorkerTimeout(f"{self._name}: no answer within {timeout_seconds}s") from None


def _consume(future: asyncio.Future[T]) -> None:
    if not future.cancelled():
        future.exception()
