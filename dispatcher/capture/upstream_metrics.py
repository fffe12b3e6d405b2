"""The capture proxy's figures per upstream (contracts §6), served at ``GET /ng-metrics``.

Per upstream (its URL, credentials masked): calls, calls in flight, live sessions,
prompt and cached tokens from the answers' usage, calls passed over (past the margin),
and the prefix-hit ratio (cached over prompt tokens), in Prometheus' text format. The
router keeps the live counts; the token counts are added as each call's capture record
is made, which runs in a thread: the counts are handed to the event loop, which alone
changes them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dispatcher.capture.records import Exchange, capture_record
from dispatcher.capture.routing import Router, Upstream
from dispatcher.capture.tokens import normalize_usage
from dispatcher.urls import redact_url

METRICS_PATH = "/ng-metrics"
_LABELS = ["upstream"]


def counting_encoder(
    loop: asyncio.AbstractEventLoop, router: Router, exchange: Exchange
) -> Callable[[], bytes]:
    """The capture line of ``exchange`` (for the store's thread); its answer's prompt and
    cached tokens are added to the upstream that answered, on ``loop``."""

    def encode() -> bytes:
        record = capture_record(exchange)
        response = record.get("response")
        if isinstance(response, dict):
            tokens = normalize_usage(response.get("usage"))
            if tokens.prompt is not None:
                upstream = _named(router, exchange.upstream)
                if upstream is not None:
                    loop.call_soon_threadsafe(_add, upstream, tokens.prompt, tokens.cached or 0)
        return orjson.dumps(record) + b"\n"

    return encode


def _named(router: Router, upstream: str | None) -> Upstream | None:
    return next((u for u in router.upstreams if redact_url(u.url) == upstream), None)


def _add(upstream: Upstream, prompt: int, cached: int) -> None:
    upstream.prompt_tokens += prompt
    upstream.cached_tokens += min(cached, prompt)


class UpstreamCollector(Collector):
    """The router's upstreams as metric families, read when scraped."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def collect(self) -> Iterator[Metric]:
        name = "dispatcher_capture_upstream_"
        calls = CounterMetricFamily(f"{name}calls", "model calls forwarded", labels=_LABELS)
        in_flight = GaugeMetricFamily(f"{name}calls_in_flight", "calls under way", labels=_LABELS)
        sessions = GaugeMetricFamily(
            f"{name}sessions", "live sessions pinned to it (rollouts not ended)", labels=_LABELS
        )
        prompt = CounterMetricFamily(
            f"{name}prompt_tokens", "prompt tokens, from the answers' usage", labels=_LABELS
        )
        cached = CounterMetricFamily(
            f"{name}cached_tokens", "prompt tokens it had cached (usage)", labels=_LABELS
        )
        passed_over = CounterMetricFamily(
            f"{name}calls_passed_over",
            "calls of rollouts pinned to it sent elsewhere: it was past --route-margin",
            labels=_LABELS,
        )
        hit = GaugeMetricFamily(
            "dispatcher_capture_prefix_hit_ratio",
            "cached over prompt tokens of its answers so far",
            labels=_LABELS,
        )
        for upstream in self._router.upstreams:
            label = [redact_url(upstream.url)]
            calls.add_metric(label, upstream.calls)
            in_flight.add_metric(label, upstream.in_flight)
            sessions.add_metric(label, upstream.sessions)
            prompt.add_metric(label, upstream.prompt_tokens)
            cached.add_metric(label, upstream.cached_tokens)
            passed_over.add_metric(label, upstream.passed_over)
            hit.add_metric(label, upstream.cached_tokens / max(1, upstream.prompt_tokens))
        yield from (calls, in_flight, sessions, prompt, cached, passed_over, hit)


def metrics_handler(router: Router) -> Callable[[web.Request], Any]:
    """``GET /ng-metrics``: the upstreams' figures in Prometheus' text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(UpstreamCollector(router))

    async def handle(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), content_type="text/plain", charset="utf-8"
        )

    return handle
