"""The admission pause (contracts §13): no rollout starts, daemon-wide, while a trainer
updates its weights; rollouts in flight go on.

A pause ends with ``resume`` (``{"paused": false}``, or the next policy
version the trainer sets) or by itself once its TTL runs out, logged at
warning: a trainer that died mid-update must never wedge the fleet. Pausing
again while paused restarts the TTL from now. The pool (``pool.py``) waits
here before a rollout takes its slots and looks again once it has them, so a
rollout that won a slot during a pause gives it back rather than start.

The clock is injected: tests run the TTL on a fake one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

import structlog

from dispatcher.aio import cancel_and_wait

log = structlog.get_logger("dispatcher.admission")

DEFAULT_TTL_S = 300.0
MAX_TTL_S = 3600.0


class Clock(Protocol):
    """Seconds that only go forward, and sleeping until one of them."""

    def now(self) -> float: ...
    async def sleep_until(self, deadline: float) -> None: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    async def sleep_until(self, deadline: float) -> None:
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))


class AdmissionPause:
    """Whether rollouts may start; owns the TTL timer (see the module docstring)."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock or MonotonicClock()
        self.reason: str | None = None
        # Pauses begun, and seconds paused by the ones that ended (for the metrics).
        self.pauses = 0
        self._ended_s = 0.0
        self._since: float | None = None
        self._until: float | None = None
        self._open = asyncio.Event()
        self._open.set()
        self._timer: asyncio.Task[None] | None = None
        # Producers waiting for the pause to end (one per job at most).
        self.waiting = 0
        # Told ``True`` when a pause begins, ``False`` when it ends (``--pause-deadlines``).
        self.listeners: list[Callable[[bool], None]] = []

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def pause(self, ttl_s: float = DEFAULT_TTL_S, reason: str | None = None) -> None:
        """Stop every start for ``ttl_s`` at most (from now, when already paused)."""
        now = self.clock.now()
        if not self.paused:
            self.pauses += 1
            self._since = now
            self._open.clear()
            self._tell(True)
        self.reason = reason
        self._until = deadline = now + ttl_s
        self._stop_timer()
        self._timer = asyncio.create_task(self._expire(ttl_s, deadline), name="pause-ttl")
        log.info("admission_paused", ttl_s=ttl_s, reason=reason)

    def resume(self, by: str) -> bool:
        """End the pause (``by`` says what ended it); False when there was none."""
        if not self.paused or self._since is None:
            return False
        paused_s = self.clock.now() - self._since
        self._ended_s += paused_s
        self._since = self._until = self.reason = None
        self._open.set()
        self._stop_timer()
        self._tell(False)
        log.info("admission_resumed", by=by, paused_s=round(paused_s, 3))
        return True

    async def wait_open(self) -> None:
        """Until no pause is on."""
        if not self.paused:
            return
        self.waiting += 1
        try:
            await self._open.wait()
        finally:
            self.waiting -= 1

    def remaining_s(self) -> float | None:
        """Seconds until the TTL ends the pause; None when not paused."""
        if self._until is None:
            return None
        return max(0.0, self._until - self.clock.now())

    def paused_seconds(self) -> float:
        """Seconds paused in all, the pause under way included."""
        current = self.clock.now() - self._since if self._since is not None else 0.0
        return self._ended_s + current

    async def close(self) -> None:
        timer, self._timer = self._timer, None
        await cancel_and_wait(timer)

    async def _expire(self, ttl_s: float, deadline: float) -> None:
        await self.clock.sleep_until(deadline)
        # This task is ending: ``resume`` must not cancel it.
        self._timer = None
        log.warning("admission_pause_expired", ttl_s=ttl_s, reason=self.reason)
        self.resume("ttl")

    def _tell(self, paused: bool) -> None:
        for listener in self.listeners:
            listener(paused)

    def _stop_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            # Nothing waits on it: a cancelled sleep has nothing to report.
            timer.cancel()
