from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from dispatcher.sim.agent import STATS_KEY, SimAgentConfig, SimAgentStats, build_sim_agent_app
from tests.helpers import serve

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
