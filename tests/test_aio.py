"""Wakeup: every waiter woken at once, in the next turn of the loop, and cancellable;
tasks cancelled together, the first of a task and its stops, and an executor's
threads started before their first use."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from dispatcher.aio import Wakeup, cancel_all, cancel_and_wait, first_of, start_threads


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


async def test_cancel_all_cancels_every_task_before_it_waits_for_any() -> None:
    # One turn of the loop for all of them: each task, as it handles its cancel,
    # finds the others cancelled already.
    seen: list[bool] = []
    tasks: list[asyncio.Task[None]] = []

    async def sleeper() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append(all(t.cancelling() for t in tasks))
            raise

    tasks.extend(asyncio.create_task(sleeper()) for _ in range(3))
    await asyncio.sleep(0)
    await cancel_all(tasks)
    assert seen == [True, True, True]
    assert all(t.cancelled() for t in tasks)


async def test_cancel_all_reraises_the_first_crash_once_every_task_is_done() -> None:
    async def crash(message: str) -> None:
        raise RuntimeError(message)

    sleeper = asyncio.create_task(asyncio.Event().wait())
    tasks = [asyncio.create_task(crash("first")), sleeper, asyncio.create_task(crash("second"))]
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="first"):
        await cancel_all(tasks)
    assert sleeper.cancelled()


async def test_first_of_ends_at_a_stop_and_leaves_the_task_running() -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(asyncio.Event().wait())
    stops = [asyncio.create_task(stop.wait())]
    stop.set()
    await first_of(task, stops)
    assert not task.done()
    await cancel_all([task, *stops])


async def test_first_of_reraises_a_crash_of_its_task() -> None:
    async def crash() -> None:
        raise RuntimeError("crashed")

    stops = [asyncio.create_task(asyncio.Event().wait())]
    with pytest.raises(RuntimeError, match="crashed"):
        await first_of(asyncio.create_task(crash()), stops)
    await cancel_all(stops)


def threads_named(prefix: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith(f"{prefix}_"))


async def test_start_threads_starts_count_threads_of_an_executor_before_any_use() -> None:
    executor = ThreadPoolExecutor(4, thread_name_prefix="aio-start-threads")
    try:
        assert threads_named("aio-start-threads") == 0
        await start_threads(executor, 3)
        assert threads_named("aio-start-threads") == 3
        await start_threads(executor, 4)  # the 3 idle ones count
        assert threads_named("aio-start-threads") == 4
    finally:
        executor.shutdown()


async def test_start_threads_of_none_starts_the_loops_default_executor() -> None:
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(2, thread_name_prefix="aio-default")
    loop.set_default_executor(executor)
    await start_threads(None, 2)
    assert threads_named("aio-default") == 2
