"""The capture proxy's figures per upstream (capture/upstream_metrics.py): scraped from
``GET /ng-metrics`` of a real proxy in front of two sim-model replicas with prefix caches,
and checked against the replicas' own counts."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from dispatcher.capture.proxy import build_proxy_app
from dispatcher.capture.routing import RoutePolicy
from dispatcher.capture.upstream_metrics import METRICS_PATH
from dispatcher.sim.dialects import SimModelConfig
from dispatcher.sim.model import build_sim_model_app
from dispatcher.sim.model_client import request_body
from tests.capture.test_proxy import Servers, servers, session
from tests.helpers import wait_until

__all__ = ["servers", "session"]  # the fixtures, imported for these tests


async def scrape(session: aiohttp.ClientSession, proxy: str) -> dict[tuple[str, str], float]:
    async with session.get(proxy + METRICS_PATH) as answer:
        assert answer.status == 200
        text = await answer.text()
    return {
        (sample.name, sample.labels["upstream"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "upstream" in sample.labels
    }


async def test_each_upstream_counts_its_calls_sessions_and_cached_tokens(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    config = SimModelConfig(prefix_cache_tokens=100_000, completion_tokens=4)
    models = [await servers.start(build_sim_model_app(config)) for _ in range(2)]
    proxy = await servers.start(build_proxy_app(models, tmp_path, route=RoutePolicy.SESSION))
    prompt = "a shared prompt " * 64  # 1,024 bytes: 256 tokens, 16 whole blocks cached
    for rollout in ("1-0", "2-0"):
        for _turn in range(3):
            body = request_body("chat", stream=rollout == "2-0", prompt=prompt, model="m")
            url = f"{proxy}/ng-rollout/{rollout}/v1/chat/completions"
            async with session.post(url, data=orjson.dumps(body)) as answer:
                assert answer.status == 200
                await answer.read()
    truth = []
    for model in models:
        async with session.get(f"{model}/stats") as answer:
            truth.append(await answer.json())

    async def counted() -> bool:
        figures = await scrape(session, proxy)
        return all(
            figures["dispatcher_capture_upstream_prompt_tokens_total", url] == t["prompt_tokens"]
            for url, t in zip(models, truth, strict=True)
        )

    await wait_until(counted)  # token counts land as the records are written
    figures = await scrape(session, proxy)
    for url, t in zip(models, truth, strict=True):
        assert figures["dispatcher_capture_upstream_calls_total", url] == 3 == t["requests"]
        assert figures["dispatcher_capture_upstream_calls_in_flight", url] == 0
        assert figures["dispatcher_capture_upstream_sessions", url] == 1
        assert figures["dispatcher_capture_upstream_calls_passed_over_total", url] == 0
        assert figures["dispatcher_capture_upstream_cached_tokens_total", url] == 2 * 256
        assert t["cached_tokens"] == 2 * 256
        hit = figures["dispatcher_capture_prefix_hit_ratio", url]
        assert hit == t["cached_tokens"] / t["prompt_tokens"]
    async with session.post(f"{proxy}/ng-release/1-0") as answer:
        assert (await answer.json())["released"] is True
    figures = await scrape(session, proxy)
    assert sorted(figures["dispatcher_capture_upstream_sessions", url] for url in models) == [0, 1]
