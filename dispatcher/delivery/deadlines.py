"""One loop timer for many deadlines of the same length: the first-byte timeout of every call.

``asyncio.timeout`` arms a loop timer when a call starts and cancels it when
the call ends: per rollout, for a deadline that almost never fires, that was
a few percent of the dispatcher's CPU (``bench/dispatch_overhead.py``).
Deadlines of one length expire in the order they were set, so one queue and
one timer at its oldest open deadline serve every call.

A deadline bounds a future, not a task: ``bound(future, owner)`` and, once
the future is awaited, ``settled()``. At the deadline a future still pending
is handed to ``owner.expire(future)``, which fails it (with ``TimeoutError``)
unless it knows better (an answer's head in, waiting for its turn to wake its
call). No task is cancelled, so no scope object, cancel count or ``uncancel``
is kept per call.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

# Done futures kept behind an open one at the queue's head before the queue is
# swept: a long call must not make every call after it stay in memory.
_SWEEP_SLACK = 64


class Expires(Protocol):
    """What fails a bounded future at its deadline (``Deadlines.bound``)."""

    def expire(self, future: asyncio.Future[None]) -> None: ...


class Deadlines:
    """Futures that each fail ``seconds`` after they are bound, on one timer."""

    def __init__(self, seconds: float) -> None:
        if seconds <= 0:
            raise ValueError(f"a deadline must be positive, got {seconds} s")
        self.seconds = seconds
        self._queue: deque[tuple[float, asyncio.Future[None], Expires]] = deque()
        self._open = 0
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def bound(self, future: asyncio.Future[None], owner: Expires) -> None:
        """Bound ``future`` by ``seconds`` from now; call ``settled`` once it is awaited."""
        loop = future.get_loop()
        when = loop.time() + self.seconds
        self._queue.append((when, future, owner))
        self._open += 1
        if self._timer is None or self._loop is not loop:
            self._arm(loop, when)

    def settled(self) -> None:
        """A bound future was awaited (answered, failed or cancelled)."""
        self._open -= 1
        queue = self._queue
        while queue and queue[0][1].done():
            queue.popleft()
        if len(queue) > 2 * self._open + _SWEEP_SLACK:
            self._queue = deque(entry for entry in queue if not entry[1].done())

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._loop = loop
        self._timer = loop.call_at(when, self._fire)

    def _fire(self) -> None:
        """Expire every future past its deadline; wait again for the oldest open one."""
        self._timer = None
        loop = self._loop
        assert loop is not None
        now = loop.time()
        queue = self._queue
        while queue:
            when, future, owner = queue[0]
            if not future.done():
                if when > now:
                    self._arm(loop, when)
                    return
                owner.expire(future)
            queue.popleft()
