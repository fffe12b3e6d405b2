"""One loop timer for many deadlines of the same length: the first-byte timeout of every call.

``asyncio.timeout`` arms a loop timer when a call starts and cancels it when
the call ends: per rollout, for a deadline that almost never fires, that was
a few percent of the dispatcher's CPU (``bench/dispatch_overhead.py``).
Deadlines of one length expire in the order they were set, so one queue and
one timer at its oldest open deadline serve every call.

``Deadlines.scope()`` behaves as ``asyncio.timeout(seconds)`` does: at the
deadline the task is cancelled, and the scope turns that cancellation (and
only that one: the task's ``cancelling()`` count tells) into ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from types import TracebackType

# Done scopes kept behind an open one at the queue's head before the queue is
# swept: a long call must not make every call after it stay in memory.
_SWEEP_SLACK = 64


class _State(enum.Enum):
    OPEN = "open"
    EXPIRING = "expiring"
    EXITED = "exited"


class Deadlines:
    """Scopes that each end ``seconds`` after they are entered, on one timer."""

    def __init__(self, seconds: float) -> None:
        if seconds <= 0:
            raise ValueError(f"a deadline must be positive, got {seconds} s")
        self.seconds = seconds
        self._queue: deque[DeadlineScope] = deque()
        self._open = 0
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def scope(self) -> DeadlineScope:
        """``async with deadlines.scope():`` bounds the block by ``seconds``."""
        return DeadlineScope(self)

    def _entered(self, scope: DeadlineScope, loop: asyncio.AbstractEventLoop) -> None:
        self._queue.append(scope)
        self._open += 1
        if self._timer is None or self._loop is not loop:
            self._arm(loop, scope.when)

    def _exited(self) -> None:
        self._open -= 1
        queue = self._queue
        while queue and queue[0].state is not _State.OPEN:
            queue.popleft()
        if len(queue) > 2 * self._open + _SWEEP_SLACK:
            self._queue = deque(s for s in queue if s.state is _State.OPEN)

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._loop = loop
        self._timer = loop.call_at(when, self._fire)

    def _fire(self) -> None:
        """Expire every scope past its deadline; wait again for the oldest open one."""
        self._timer = None
        loop = self._loop
        assert loop is not None
        now = loop.time()
        queue = self._queue
        while queue:
            head = queue[0]
            if head.state is _State.OPEN:
                if head.when > now:
                    self._arm(loop, head.when)
                    return
                head.expire()
            queue.popleft()


class DeadlineScope:
    """One ``async with`` of a ``Deadlines``; see the module docstring."""

    __slots__ = ("_cancelling", "_deadlines", "_task", "state", "when")

    def __init__(self, deadlines: Deadlines) -> None:
        self._deadlines = deadlines
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self.state = _State.OPEN
        self.when = 0.0

    async def __aenter__(self) -> DeadlineScope:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a deadline scope must be entered in a task")
        loop = task.get_loop()
        self._task = task
        self._cancelling = task.cancelling()
        self.when = loop.time() + self._deadlines.seconds
        self._deadlines._entered(self, loop)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task, self._task = self._task, None
        expiring = self.state is _State.EXPIRING
        self.state = _State.EXITED
        self._deadlines._exited()
        # As asyncio.timeout: our cancel, and no other, becomes a TimeoutError.
        # (``uncancel`` only when it expired: it takes back the cancel ``expire`` sent.)
        if (
            expiring
            and task is not None
            and task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError from exc

    def expire(self) -> None:
        """The deadline passed: cancel the task (``__aexit__`` makes it a ``TimeoutError``)."""
        if self.state is _State.OPEN and self._task is not None:
            self.state = _State.EXPIRING
            self._task.cancel()
