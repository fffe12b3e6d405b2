from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import pytest

from dispatcher.sim.agent import STATS_KEY, SimAgentConfig, SimAgentStats, build_sim_agent_app
from tests.helpers import FakeAgent, serve
from tests.prometheus_helpers import require_binary

SimAgentFactory = Callable[..., Coroutine[Any, Any, tuple[str, SimAgentStats]]]


@pytest.fixture
async def sim_agent() -> AsyncIterator[SimAgentFactory]:
    """Start simulated agents on 127.0.0.1: ``url, stats = await sim_agent(latency_s=...)``."""
    runners = []

    async def start(**config: Any) -> tuple[str, SimAgentStats]:
        app = build_sim_agent_app(SimAgentConfig(**config))
        runner, url = await serve(app)
        runners.append(runner)
        return url, app[STATS_KEY]

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def agent() -> AsyncIterator[FakeAgent]:
    """A ``FakeAgent`` on 127.0.0.1 that answers each request at once."""
    agent = FakeAgent()
    await agent.start()
    yield agent
    await agent.close()


@pytest.fixture
async def gated_agent() -> AsyncIterator[FakeAgent]:
    """A ``FakeAgent`` on 127.0.0.1 that holds each request until the test releases it."""
    agent = FakeAgent(gated=True)
    await agent.start()
    yield agent
    await agent.close()


# A test that needs a Prometheus tool asks for it as a fixture, so that it skips
# before it starts anything: a skip raised inside a `try` whose `finally` asserts
# on a daemon it started turns into that assertion's failure.
@pytest.fixture
def promtool() -> str:
    """Path of `promtool`; without it the test skips and says what to install."""
    return require_binary("promtool")


@pytest.fixture
def prometheus() -> str:
    """Path of `prometheus`; without it the test skips and says what to install."""
    return require_binary("prometheus")


# `make test` runs `pytest -n N`: each test is scheduled on its own, but for these
# (path prefix -> group), which share a module's or the session's setup and run on
# one worker, in order: the packaging builds, and the NeMo Gym venv and stacks (two
# stacks at once, each with its own Ray cluster, would compete for the CPUs).
# A Gym stack runs Ray, which one machine runs one of at a time: the Gym modules
# stay on one worker (tried side by side, the second stack never came up).
# Ray runs one cluster per machine at a time: the Ray tests share the Gym stack's group.
SERIAL_GROUPS = {
    "tests/gym/": "gym",
    "tests/client/test_wire.py": "gym",
    "tests/client/test_ray.py": "gym",
    "tests/test_packaging.py": "packaging",
}


def serial_group(nodeid: str) -> str:
    """The scheduling unit of a test: its group, or the test alone."""
    return next((g for p, g in SERIAL_GROUPS.items() if nodeid.startswith(p)), nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With `-n N` (xdist's default `--dist load`): SERIAL_GROUPS, biggest first."""
    if config.getvalue("dist") != "load":
        return None  # an explicit --dist mode is taken as asked
    # Not xdist's own groups (xdist_group marks, --dist loadgroup): xdist 3.8 renames
    # node ids for them (item._nodeid), which pytest 9 no longer reads, so the marks
    # are silently ignored.
    from xdist.scheduler import LoadScopeScheduling

    class SerialGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return serial_group(nodeid)

    return SerialGroups(config, log)


@pytest.fixture
def no_signal_handlers() -> Iterator[None]:
    """``Dispatcher.run`` installs SIGTERM/SIGINT handlers on the test's loop: remove them."""
    yield
    loop = asyncio.get_event_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
