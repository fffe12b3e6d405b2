"""Small asyncio pieces: stopping background tasks, waking many waiters at once, and
starting an executor's threads before they are needed."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from concurrent.futures import Executor
from typing import Any

# How many threads the loop's default executor has at most (ThreadPoolExecutor's default).
DEFAULT_EXECUTOR_THREADS = min(32, (os.cpu_count() or 1) + 4)


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


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel tasks and wait for them together (one turn of the loop, not one a task),
    re-raising the first crash one had, in the list's order."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)
    for task in tasks:
        if not task.cancelled() and (error := task.exception()) is not None:
            raise error


async def first_of(task: asyncio.Task[Any], stops: list[asyncio.Task[Any]]) -> None:
    """Until ``task`` or one of ``stops`` is done; re-raises a crash of ``task``. The
    others go on (their owner cancels them)."""
    await asyncio.wait([task, *stops], return_when=asyncio.FIRST_COMPLETED)
    if task.done() and not task.cancelled() and (error := task.exception()) is not None:
        raise error


class Wakeup:
    """Wakes every waiter at once; firing costs nothing while nobody waits.

    Each waiter awaits a future of its own, which ``fire`` resolves: the waiter runs
    in the next turn of the loop. (``wait_for`` on an Event took three turns on
    Python 3.11, its inner task's and its done callback's, and at 10,000 in flight a
    turn lasts tens of ms; it also swallowed a cancellation that met a fire.)
    """

    def __init__(self) -> None:
        self._waiters: set[asyncio.Future[None]] = set()

    async def wait(self, timeout_s: float) -> None:
        """Until fired, or ``timeout_s`` passed."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        timer = loop.call_later(timeout_s, wake, waiter)
        self._waiters.add(waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiters.discard(waiter)

    def fire(self) -> None:
        if self._waiters:
            waiters, self._waiters = self._waiters, set()
            for waiter in waiters:
                wake(waiter)


async def start_threads(executor: Executor | None, count: int = 1) -> None:
    """Start ``count`` threads of ``executor`` (None: the loop's default) now.

    An executor starts a thread at a submit that finds none idle, and the submit
    waits until the new thread runs: under load, milliseconds of the loop's time
    each, which the first burst of submits after a start paid for every thread its
    work needed (the journal's, the folders', the bodies', the default executor's).
    Each of the ``count`` calls here holds its thread until all are submitted, so
    each submit finds no thread idle.
    """
    loop = asyncio.get_running_loop()
    release = threading.Event()
    held = [loop.run_in_executor(executor, release.wait) for _ in range(count)]
    release.set()
    await asyncio.gather(*held)


def wake(waiter: asyncio.Future[None] | None) -> None:
    """Resolve ``waiter`` unless there is none or it is done (cancelled, timed out)."""
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


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
