"""The commit queue: room now without an await, else one queue for both bounds."""

from __future__ import annotations

import asyncio

from dispatcher.admission.bytebudget import ByteBudget, CommitQueue


async def test_the_commit_queue_admits_at_once_while_there_is_room() -> None:
    queue = CommitQueue(slots=2, max_bytes=100)
    assert queue.enter_now(10) and queue.enter_now(10)
    assert queue.committing == 2
    # Full in count, not in bytes: the next one waits.
    assert not queue.enter_now(1)
    waiter = asyncio.create_task(queue.enter(1))
    await asyncio.sleep(0)
    assert queue.waiting == 1 and not waiter.done()
    queue.leave(10)
    await waiter
    assert queue.committing == 2 and queue.waiting == 0


async def test_a_waiter_is_not_overtaken_by_a_row_that_would_fit() -> None:
    budget = ByteBudget(100, max_holders=4)
    assert budget.try_acquire(90)
    waiter = asyncio.create_task(budget.acquire(50))
    await asyncio.sleep(0)
    # 5 bytes would fit, but the waiter came first.
    assert not budget.try_acquire(5)
    budget.release(90)
    await waiter
    assert budget.held == 50 and budget.holders == 1
