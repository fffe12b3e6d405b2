"""The simulated agent's heavy-tailed latency and per-task rewards (what step control
needs to show: a tail of slow groups, and groups whose rewards are all equal)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import AsyncIterator

import aiohttp
import pytest

from dispatcher.cli import parse_args
from dispatcher.sim.agent import SimAgentConfig, _latency, _rng_for, build_sim_agent_app
from tests.helpers import serve


def test_latency_dist_sets_a_heavy_tailed_lognormal() -> None:
    args = parse_args(["sim-agent", "--latency-dist", "lognormal:0.25,1"])
    assert args.latency_dist == {"latency": "lognormal", "latency_s": 0.25, "latency_sigma": 1.0}
    config = SimAgentConfig(**args.latency_dist)
    rows = [{"_ng_task_index": t, "_ng_rollout_index": 0} for t in range(2000)]
    draws = sorted(_latency(config, _rng_for(config, row), row) for row in rows)
    p50, p99 = draws[1000], draws[1980]
    assert 0.2 < p50 < 0.3
    assert p99 / p50 > 5  # the last 1% take ten times the median: a heavy tail


def test_a_task_rows_own_latency_is_its_median() -> None:
    config = SimAgentConfig(latency="lognormal", latency_s=0.25, latency_sigma=0.2)
    rows = [{"_ng_task_index": 1, "_ng_rollout_index": r, "sim_latency_s": 4.0} for r in range(500)]
    draws = sorted(_latency(config, _rng_for(config, row), row) for row in rows)
    assert 3.5 < draws[250] < 4.5


@pytest.mark.parametrize("bad", ["lognormal:0.25", "pareto:1,2", "fixed:-1", "lognormal:a,b"])
def test_a_bad_latency_dist_is_an_argument_error(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["sim-agent", "--latency-dist", bad])
    assert exit_info.value.code == 2
    assert "lognormal:MEDIAN_S,SIGMA" in capsys.readouterr().err


@pytest.fixture
async def task_rewards_agent() -> AsyncIterator[str]:
    runner, url = await serve(build_sim_agent_app(SimAgentConfig(reward_p=None, seed=7)))
    yield url
    await runner.cleanup()


async def test_reward_p_task_gives_each_task_its_own_probability(task_rewards_agent: str) -> None:
    assert parse_args(["sim-agent", "--reward-p", "task"]).reward_p is None
    rewards: defaultdict[int, list[float]] = defaultdict(list)
    async with aiohttp.ClientSession() as http:
        for task in range(40):
            for repeat in range(8):
                body = {"_ng_task_index": task, "_ng_rollout_index": repeat}
                async with http.post(f"{task_rewards_agent}/run", json=body) as r:
                    rewards[task].append((await r.json())["reward"])
        again = await (await http.post(f"{task_rewards_agent}/run", json=body)).json()

    assert again["reward"] == rewards[39][7]  # the same rollout, the same reward
    mixed = [t for t, r in rewards.items() if len(set(r)) > 1]
    uniform = [t for t, r in rewards.items() if len(set(r)) == 1]
    assert mixed and uniform  # some groups teach something, some nothing
    means = [statistics.mean(r) for r in rewards.values()]
    assert min(means) < 0.25 and max(means) > 0.75  # tasks differ in difficulty
