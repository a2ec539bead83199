"""A task cancelled in the very turn of the event loop in which it is woken: the race in which
`asyncio.wait_for` on Python 3.11 loses the cancellation to the wake-up."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def cancel_as_it_wakes(
    task: asyncio.Task[object], waiting: Callable[[], bool], wake: Callable[[], None]
) -> None:
    """Once `task` waits (`waiting()`), wake it and cancel it on the turn its wake-up runs; it
    must end cancelled within 10 s."""
    for _ in range(500):
        if waiting():
            break
        await asyncio.sleep(0.01)
    assert waiting(), "the task never came to wait"
    wake()  # the wake-up runs on the loop's next turn...
    await asyncio.sleep(0)
    task.cancel()  # ...where the cancellation meets it
    await asyncio.wait({task}, timeout=10)
    assert task.cancelled(), "the cancelled task went on"
