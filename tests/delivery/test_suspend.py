"""``--pause-deadlines`` (contracts §13): while admission is paused, the rollout
timeout of every call in flight stops counting, and counts on after the pause.

The daemon runs in this process on 127.0.0.1 (the jobs API over HTTP); the
test moves its loop's clock, so a pause ten rollout timeouts long takes no time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dispatcher.delivery.suspend import SuspendableTimeouts
from tests.helpers import FakeAgent, wait_until
from tests.serve.test_served import InProcessServe, start_serve

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 60.0


@pytest.fixture
async def shift_clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """Moves the running loop's clock forward: its timers see the seconds pass."""
    loop = asyncio.get_running_loop()
    real = loop.time
    offset = [0.0]
    monkeypatch.setattr(loop, "time", lambda: real() + offset[0])

    def shift(seconds: float) -> None:
        offset[0] += seconds

    return shift


async def test_a_suspended_scope_outlives_its_seconds_and_expires_after_them() -> None:
    timeouts = SuspendableTimeouts(0.05)
    ended = asyncio.Event()

    async def call() -> None:
        async with timeouts.scope():
            await ended.wait()

    task = asyncio.create_task(call())
    await wait_until(lambda: timeouts.open == 1)
    timeouts.set_paused(True)
    # A scope that starts during the pause starts with its clock stopped.
    late = asyncio.create_task(call())
    await wait_until(lambda: timeouts.open == 2)
    await asyncio.wait({task, late}, timeout=0.2)
    assert not task.done() and not late.done()
    timeouts.set_paused(False)
    with pytest.raises(TimeoutError):
        await task
    with pytest.raises(TimeoutError):
        await late
    assert timeouts.open == 0


@pytest.fixture
async def serve_with(
    tmp_path: Path, gated_agent: FakeAgent, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Callable[..., Any]]:
    """Starts the daemon with these settings; stops it at the end."""
    started: list[InProcessServe] = []

    async def start(**settings: Any) -> InProcessServe:
        serve = await start_serve(tmp_path, gated_agent.url, monkeypatch, **settings)
        started.append(serve)
        return serve

    yield start
    gated_agent.open()
    for serve in started:
        await serve.stop()


async def _pause_through_a_held_rollout(
    serve: InProcessServe, agent: FakeAgent, shift: Callable[[float], None]
) -> dict[str, Any]:
    """One rollout held at the agent through a pause ten timeouts long; its job's status."""
    # A fresh connection per request: the clock's jump outlives any kept one.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def status() -> dict[str, Any]:
            async with http.get(f"{serve.url}/v1/jobs/j") as r:
                answer: dict[str, Any] = await r.json()
                return answer

        async def ready() -> bool:
            async with http.get(f"{serve.url}/v1/jobs") as r:
                return r.status == 200

        await wait_until(ready)
        body = {"job_id": "j", "rows": [{"agent_ref": {"name": "sim"}}]}
        async with http.post(f"{serve.url}/v1/jobs", json=body) as r:
            assert r.status == 201, await r.text()
        await wait_until(lambda: agent.holding == 1)
        pause = {"paused": True, "ttl_s": 3600}
        async with http.post(f"{serve.url}/v1/admission", json=pause) as r:
            assert r.status == 200, await r.text()
        shift(10 * TIMEOUT_S)
        # Several turns of the loop: a timer past due has fired by the answer.
        async with http.get(f"{serve.url}/v1/admission") as r:
            assert (await r.json())["paused"] is True
        async with http.post(f"{serve.url}/v1/admission", json={"paused": False}) as r:
            assert r.status == 200, await r.text()
        agent.open()
        await wait_until(lambda: _settled(status))
        return await status()


async def _settled(status: Callable[[], Any]) -> bool:
    return bool((await status())["state"] in ("done", "failed"))


async def test_a_rollout_in_flight_through_a_pause_longer_than_its_timeout_completes(
    serve_with: Callable[..., Any], gated_agent: FakeAgent, shift_clock: Callable[[float], None]
) -> None:
    serve = await serve_with(rollout_timeout_s=TIMEOUT_S, max_attempts=1, pause_deadlines=True)
    job = await _pause_through_a_held_rollout(serve, gated_agent, shift_clock)
    assert job["state"] == "done" and job["outcomes"] == {"success": 1}, job


async def test_without_the_flag_the_pause_counts_and_the_rollout_times_out(
    serve_with: Callable[..., Any], gated_agent: FakeAgent, shift_clock: Callable[[float], None]
) -> None:
    serve = await serve_with(rollout_timeout_s=TIMEOUT_S, max_attempts=1)
    job = await _pause_through_a_held_rollout(serve, gated_agent, shift_clock)
    assert job["outcomes"] == {"timeout_exceeded": 1}, job
