"""A budget of bytes shared by waiters, and the commit queue bounded by it in count and bytes."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class ByteBudget:
    """Admits holders while the bytes they hold stay within ``limit``, first come first served.

    A single holder larger than the whole budget is admitted once nothing else
    is held, so an outsized row waits but never deadlocks.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a byte budget must be positive, got {limit!r}")
        self.limit = limit
        self.held = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def _fits(self, size: int) -> bool:
        return self.held == 0 or self.held + size <= self.limit

    async def acquire(self, size: int) -> None:
        """Wait until ``size`` bytes fit, then hold them (release with ``release``)."""
        if not self._waiters and self._fits(size):
            self.held += size
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (size, future)
        self._waiters.append(entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.cancelled():
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                self._wake()
            else:
                # Admitted just as we were cancelled: give the bytes back.
                self.release(size)
            raise

    def release(self, size: int) -> None:
        self.held -= size
        self._wake()

    def _wake(self) -> None:
        # In order: a big row at the head is not overtaken forever by small ones.
        while self._waiters:
            size, future = self._waiters[0]
            if future.cancelled():
                self._waiters.popleft()
                continue
            if not self._fits(size):
                return
            self._waiters.popleft()
            self.held += size
            future.set_result(None)


class CommitQueue:
    """Answered rows waiting for their commit, bounded in count and in bytes."""

    def __init__(self, slots: int, max_bytes: int) -> None:
        self._slots = asyncio.Semaphore(slots)
        self._bytes = ByteBudget(max_bytes)
        self.committing = 0

    async def enter(self, body_bytes: int) -> None:
        await self._slots.acquire()
        try:
            await self._bytes.acquire(body_bytes)
        except BaseException:
            self._slots.release()
            raise
        self.committing += 1

    def leave(self, body_bytes: int) -> None:
        self.committing -= 1
        self._bytes.release(body_bytes)
        self._slots.release()
