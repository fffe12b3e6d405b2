"""A simulated OpenAI-compatible model server for demos, tests and benchmarks.

Serves ``/v1/chat/completions``, ``/v1/responses``, ``/v1/messages`` (Anthropic)
and ``/v1/completions``, streamed (SSE) or not, each answer carrying usage with
prompt, completion, reasoning and cached tokens. The prompt size follows the
request size; the other counts come from the configuration, so a test knows
exactly what every call must add up to.

Knobs: latency before the answer and between stream events, an error rate with
its status code, and a rate of answers cut off mid-body (the connection closes
without the end of the body). Draws come from one generator seeded by
``seed``, so a sequence of calls is reproducible.

A streamed answer is generated from the same object the non-streamed one
returns, so reassembling the stream must give that object back.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
from aiohttp import web

from dispatcher.capture.routing import GROUP_HEADER, SESSION_HEADER
from dispatcher.commands import command_help
from dispatcher.errors import ConfigError
from dispatcher.sim import token_ids
from dispatcher.sim.dialects import EVENTS, RESPONSES, JsonObject, SimModelConfig, prompt_bytes
from dispatcher.sim.model_client import DIALECT_PATHS, ModelCallError, call_model
from dispatcher.sim.prefix_cache import PrefixCache, prompt_tokens
from dispatcher.telemetry.http_app import serve_until_signal

__all__ = [
    "ModelCallError",
    "SimModelConfig",
    "SimModelStats",
    "add_parser",
    "build_sim_model_app",
    "call_model",
]


@dataclass
class SimModelStats:
    requests: int = 0
    streamed: int = 0
    errors: int = 0
    truncated: int = 0
    with_authorization: int = 0
    # Calls that carried both identity headers of the capture proxy (routing by rollout).
    with_identity: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    by_dialect: dict[str, int] = field(default_factory=dict)


CONFIG_KEY = web.AppKey("sim_model_config", SimModelConfig)
STATS_KEY = web.AppKey("sim_model_stats", SimModelStats)
RNG_KEY = web.AppKey("sim_model_rng", random.Random)
# Without a cache (0 tokens), answers say the configured cached_tokens as before.
CACHE_KEY: web.AppKey[PrefixCache | None] = web.AppKey("sim_model_prefix_cache")
PREFILL_KEY = web.AppKey("sim_model_prefill", asyncio.Lock)


def build_sim_model_app(config: SimModelConfig) -> web.Application:
    """The simulated model server as an aiohttp application."""
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app[CONFIG_KEY] = config
    app[STATS_KEY] = SimModelStats()
    app[RNG_KEY] = random.Random(config.seed)
    app[CACHE_KEY] = PrefixCache(config.prefix_cache_tokens) if config.prefix_cache_tokens else None
    app[PREFILL_KEY] = asyncio.Lock()
    for dialect, path in DIALECT_PATHS.items():
        app.router.add_post(path, _handler(dialect))
    if config.token_ids:
        app.router.add_post("/tokenize", _handle_tokenize)
    app.router.add_get("/v1/models", _handle_models)
    app.router.add_get("/stats", _handle_stats)
    return app


def _handler(dialect: str) -> Callable[[web.Request], Any]:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await _answer(request, dialect)

    return handle


async def _answer(request: web.Request, dialect: str) -> web.StreamResponse:
    stats = request.app[STATS_KEY]
    body = await request.json(loads=orjson.loads)
    stream = bool(body.get("stream"))
    _count(stats, dialect, stream, request.headers)
    stats.in_flight += 1
    stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
    try:
        return await _answer_body(request, dialect, body, stream)
    finally:
        stats.in_flight -= 1


async def _answer_body(
    request: web.Request, dialect: str, body: Any, stream: bool
) -> web.StreamResponse:
    config, stats, rng = request.app[CONFIG_KEY], request.app[STATS_KEY], request.app[RNG_KEY]
    fail, truncate = rng.random() < config.error_rate, rng.random() < config.truncate_rate
    if config.latency_s > 0:
        await asyncio.sleep(config.latency_s)
    if fail:
        stats.errors += 1
        return _error(config.error_status)
    config = await _prefill(request.app, config, body)
    response = RESPONSES[dialect](config, body)
    if config.token_ids and not stream:
        _add_token_ids(dialect, response, body, config)
    if stream:
        events = EVENTS[dialect](response, config, body)
        return await _stream(request, events, config, truncate, stats)
    return await _send_json(request, response, truncate, stats)


async def _prefill(app: web.Application, config: SimModelConfig, body: Any) -> SimModelConfig:
    """With a prefix cache: spend the prefill time of the prompt tokens it did not hold,
    and answer with the cached ones counted (the config this call answers with)."""
    cache = app[CACHE_KEY]
    if cache is None:
        return config
    prompt = prompt_bytes(body)
    cached = cache.admit(prompt)
    uncached = prompt_tokens(prompt) - cached
    if config.prefill_s_per_token > 0 and uncached > 0:
        # One prefill at a time, as an engine's compute is one: what routing saves
        # shows in the time to the last row, not only in tokens.
        async with app[PREFILL_KEY]:
            await asyncio.sleep(uncached * config.prefill_s_per_token)
    return replace(config, cached_tokens=cached)


def _count(stats: SimModelStats, dialect: str, stream: bool, headers: Any) -> None:
    stats.requests += 1
    stats.streamed += stream
    stats.with_authorization += "Authorization" in headers
    stats.with_identity += SESSION_HEADER in headers and GROUP_HEADER in headers
    stats.by_dialect[dialect] = stats.by_dialect.get(dialect, 0) + 1


def _error(status: int) -> web.Response:
    body = {"error": {"message": "simulated model failure", "type": "server_error"}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


async def _send_json(
    request: web.Request, response: JsonObject, truncate: bool, stats: SimModelStats
) -> web.StreamResponse:
    payload = orjson.dumps(response)
    if not truncate:
        return web.Response(body=payload, content_type="application/json")
    stats.truncated += 1
    cut = web.StreamResponse()
    cut.content_type = "application/json"
    cut.content_length = len(payload)
    await cut.prepare(request)
    await cut.write(payload[: len(payload) // 2])
    _close(request)
    return cut


async def _stream(
    request: web.Request,
    events: list[bytes],
    config: SimModelConfig,
    truncate: bool,
    stats: SimModelStats,
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Cache-Control": "no-cache"})
    response.content_type = "text/event-stream"
    await response.prepare(request)
    if truncate:
        stats.truncated += 1
        events = events[: len(events) // 2]
    for position, event in enumerate(events):
        if position and config.inter_chunk_s > 0:
            await asyncio.sleep(config.inter_chunk_s)
        await response.write(event)
    if truncate:
        _close(request)
    else:
        await response.write_eof()
    return response


def _close(request: web.Request) -> None:
    # Closing without the body's end is what a crashed or killed server looks like.
    if request.transport is not None:
        request.transport.close()


async def _handle_models(request: web.Request) -> web.Response:
    model = request.app[CONFIG_KEY].model
    body = {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "sim"}]}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def _add_token_ids(dialect: str, response: JsonObject, body: Any, config: SimModelConfig) -> None:
    completion = max(1, config.completion_tokens)
    if dialect == "chat":
        token_ids.add_to_chat(response, body, prompt_bytes(body), completion)
    elif dialect == "responses":
        token_ids.add_to_responses(response, prompt_bytes(body), completion)


async def _handle_tokenize(request: web.Request) -> web.Response:
    body = await request.json(loads=orjson.loads)
    if not isinstance(body, dict):
        return web.json_response({"error": "the body must be a JSON object"}, status=400)
    answer = token_ids.tokenize_answer(prompt_bytes(body))
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


async def _handle_stats(request: web.Request) -> web.Response:
    stats, cache = request.app[STATS_KEY], request.app[CACHE_KEY]
    body = dict(stats.__dict__)
    if cache is not None:
        body["prompt_tokens"], body["cached_tokens"] = cache.prompt_tokens, cache.cached_tokens
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def add_parser(subparsers: Any) -> None:
    """Register ``sim-model --listen HOST:PORT [knobs]``."""
    p = subparsers.add_parser("sim-model", help=command_help("sim-model"))
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0 = any free port)")
    p.add_argument("--model", default="sim-model", help="model name used when a request has none")
    p.add_argument("--latency-ms", type=float, default=0.0, help="delay before each answer")
    p.add_argument("--inter-chunk-ms", type=float, default=0.0, help="delay between SSE events")
    p.add_argument("--stream-chunks", type=int, default=4, help="text pieces per answer")
    p.add_argument("--completion-tokens", type=int, default=16)
    p.add_argument("--reasoning-tokens", type=int, default=4)
    p.add_argument("--cached-tokens", type=int, default=8)
    p.add_argument("--tool-calls", type=int, default=0, help="tool calls per answer")
    p.add_argument("--error-rate", type=float, default=0.0, help="probability of an error status")
    p.add_argument("--error-status", type=int, default=500)
    p.add_argument("--truncate-rate", type=float, default=0.0, help="probability of a cut body")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=0,
        help="keep a prefix cache of this many prompt tokens, LRU (default 0: none); "
        "answers then count the cached prompt tokens they reused",
    )
    p.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=0.0,
        help="with a prefix cache: microseconds of prefill per prompt token it did not hold",
    )
    p.add_argument(
        "--token-ids",
        action="store_true",
        help="token ids and log-probs as vLLM returns them (chat: logprobs, return_token_ids; "
        "POST /tokenize), and on a Responses answer's last output item as NeMo Gym's "
        "models pass them on; not in streamed answers",
    )
    p.set_defaults(handler=_main, is_async=True)


def config_from_args(args: argparse.Namespace) -> SimModelConfig:
    """Flags → config; milliseconds become seconds here, once."""
    return SimModelConfig(
        model=args.model,
        latency_s=args.latency_ms / 1000.0,
        inter_chunk_s=args.inter_chunk_ms / 1000.0,
        stream_chunks=args.stream_chunks,
        completion_tokens=args.completion_tokens,
        reasoning_tokens=args.reasoning_tokens,
        cached_tokens=args.cached_tokens,
        tool_calls=args.tool_calls,
        error_rate=args.error_rate,
        error_status=args.error_status,
        truncate_rate=args.truncate_rate,
        seed=args.seed,
        prefix_cache_tokens=args.prefix_cache_tokens,
        prefill_s_per_token=args.prefill_us_per_token / 1e6,
        token_ids=args.token_ids,
    )


async def _main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise ConfigError(f"sim-model: {exc}") from exc
    app = build_sim_model_app(config)
    return await serve_until_signal(app, args.listen, "sim-model")
