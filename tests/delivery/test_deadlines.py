"""``Deadlines``: one timer for many same-length deadlines, each on a future."""

from __future__ import annotations

import asyncio

import pytest

from dispatcher.delivery.deadlines import Deadlines


class Owner:
    """Fails what expires with ``TimeoutError``, unless told the head is in."""

    def __init__(self, answered: bool = False) -> None:
        self.answered = answered
        self.expired: list[asyncio.Future[None]] = []
        self.expiry = asyncio.Event()

    def expire(self, future: asyncio.Future[None]) -> None:
        self.expired.append(future)
        self.expiry.set()
        if not self.answered:
            future.set_exception(TimeoutError())


async def bounded(deadlines: Deadlines, future: asyncio.Future[None], owner: Owner) -> None:
    deadlines.bound(future, owner)
    try:
        await future
    finally:
        deadlines.settled()


async def test_a_future_past_its_deadline_fails_with_timeout_error() -> None:
    deadlines = Deadlines(0.01)
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await bounded(deadlines, never, Owner())
    # No task was cancelled for it.
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    assert deadlines._open == 0


async def test_a_future_answered_in_time_is_never_expired() -> None:
    deadlines = Deadlines(5.0)
    owner = Owner()
    answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    answer.set_result(None)
    await bounded(deadlines, answer, owner)
    assert deadlines._open == 0 and not deadlines._queue and not owner.expired


async def test_only_the_slow_call_expires_among_many() -> None:
    deadlines = Deadlines(0.05)
    loop = asyncio.get_running_loop()
    owner = Owner()

    async def call(slow: bool) -> str:
        future: asyncio.Future[None] = loop.create_future()
        if not slow:
            loop.call_soon(future.set_result, None)
        await bounded(deadlines, future, owner)
        return "fast"

    slow = asyncio.create_task(call(True))
    fast = [asyncio.create_task(call(False)) for _ in range(200)]
    assert await asyncio.gather(*fast) == ["fast"] * 200
    with pytest.raises(TimeoutError):
        await slow
    assert len(owner.expired) == 1 and deadlines._open == 0


async def test_the_owner_may_keep_an_expired_future_pending() -> None:
    """A head already in waits for its turn to wake its call: not a timeout."""
    deadlines = Deadlines(0.01)
    owner = Owner(answered=True)
    head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    call = asyncio.create_task(bounded(deadlines, head, owner))
    await owner.expiry.wait()
    assert not call.done()
    head.set_result(None)
    await call


async def test_a_cancelled_call_is_never_expired() -> None:
    deadlines = Deadlines(5.0)
    owner = Owner()
    head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    call = asyncio.create_task(bounded(deadlines, head, owner))
    await asyncio.sleep(0)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    deadlines._fire()  # as if the timer came now: nothing open is left to expire
    assert not owner.expired and deadlines._open == 0


async def test_done_futures_behind_a_long_one_are_swept() -> None:
    """A call that outlives thousands of others must not keep them all queued."""
    deadlines = Deadlines(60.0)
    loop = asyncio.get_running_loop()
    owner = Owner()
    release: asyncio.Future[None] = loop.create_future()
    long = asyncio.create_task(bounded(deadlines, release, owner))
    await asyncio.sleep(0)
    for _ in range(5_000):
        answered: asyncio.Future[None] = loop.create_future()
        answered.set_result(None)
        await bounded(deadlines, answered, owner)
    assert len(deadlines._queue) < 200
    release.set_result(None)
    await long
    assert not owner.expired
