"""The bounded pool and the drain decision (DESIGN A9, A11).

Rollouts are admitted one at a time, in input order, by a single producer:
each first wins a concurrency slot, then the budget decides whether it starts
or is drained. Drained rollouts write nothing and run on resume. The pool
holds at most ``concurrency`` asyncio tasks, so a task file of any size costs
the same memory. The number of slots can shrink below ``concurrency`` while
the dispatcher's own faults last (``Limiter.shrink``) and grows back one slot
per delivered answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Coroutine
from enum import StrEnum
from typing import Any

import structlog

from dispatcher.tasks import Rollout

log = structlog.get_logger(__name__)


class Budget:
    """The dispatch deadline, fixed when dispatch starts."""

    def __init__(self, budget_s: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.budget_s = budget_s
        self._deadline = None if budget_s is None else clock() + budget_s

    def remaining_s(self) -> float | None:
        if self._deadline is None:
            return None
        return self._deadline - self._clock()

    def should_drain(self, margin_s: float | None) -> bool:
        """Drain when no time is left, or less than a known drain margin."""
        remaining = self.remaining_s()
        if remaining is None:
            return False
        return remaining <= 0 or (margin_s is not None and remaining < margin_s)


class Limiter:
    """A semaphore whose limit can change while slots are held.

    Shrinking never takes a slot away from a rollout: it only makes later
    ``acquire`` calls wait until enough slots are released.
    """

    def __init__(self, limit: int) -> None:
        self.ceiling = limit
        self.limit = limit
        self.in_use = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> None:
        if self.in_use < self.limit and not self._waiters:
            self.in_use += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # Woken and cancelled in the same iteration: pass the slot on.
                self.release()
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    def release(self) -> None:
        self.in_use -= 1
        self._wake()

    def shrink(self) -> int:
        """Halve the slots in use (at least one stays); returns the new limit."""
        self.limit = max(1, min(self.limit, self.in_use) // 2)
        return self.limit

    def set_limit(self, limit: int) -> None:
        """A new limit, kept within 1 and the ceiling (an adaptive controller's)."""
        self.limit = max(1, min(limit, self.ceiling))
        self._wake()

    def grow(self) -> None:
        """One more slot, up to the configured concurrency."""
        if self.limit < self.ceiling:
            self.limit += 1
            self._wake()

    def _wake(self) -> None:
        while self._waiters and self.in_use < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_use += 1
                waiter.set_result(None)


class Admission(StrEnum):
    STARTED = "started"
    DRAINED = "drained"


class RolloutPool:
    """Owns the agent slots: at most ``concurrency`` rollouts talk to agents at once.

    A rollout holds its slot, and its agent's slot where the agent has a
    limit of its own (``agent_slots``: ``--agent-concurrency``, or the
    adaptive limit of ``--concurrency auto``), from admission until it calls
    ``leave`` (once its agent has answered) or its task ends, whichever comes
    first; the rest of its task (the commit) no longer counts against the
    agents' concurrency.
    """

    def __init__(
        self,
        concurrency: int | None,
        budget: Budget,
        drain_margin: Callable[[], float | None],
        run: Callable[[Rollout], Coroutine[Any, Any, None]],
        agent_slots: dict[str, Limiter] | None = None,
    ) -> None:
        self.slots = Limiter(concurrency) if concurrency is not None else None
        self.agent_slots = agent_slots or {}
        self._budget = budget
        self._drain_margin = drain_margin
        self._run = run
        # Each rollout task, with the agent slot it holds (None: its agent has no limit).
        self.in_flight: dict[asyncio.Task[None], Limiter | None] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    async def admit(self, rollout: Rollout) -> Admission:
        """Wait for the slots, then start the rollout or drain it."""
        agent_slot = self.agent_slots.get(rollout.agent)
        if agent_slot is not None:
            await agent_slot.acquire()
        if self.slots is not None:
            try:
                await self.slots.acquire()
            except BaseException:
                if agent_slot is not None:
                    agent_slot.release()
                raise
        # Decided after the slot is won: the wait itself may have used up the budget.
        if self._budget.should_drain(self._drain_margin()):
            self._release_slots(agent_slot)
            return Admission.DRAINED
        task = asyncio.create_task(self._run(rollout), name=f"rollout:{rollout.rollout_id}")
        self.in_flight[task] = agent_slot
        self._idle.clear()
        task.add_done_callback(self._finished)
        return Admission.STARTED

    def leave(self) -> None:
        """Called by a rollout's own task: its agent has answered, free the slot."""
        task = asyncio.current_task()
        if task in self.in_flight:
            self._release(task)

    def _finished(self, task: asyncio.Task[None]) -> None:
        if task in self.in_flight:
            self._release(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("rollout_task_crashed", task=task.get_name(), exc_info=task.exception())

    def _release(self, task: asyncio.Task[None]) -> None:
        self._release_slots(self.in_flight.pop(task))
        if not self.in_flight:
            self._idle.set()

    def _release_slots(self, agent_slot: Limiter | None) -> None:
        if self.slots is not None:
            self.slots.release()
        if agent_slot is not None:
            agent_slot.release()

    async def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no rollout holds a slot; True when none does."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        return not self.in_flight

    async def cancel_all(self, reason: str) -> int:
        """Cancel the rollouts still waiting on an agent; they write no row."""
        tasks = set(self.in_flight)
        for task in tasks:
            task.cancel(reason)
        if tasks:
            await asyncio.wait(tasks)
        return len(tasks)
