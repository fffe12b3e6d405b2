"""``Deadlines``: one timer for many same-length deadlines, with ``asyncio.timeout``'s rules."""

from __future__ import annotations

import asyncio

import pytest

from dispatcher.delivery.deadlines import Deadlines


async def test_a_scope_past_its_deadline_raises_timeout_error() -> None:
    deadlines = Deadlines(0.01)
    never = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        async with deadlines.scope():
            await never
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_scope_that_ends_in_time_returns_its_value() -> None:
    deadlines = Deadlines(5.0)
    async with deadlines.scope():
        value = await asyncio.sleep(0, "answered")
    assert value == "answered"
    assert deadlines._open == 0
    assert not deadlines._queue


async def test_only_the_slow_call_expires_among_many() -> None:
    deadlines = Deadlines(0.05)
    slow_answer = asyncio.get_running_loop().create_future()

    async def call(answer: asyncio.Future[str] | None) -> str:
        async with deadlines.scope():
            return await answer if answer is not None else await asyncio.sleep(0, "fast")

    slow = asyncio.create_task(call(slow_answer))
    fast = [asyncio.create_task(call(None)) for _ in range(200)]
    assert await asyncio.gather(*fast) == ["fast"] * 200
    with pytest.raises(TimeoutError):
        await slow
    assert deadlines._open == 0


async def test_another_cancel_stays_a_cancel() -> None:
    deadlines = Deadlines(5.0)
    entered = asyncio.Event()

    async def call() -> None:
        async with deadlines.scope():
            entered.set()
            await asyncio.get_running_loop().create_future()

    task = asyncio.create_task(call())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_done_scopes_behind_a_long_one_are_swept() -> None:
    """A call that outlives thousands of others must not keep them all queued."""
    deadlines = Deadlines(60.0)
    entered = asyncio.Event()
    release = asyncio.get_running_loop().create_future()

    async def long_call() -> None:
        async with deadlines.scope():
            entered.set()
            await release

    long = asyncio.create_task(long_call())
    await entered.wait()
    for _ in range(5_000):
        async with deadlines.scope():
            pass
    assert len(deadlines._queue) < 200
    release.set_result(None)
    await long
