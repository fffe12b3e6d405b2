"""Wakeup: every waiter woken at once, in the next turn of the loop, and cancellable."""

from __future__ import annotations

import asyncio

from dispatcher.aio import Wakeup, cancel_and_wait


async def test_a_fire_wakes_every_waiter_in_the_next_turn_of_the_loop() -> None:
    wakeup = Wakeup()
    woken: list[int] = []

    async def waiter(n: int) -> None:
        await wakeup.wait(60)
        woken.append(n)

    tasks = [asyncio.create_task(waiter(n)) for n in range(3)]
    await asyncio.sleep(0)  # all three wait
    wakeup.fire()
    await asyncio.sleep(0)
    assert sorted(woken) == [0, 1, 2]
    await asyncio.gather(*tasks)


async def test_a_fire_with_nobody_waiting_is_not_kept_for_a_later_waiter() -> None:
    wakeup = Wakeup()
    wakeup.fire()
    waiter = asyncio.create_task(wakeup.wait(60))
    for _ in range(3):
        await asyncio.sleep(0)
    assert not waiter.done()
    await cancel_and_wait(waiter)
    assert waiter.cancelled()


async def test_a_wait_ends_at_its_timeout() -> None:
    await asyncio.wait_for(Wakeup().wait(0), 5)


async def test_a_cancellation_that_meets_a_fire_still_cancels_the_waiter() -> None:
    # wait_for on Python 3.11 returned its result, not the cancellation, when both
    # were due in one turn: a stream waiting in a loop then never ended.
    wakeup = Wakeup()

    async def waits_forever() -> None:
        while True:
            await wakeup.wait(60)

    task = asyncio.create_task(waits_forever())
    await asyncio.sleep(0)
    wakeup.fire()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5)
    assert done and task.cancelled()
