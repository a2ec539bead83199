"""Other work on the event loop beside a read: what an agent's report or another request waiting
on the server's one loop would get while the read runs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from itertools import pairwise
from types import TracebackType

import pytest


class OtherWork:
    """Counts its turns on the loop while the `async with` body runs: a read that lets the loop run
    between two steps shows a higher count at the second (`turns` read inside the read's steps)."""

    def __init__(self) -> None:
        self.turns = 0
        self._task: asyncio.Future[None] | None = None

    async def _run(self) -> None:
        while True:
            self.turns += 1
            await asyncio.sleep(0)

    async def __aenter__(self) -> OtherWork:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def ran_between(turns: Sequence[int]) -> bool:
    """The other work ran between every two steps whose counts these are."""
    return all(a < b for a, b in pairwise(turns))


def turns_at_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str, other: OtherWork) -> list[int]:
    """`module.name` wrapped to note the other work's turns at each of its calls (one per step)."""
    seen: list[int] = []
    inner = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args: seen.append(other.turns) or inner(*args))
    return seen
