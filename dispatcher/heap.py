"""Giving freed heap memory back to the system, after a job of a long-lived daemon ends.

A finished job's rows are freed (contracts §12), but glibc keeps what was freed in
its heaps, one per thread that allocated (the rows are parsed in worker threads),
until the top of a heap is free: the daemon's resident memory stays at the peak of
its busiest moment, for days. ``malloc_trim(0)`` hands the free pages back
(``madvise``), in every heap. It takes milliseconds on a heap of hundreds of
megabytes, so it runs in a thread, at most once every ``MIN_INTERVAL_S``; where the C
library has no ``malloc_trim`` (musl, macOS) it is a no-op.

A trim gives back the free pages, not the pages that a few live chunks hold. With a
heap per thread, every thread that ever ran a job's file work (the default executor's,
the bodies', the index's, the journal's, the streams' readers) keeps its own heap,
each fragmented its own way: a daemon that ran 20,000 small jobs held 5 MB more in
them, and the more jobs, the more. ``one_heap()``, called before any thread starts,
gives every thread the main heap: what one thread frees, the next one reuses.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import time
from collections.abc import Callable

MIN_INTERVAL_S = 1.0
# mallopt's parameter: the most heaps ("arenas") glibc makes.
M_ARENA_MAX = -8


def one_heap() -> bool:
    """Every thread allocates from the main heap (glibc; elsewhere nothing is done);
    call it before any thread starts: a thread keeps the heap it was given. False
    where the C library has no ``mallopt`` or refused."""
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name is not None else None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_ARENA_MAX, 1))


def _malloc_trim() -> Callable[[], object] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class HeapTrimmer:
    """``soon()``: trim the heaps in a thread, at most once an interval; asked during
    one, it trims once more after it, so the last job's memory goes back too."""

    def __init__(self, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self._trim = _malloc_trim()
        self._min_interval_s = min_interval_s
        self._last = -min_interval_s
        self._task: asyncio.Task[None] | None = None
        self._again = False
        self.trims = 0

    def soon(self) -> None:
        if self._trim is None:
            return
        self._again = True
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="heap-trim")

    async def _run(self) -> None:
        assert self._trim is not None
        while self._again:
            wait_s = self._last + self._min_interval_s - time.monotonic()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            # Asked again while this trim runs: one more after it.
            self._again = False
            await asyncio.to_thread(self._trim)
            self._last = time.monotonic()
            self.trims += 1

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
