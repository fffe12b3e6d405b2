"""The bounded pool and the drain decision (contracts §9, §11).

Each job's producer admits its rollouts one at a time, in input order: each
first wins a concurrency slot, then the budget decides whether it starts or
is drained. Drained rollouts write nothing and run on resume. At most
``concurrency`` rollouts hold slots, so a task file of any size costs the
same memory. The number of slots can shrink below ``concurrency`` while
the dispatcher's own faults last (``Limiter.shrink``) and grows back one slot
per delivered answer. While an admission pause is on (``pause.py``) no
rollout takes its slots.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable

from dispatcher.admission.pause import AdmissionPause


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
    """A semaphore whose limit can change while slots are held, served in rank order.

    Shrinking never takes a slot away from a rollout: it only makes later
    ``acquire`` calls wait until enough slots are released. Waiters are served
    lowest ``rank`` first, then in arrival order: a job of higher priority
    gets the next free slot (service mode), and equal ranks are first come,
    first served.
    """

    def __init__(self, limit: int) -> None:
        self.ceiling = limit
        self.limit = limit
        self.in_use = 0
        self._waiters: list[tuple[tuple[int, ...], int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    def free(self) -> bool:
        """Whether ``acquire`` would take a slot at once, without waiting."""
        return self.in_use < self.limit and not self._waiters

    async def acquire(self, rank: tuple[int, ...] = ()) -> None:
        if self.free():
            self.in_use += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (rank, next(self._arrivals), waiter))
        # Waiters left behind by cancellations must not hold back a free slot.
        self._wake()
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # Woken and cancelled in the same iteration: pass the slot on.
                self.release()
            raise

    def release(self) -> None:
        self.in_use -= 1
        self._wake()

    @property
    def waiting(self) -> int:
        """Acquirers waiting now."""
        return sum(1 for _, _, waiter in self._waiters if not waiter.done())

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
            _, _, waiter = heapq.heappop(self._waiters)
            if not waiter.done():
                self.in_use += 1
                waiter.set_result(None)


class Slots:
    """The slots one admitted rollout holds until its agent has answered."""

    __slots__ = ("_agent_slot", "_pool_slot")

    def __init__(self, pool_slot: Limiter | None, agent_slot: Limiter | None) -> None:
        self._pool_slot = pool_slot
        self._agent_slot = agent_slot

    def release(self) -> None:
        """Free both slots; a second call does nothing."""
        if self._pool_slot is not None:
            self._pool_slot.release()
            self._pool_slot = None
        if self._agent_slot is not None:
            self._agent_slot.release()
            self._agent_slot = None


class RolloutPool:
    """The agent slots shared by every job: at most ``concurrency`` rollouts at agents.

    ``admit`` hands a rollout its slots, and its agent's slot where the agent
    has a limit of its own (``agent_slots``: ``--agent-concurrency``, or the
    adaptive limit of ``--concurrency auto``), or drains it. The rollout's
    ``Flight`` holds the ``Slots`` until its agent has answered; the commit
    that follows no longer counts against the agents' concurrency.
    """

    def __init__(
        self,
        concurrency: int | None,
        budget: Budget,
        drain_margin: Callable[[], float | None],
        agent_slots: dict[str, Limiter] | None = None,
        pause: AdmissionPause | None = None,
    ) -> None:
        self.slots = Limiter(concurrency) if concurrency is not None else None
        self.agent_slots = agent_slots or {}
        self.budget = budget
        self._drain_margin = drain_margin
        self.pause = pause or AdmissionPause()

    async def admit(self, agent: str, rank: tuple[int, ...] = ()) -> Slots | None:
        """Wait for the slots, then hand them over, or drain (None): no time is left.
        Nothing is handed over while an admission pause is on."""
        slots = None if self.pause.paused else self._take_now(agent)
        while slots is None:
            await self.pause.wait_open()
            slots = await self._take(agent, rank)
            if not self.pause.paused:
                break
            # Won during a pause that began while it waited: give it back.
            slots.release()
            slots = None
        # Decided after the slot is won: the wait itself may have used up the budget.
        # (Without a budget nothing drains: the margin, a quantile, is not computed.)
        if self.budget.budget_s is not None and self.budget.should_drain(self._drain_margin()):
            slots.release()
            return None
        return slots

    def _take_now(self, agent: str) -> Slots | None:
        """The slots, when every limiter has one free and nobody waits for it (the
        rollouts that start together once answers free their slots); else None,
        and nothing taken: ``_take`` waits."""
        pool_slot, agent_slot = self.slots, self.agent_slots.get(agent)
        if not (pool_slot is None or pool_slot.free()) or not (
            agent_slot is None or agent_slot.free()
        ):
            return None
        if agent_slot is not None:
            agent_slot.in_use += 1
        if pool_slot is not None:
            pool_slot.in_use += 1
        return Slots(pool_slot, agent_slot)

    async def _take(self, agent: str, rank: tuple[int, ...]) -> Slots:
        agent_slot = self.agent_slots.get(agent)
        if agent_slot is not None:
            await agent_slot.acquire(rank)
        if self.slots is not None:
            try:
                await self.slots.acquire(rank)
            except BaseException:
                if agent_slot is not None:
                    agent_slot.release()
                raise
        return Slots(self.slots, agent_slot)
