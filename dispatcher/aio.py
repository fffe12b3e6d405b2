"""Small asyncio pieces: stopping background tasks, and waking many waiters at once."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None, *, reraise: bool = True) -> None:
    """Cancel a task and wait for it, re-raising a crash it had (unless its owner
    already handled that crash: ``reraise=False``).

    `asyncio.wait` rather than `await task`: the task's CancelledError must not
    escape, while a cancellation of the caller itself still propagates.
    """
    if task is None:
        return
    task.cancel()
    await asyncio.wait({task})
    if reraise and not task.cancelled() and (error := task.exception()) is not None:
        raise error


class Wakeup:
    """Wakes every waiter at once; firing costs nothing while nobody waits."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._waiting = 0

    async def wait(self, timeout_s: float) -> None:
        """Until fired, or ``timeout_s`` passed."""
        self._waiting += 1
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), timeout_s)
        finally:
            self._waiting -= 1

    def fire(self) -> None:
        if self._waiting:
            self._event.set()
            self._event = asyncio.Event()


def tune_gc() -> None:
    """Make the cyclic GC rare: its pauses, not our code, were the loop's longest stalls.

    A thousand rollouts in flight keep ~100k young container objects alive;
    with the default threshold (700 net allocations) the collector runs
    hundreds of times a second and its generation-1/2 passes stall the loop
    for 5-25 ms. Nearly everything a rollout allocates is freed by reference
    counting: collecting young objects every 20,000 net allocations (a pass
    then takes a few ms) and the old generation far more rarely loses nothing
    but pauses. Objects alive after imports and setup are frozen out of every
    pass.

    A generation-1 pass walks every object that outlived one young pass: all
    the rollouts in flight. At 10,000 in flight it took 483 ms and collected
    nothing (``bench/service.py --concurrency 10000 --latency-s 10``), once
    every 50 young passes; it now comes once every 1,000 (twenty times more
    rarely), which leaves cycles that outlive a young pass
    waiting longer to be freed, not uncollected.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 1000, 100)
