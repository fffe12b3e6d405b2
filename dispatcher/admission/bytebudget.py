"""A budget of bytes (and holders) shared by waiters, and the commit queue bounded by it."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class ByteBudget:
    """Admits holders while the bytes they hold stay within ``limit``, first come first served.

    A single holder larger than the whole budget is admitted once nothing else
    is held, so an outsized row waits but never deadlocks.
    """

    def __init__(self, limit: int, max_holders: int | None = None) -> None:
        if limit < 1:
            raise ValueError(f"a byte budget must be positive, got {limit!r}")
        if max_holders is not None and max_holders < 1:
            raise ValueError(f"max_holders must be positive, got {max_holders!r}")
        self.limit = limit
        self.held = 0
        # Holders at once (None: any number), counted with the bytes in one queue.
        self.max_holders = max_holders
        self.holders = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _fits(self, size: int) -> bool:
        if self.max_holders is not None and self.holders >= self.max_holders:
            return False
        return self.held == 0 or self.held + size <= self.limit

    def try_acquire(self, size: int) -> bool:
        """Hold ``size`` bytes now if they fit and nobody waits; False: ``acquire`` them."""
        if self._waiters or not self._fits(size):
            return False
        self.held += size
        self.holders += 1
        return True

    async def acquire(self, size: int) -> None:
        """Wait until ``size`` bytes fit, then hold them (release with ``release``)."""
        if self.try_acquire(size):
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
        self.holders -= 1
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
            self.holders += 1
            future.set_result(None)


class CommitQueue:
    """Answered rows waiting for their commit, bounded in count and in bytes.

    ``enter_now`` is the common case (room at once) without an await;
    ``enter`` waits in the one first-come-first-served queue of both bounds.
    """

    def __init__(self, slots: int, max_bytes: int) -> None:
        self._budget = ByteBudget(max_bytes, max_holders=slots)

    @property
    def committing(self) -> int:
        return self._budget.holders

    @property
    def waiting(self) -> int:
        """Rows waiting for room (a cancelled waiter may still be counted)."""
        return self._budget.waiting

    def enter_now(self, body_bytes: int) -> bool:
        return self._budget.try_acquire(body_bytes)

    async def enter(self, body_bytes: int) -> None:
        await self._budget.acquire(body_bytes)

    def leave(self, body_bytes: int) -> None:
        self._budget.release(body_bytes)
