from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from dispatcher.sim.agent import STATS_KEY, SimAgentConfig, SimAgentStats, build_sim_agent_app
from tests.helpers import serve
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
