"""What a rollout in flight holds (``run/flight.py``): each object it keeps alive
is walked by every young GC pass, and at 10,000 in flight those passes were
among the loop's longest stalls (``aio.tune_gc``, ``docs/benchmarks.md``).

The daemon runs in this process against a sim agent in its own process that
holds every call, so the objects counted are the dispatcher's alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest

from dispatcher.lifecycle import Stage
from dispatcher.run.one_job import Dispatcher
from tests.helpers import in_process_run, sim_agent_process, wait_until


@pytest.fixture
async def holding_agent() -> AsyncIterator[str]:
    """A sim agent in its own process that answers each call after ten minutes."""
    async with sim_agent_process("--latency-s", "600") as url:
        yield url


async def settled_objects(
    dispatcher: Dispatcher, http: aiohttp.ClientSession, url: str, count: int
) -> int:
    """The GC-tracked objects of this process once ``count`` rollouts wait at the agent:
    each flight has sent its call (the agent has it) and waits for the answer."""

    async def all_waiting() -> bool:
        flights = dispatcher.job.flights
        if len(flights) != count or any(f.stage is not Stage.AT_AGENT for f in flights):
            return False
        async with http.get(f"{url}/stats") as r:
            return int((await r.json())["requests"]) == count

    await wait_until(all_waiting, timeout_s=30)
    gc.collect()
    return len(gc.get_objects())


async def warm_threads(workers: int) -> None:
    """The loop's executor with all its threads started: a thread started during a
    count (a file read in a worker) would add its own objects to it."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=workers))
    barrier = threading.Barrier(workers)
    await asyncio.gather(*(asyncio.to_thread(barrier.wait) for _ in range(workers)))


async def test_a_rollout_waiting_at_its_agent_holds_few_objects(
    tmp_path: Path, holding_agent: str, no_signal_handlers: None
) -> None:
    # One run, counted with 100 and then 300 rollouts waiting at the agent (its
    # cap raised in between): what the run holds whatever its size cancels out,
    # and nothing of another run is left to be freed meanwhile. What is left is
    # each rollout's: its task, coroutines, futures, row and body, and its
    # connection (transport, parser, the protocol's methods).
    await warm_threads(4)
    # One more task than rollouts counted: each time, the producer waits with
    # the next one for a slot.
    dispatcher = in_process_run(
        tmp_path, holding_agent, 301, concurrency=400, agent_concurrency={"sim": 100},
        shutdown_grace_s=0,
    )  # fmt: skip
    run = asyncio.create_task(dispatcher.run())
    try:
        async with aiohttp.ClientSession() as http:
            few = await settled_objects(dispatcher, http, holding_agent, 100)
            cap = dispatcher.daemon.load.slots["sim"]
            cap.ceiling = 300
            cap.set_limit(300)
            many = await settled_objects(dispatcher, http, holding_agent, 300)
    finally:
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run
    per_rollout = (many - few) / 200
    # 35.09 on CPython 3.11, the same at each run (counted across two runs, as
    # before, 38.5 give or take a run's leftovers and threads); about 11 more
    # when each rollout copied its context twice, its done callback was a
    # closure and its call waited four coroutines deeper.
    assert per_rollout <= 38, per_rollout
