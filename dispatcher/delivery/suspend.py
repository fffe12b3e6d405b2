"""Rollout timeouts that stop counting while admission is paused (``--pause-deadlines``).

A colocated engine that trains between rollout waves pauses admission
(contracts §13): the rollouts in flight then wait for a model that does not
answer, through no fault of theirs. With ``--pause-deadlines`` each call's
rollout timeout is suspended for as long as the pause lasts: at the pause the
time it had left is kept and its timer is taken off the loop; at the end of the
pause the timer is set again for that time left. A call that starts during a
pause (a retry) starts suspended.

Each scope is an ``asyncio.timeout`` the set reschedules, so an expiring
timeout stays ``asyncio``'s own: its cancel and only it becomes the
``TimeoutError``.
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class SuspendableTimeouts:
    """Scopes of ``seconds`` each whose clocks stop while ``suspend``ed."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.suspended = False
        # Every open scope, with the seconds it had left when suspended.
        self._open: dict[asyncio.Timeout, float] = {}

    def scope(self) -> SuspendableScope:
        """``async with timeouts.scope():`` bounds the block by ``seconds`` of unpaused time."""
        return SuspendableScope(self)

    def set_paused(self, paused: bool) -> None:
        """Stop (``True``) or start again (``False``) every open scope's clock."""
        if paused == self.suspended:
            return
        self.suspended = paused
        loop = asyncio.get_running_loop()
        now = loop.time()
        for timeout, left_s in self._open.items():
            if timeout.expired():
                continue  # its cancel is on the way: too late to take back
            if paused:
                when = timeout.when()
                self._open[timeout] = left_s if when is None else max(0.0, when - now)
                timeout.reschedule(None)
            else:
                timeout.reschedule(now + left_s)

    @property
    def open(self) -> int:
        return len(self._open)


class SuspendableScope:
    """One ``async with`` of a ``SuspendableTimeouts``."""

    __slots__ = ("_timeout", "_timeouts")

    def __init__(self, timeouts: SuspendableTimeouts) -> None:
        self._timeouts = timeouts
        self._timeout: asyncio.Timeout | None = None

    async def __aenter__(self) -> SuspendableScope:
        timeouts = self._timeouts
        loop = asyncio.get_running_loop()
        when = None if timeouts.suspended else loop.time() + timeouts.seconds
        self._timeout = timeout = asyncio.timeout_at(when)
        await timeout.__aenter__()
        timeouts._open[timeout] = timeouts.seconds
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        timeout, self._timeout = self._timeout, None
        assert timeout is not None
        del self._timeouts._open[timeout]
        await timeout.__aexit__(exc_type, exc, tb)
