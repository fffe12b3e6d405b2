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
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.helpers import in_process_run, sim_agent_process, wait_until


@pytest.fixture
async def holding_agent() -> AsyncIterator[str]:
    """A sim agent in its own process that answers each call after ten minutes."""
    async with sim_agent_process("--latency-s", "600") as url:
        yield url


async def objects_with_in_flight(
    folder: Path, url: str, count: int, http: aiohttp.ClientSession
) -> int:
    """The GC-tracked objects of this process while ``count`` rollouts wait at the agent."""

    async def agent_requests() -> int:
        async with http.get(f"{url}/stats") as r:
            return int((await r.json())["requests"])

    # The agent holds the calls of an earlier run too (cancelled, they stay):
    # count the new ones.
    before = await agent_requests()

    async def agent_holds_all() -> bool:
        return await agent_requests() == before + count

    dispatcher = in_process_run(folder, url, count, concurrency=count, shutdown_grace_s=0)
    run = asyncio.create_task(dispatcher.run())
    try:
        await wait_until(agent_holds_all, timeout_s=30)
        gc.collect()
        return len(gc.get_objects())
    finally:
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run


async def test_a_rollout_waiting_at_its_agent_holds_few_objects(
    tmp_path_factory: pytest.TempPathFactory, holding_agent: str, no_signal_handlers: None
) -> None:
    # Two runs, 100 and 300 in flight: what a run holds whatever its size cancels
    # out. What is left is each rollout's: its task, coroutines, futures, row and
    # body, and its connection (transport, parser, the protocol's methods).
    async with aiohttp.ClientSession() as http:
        few = await objects_with_in_flight(tmp_path_factory.mktemp("few"), holding_agent, 100, http)
        many = await objects_with_in_flight(
            tmp_path_factory.mktemp("many"), holding_agent, 300, http
        )
    per_rollout = (many - few) / 200
    # About 38.5 on CPython 3.11; 49.6 when each rollout copied its context twice,
    # its done callback was a closure and its call waited four coroutines deeper.
    assert per_rollout <= 42, per_rollout
