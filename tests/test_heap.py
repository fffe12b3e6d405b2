"""Freed heap memory goes back to the system after a job ends (dispatcher/heap.py)."""

from __future__ import annotations

import asyncio

from dispatcher.heap import HeapTrimmer


async def test_requests_during_a_trim_make_one_more_and_no_more() -> None:
    trimmer = HeapTrimmer(min_interval_s=0.0)
    started, release = asyncio.Event(), asyncio.Event()
    calls = 0
    loop = asyncio.get_running_loop()

    def trim() -> None:
        nonlocal calls
        calls += 1
        loop.call_soon_threadsafe(started.set)
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result()

    trimmer._trim = trim
    trimmer.soon()
    await started.wait()
    for _ in range(5):  # jobs ending while the first trim runs
        trimmer.soon()
    release.set()
    assert trimmer._task is not None
    await trimmer._task
    assert (calls, trimmer.trims) == (2, 2)


async def test_without_malloc_trim_it_does_nothing() -> None:
    trimmer = HeapTrimmer()
    trimmer._trim = None
    trimmer.soon()
    assert trimmer._task is None
    await trimmer.close()


async def test_the_real_trim_runs_where_the_c_library_has_it() -> None:
    trimmer = HeapTrimmer(min_interval_s=0.0)
    trimmer.soon()
    if trimmer._task is not None:  # glibc: the real call, in a thread
        await trimmer._task
        assert trimmer.trims == 1
