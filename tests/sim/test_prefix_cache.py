"""The simulated model's prefix cache (sim/prefix_cache.py), and what routing by group
does to it through the capture proxy: real sockets, four sim-model replicas."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dispatcher.capture.proxy import build_proxy_app
from dispatcher.capture.routing import RoutePolicy
from dispatcher.sim.dialects import SimModelConfig
from dispatcher.sim.model import build_sim_model_app
from dispatcher.sim.prefix_cache import BLOCK_TOKENS, BYTES_PER_TOKEN, PrefixCache
from tests.capture.test_capture_e2e import Stack, sim_agent_config
from tests.capture.test_proxy import Servers, servers
from tests.conftest import SimAgentFactory
from tests.helpers import run_cli, write_tasks

__all__ = ["servers"]  # the fixture, imported for these tests

BLOCK = b"x" * (BLOCK_TOKENS * BYTES_PER_TOKEN)


def test_a_prompt_again_is_cached_in_whole_blocks_and_its_extension_reuses_it() -> None:
    cache = PrefixCache(capacity_tokens=10_000)
    prompt = b"".join(bytes([i]) * len(BLOCK) for i in range(5)) + b"tail"
    assert cache.admit(prompt) == 0
    assert cache.admit(prompt) == 5 * BLOCK_TOKENS  # the tail is less than a block
    assert cache.admit(prompt + BLOCK * 3) == 5 * BLOCK_TOKENS
    assert cache.admit(b"other" + prompt) == 0  # a prefix, not any shared bytes


def test_the_least_recently_used_blocks_go_first() -> None:
    cache = PrefixCache(capacity_tokens=2 * BLOCK_TOKENS)
    one, two, three = (bytes([i]) * len(BLOCK) for i in range(3))
    cache.admit(one)
    cache.admit(two)
    cache.admit(one)  # touched: two is now the oldest
    cache.admit(three)
    assert (cache.admit(one), cache.admit(two)) == (BLOCK_TOKENS, 0)


def test_a_prompts_tail_blocks_are_evicted_before_its_head() -> None:
    # As vLLM frees a finished request's blocks tail first: under pressure a prompt
    # keeps its head, which is what a later prompt sharing it can still reuse.
    cache = PrefixCache(capacity_tokens=2 * BLOCK_TOKENS)
    head, tail, other = (bytes([i]) * len(BLOCK) for i in range(3))
    cache.admit(head + tail)
    cache.admit(other)  # one block must go: the tail
    assert cache.admit(head + tail) == BLOCK_TOKENS


async def stats(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/stats") as answer:
        body: dict[str, Any] = await answer.json()
        return body


async def hit_ratio(servers: Servers, tmp_path: Path, route: RoutePolicy) -> float:
    """Prefix-token hits over 8 tasks x 4 repeats x 3 turns on 4 replicas."""
    config = SimModelConfig(prefix_cache_tokens=1_000_000)
    models = [await servers.start(build_sim_model_app(config)) for _ in range(4)]
    proxy = await servers.start(build_proxy_app(models, tmp_path / str(route), route=route))
    async with aiohttp.ClientSession() as session:
        for turn in range(3):
            for task in range(8):
                prompt = f"task {task}: " + "the shared prompt of a group " * 60
                for repeat in range(4):
                    messages = [{"role": "user", "content": prompt}]
                    messages += [
                        {"role": "assistant", "content": f"r{repeat} t{t}"} for t in range(turn)
                    ]
                    url = f"{proxy}/ng-rollout/{task}-{repeat}.0a1b2c3d/v1/chat/completions"
                    async with session.post(url, json={"messages": messages}) as answer:
                        usage = (await answer.json())["usage"]
                        assert usage["prompt_tokens_details"]["cached_tokens"] >= 0
        figures = [await stats(session, url) for url in models]
    return sum(f["cached_tokens"] for f in figures) / sum(f["prompt_tokens"] for f in figures)


async def test_routing_by_group_reuses_more_prefix_than_round_robin(
    servers: Servers, tmp_path: Path
) -> None:
    by_group = await hit_ratio(servers, tmp_path, RoutePolicy.GROUP)
    by_call = await hit_ratio(servers, tmp_path, RoutePolicy.ROUND_ROBIN)
    # Group: only each group's very first call prefills its prompt.
    assert by_group > 0.85
    assert by_call < by_group - 0.1


def test_without_a_cache_the_configured_cached_tokens_are_answered() -> None:
    # The default (0 tokens of cache) keeps what every earlier test and bench relies on.
    assert SimModelConfig().prefix_cache_tokens == 0


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    harness = Stack(tmp_path)
    yield harness
    await harness.close()


async def test_a_multi_turn_rollouts_later_turns_reuse_its_earlier_ones_through_a_run(
    stack: Stack, sim_agent: SimAgentFactory
) -> None:
    await stack.start(SimModelConfig(prefix_cache_tokens=100_000, tool_calls=0))
    config = sim_agent_config(stack, 3, turns=True, prompt_tokens=400)
    url, _ = await sim_agent(**config)
    write_tasks(stack.tasks, 2)
    result = await run_cli(*stack.args(url, "--num-repeats", "2", "--concurrency", "1"))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {(r["_ng_task_index"], r["_ng_rollout_index"]): r for r in stack.rows()}
    for (_, repeat), row in sorted(rows.items()):
        calls = row["ng_model_call_capture"]["calls"]
        prompts = [call["tokens_in"] for call in calls]
        cached = [call["cached_tokens"] for call in calls]
        assert prompts == sorted(prompts) and prompts[0] >= 400  # the context grows
        # Each turn reuses all whole blocks of the turn before; the second repeat of a
        # task finds even its first turn's prompt cached (one replica here).
        assert all(c >= p - BLOCK_TOKENS for c, p in zip(cached[1:], prompts, strict=False))
        assert (cached[0] > 0) == (repeat == 1)
