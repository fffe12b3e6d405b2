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
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from dispatcher.errors import ConfigError
from dispatcher.sim.model_client import DIALECT_PATHS, ModelCallError, call_model
from dispatcher.telemetry.http_app import serve_until_signal

__all__ = [
    "ModelCallError",
    "SimModelConfig",
    "SimModelStats",
    "add_parser",
    "build_sim_model_app",
    "call_model",
]

JsonObject = dict[str, Any]


@dataclass(frozen=True)
class SimModelConfig:
    """Behaviour of the simulated model; times in seconds, rates in [0, 1]."""

    model: str = "sim-model"
    latency_s: float = 0.0
    inter_chunk_s: float = 0.0
    stream_chunks: int = 4
    completion_tokens: int = 16
    reasoning_tokens: int = 4
    cached_tokens: int = 8
    tool_calls: int = 0
    error_rate: float = 0.0
    error_status: int = 500
    truncate_rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("error_rate", "truncate_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1]")
        if not 400 <= self.error_status <= 599:
            raise ValueError("error_status must be an HTTP error status (400-599)")
        if min(self.latency_s, self.inter_chunk_s) < 0:
            raise ValueError("latencies must be >= 0")


@dataclass
class SimModelStats:
    requests: int = 0
    streamed: int = 0
    errors: int = 0
    truncated: int = 0
    with_authorization: int = 0
    by_dialect: dict[str, int] = field(default_factory=dict)


CONFIG_KEY = web.AppKey("sim_model_config", SimModelConfig)
STATS_KEY = web.AppKey("sim_model_stats", SimModelStats)
RNG_KEY = web.AppKey("sim_model_rng", random.Random)


def build_sim_model_app(config: SimModelConfig) -> web.Application:
    """The simulated model server as an aiohttp application."""
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app[CONFIG_KEY] = config
    app[STATS_KEY] = SimModelStats()
    app[RNG_KEY] = random.Random(config.seed)
    for dialect, path in DIALECT_PATHS.items():
        app.router.add_post(path, _handler(dialect))
    app.router.add_get("/v1/models", _handle_models)
    app.router.add_get("/stats", _handle_stats)
    return app


def _handler(dialect: str) -> Callable[[web.Request], Any]:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await _answer(request, dialect)

    return handle


async def _answer(request: web.Request, dialect: str) -> web.StreamResponse:
    config, stats, rng = request.app[CONFIG_KEY], request.app[STATS_KEY], request.app[RNG_KEY]
    body = await request.json(loads=orjson.loads)
    stream = bool(body.get("stream"))
    _count(stats, dialect, stream, "Authorization" in request.headers)
    fail, truncate = rng.random() < config.error_rate, rng.random() < config.truncate_rate
    if config.latency_s > 0:
        await asyncio.sleep(config.latency_s)
    if fail:
        stats.errors += 1
        return _error(config.error_status)
    response = _RESPONSES[dialect](config, body)
    if stream:
        events = _EVENTS[dialect](response, config, body)
        return await _stream(request, events, config, truncate, stats)
    return await _send_json(request, response, truncate, stats)


def _count(stats: SimModelStats, dialect: str, stream: bool, authorized: bool) -> None:
    stats.requests += 1
    stats.streamed += stream
    stats.with_authorization += authorized
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


async def _handle_stats(request: web.Request) -> web.Response:
    stats = request.app[STATS_KEY]
    return web.Response(body=orjson.dumps(stats.__dict__), content_type="application/json")


# --- answers -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Usage:
    prompt: int
    completion: int
    reasoning: int
    cached: int


def _usage(config: SimModelConfig, body: JsonObject) -> _Usage:
    conversation = body.get("messages") or body.get("input") or body.get("prompt") or ""
    # About four bytes per token; what matters is that it is deterministic.
    prompt = max(1, len(orjson.dumps(conversation)) // 4)
    completion = max(1, config.completion_tokens)
    return _Usage(
        prompt,
        completion,
        min(config.reasoning_tokens, completion),
        min(config.cached_tokens, prompt),
    )


def _words(config: SimModelConfig) -> list[str]:
    count = max(1, config.stream_chunks)
    return [f"part{i} " if i < count - 1 else f"part{i}" for i in range(count)]


def _model(config: SimModelConfig, body: JsonObject) -> str:
    requested = body.get("model")
    return requested if isinstance(requested, str) else config.model


def _chat_response(config: SimModelConfig, body: JsonObject) -> JsonObject:
    usage = _usage(config, body)
    message: JsonObject = {"role": "assistant", "content": "".join(_words(config))}
    if usage.reasoning:
        message["reasoning_content"] = "simulated thinking"
    if config.tool_calls:
        message["tool_calls"] = [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": "sim_tool", "arguments": orjson.dumps({"i": i}).decode()},
            }
            for i in range(config.tool_calls)
        ]
    finish = "tool_calls" if config.tool_calls else "stop"
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": _model(config, body),
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": usage.prompt,
            "completion_tokens": usage.completion,
            "total_tokens": usage.prompt + usage.completion,
            "prompt_tokens_details": {"cached_tokens": usage.cached},
            "completion_tokens_details": {"reasoning_tokens": usage.reasoning},
        },
    }


def _completions_response(config: SimModelConfig, body: JsonObject) -> JsonObject:
    usage = _usage(config, body)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": _model(config, body),
        "choices": [{"index": 0, "text": "".join(_words(config)), "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": usage.prompt,
            "completion_tokens": usage.completion,
            "total_tokens": usage.prompt + usage.completion,
        },
    }


def _responses_response(config: SimModelConfig, body: JsonObject) -> JsonObject:
    usage = _usage(config, body)
    output: list[JsonObject] = []
    if usage.reasoning:
        output.append({"type": "reasoning", "id": "rs_0", "summary": []})
    text = {"type": "output_text", "text": "".join(_words(config)), "annotations": []}
    output.append(
        {
            "type": "message",
            "id": "msg_0",
            "role": "assistant",
            "status": "completed",
            "content": [text],
        }
    )
    output.extend(
        {
            "type": "function_call",
            "id": f"fc_{i}",
            "call_id": f"call_{i}",
            "name": "sim_tool",
            "arguments": orjson.dumps({"i": i}).decode(),
            "status": "completed",
        }
        for i in range(config.tool_calls)
    )
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "model": _model(config, body),
        "status": "completed",
        **_responses_settings(body),
        "output": output,
        "usage": {
            "input_tokens": usage.prompt,
            "input_tokens_details": {"cached_tokens": usage.cached},
            "output_tokens": usage.completion,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning},
            "total_tokens": usage.prompt + usage.completion,
        },
    }


def _responses_settings(body: JsonObject) -> JsonObject:
    """The request settings every OpenAI Response echoes back; the OpenAI SDK's and
    Gym's response models require them, so an answer without them fails the call."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    return {
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions")
        if isinstance(body.get("instructions"), str)
        else None,
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
        "parallel_tool_calls": parallel if isinstance(parallel, bool) else True,
        "temperature": _number_or_none(body.get("temperature")),
        "tool_choice": choice if isinstance(choice, str | dict) else "auto",
        "tools": tools if isinstance(tools, list) else [],
        "top_p": _number_or_none(body.get("top_p")),
        "truncation": "disabled",
    }


def _number_or_none(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _messages_response(config: SimModelConfig, body: JsonObject) -> JsonObject:
    usage = _usage(config, body)
    content: list[JsonObject] = []
    if usage.reasoning:
        content.append({"type": "thinking", "thinking": "simulated thinking", "signature": "sim"})
    content.append({"type": "text", "text": "".join(_words(config))})
    content.extend(
        {"type": "tool_use", "id": f"toolu_{i}", "name": "sim_tool", "input": {"i": i}}
        for i in range(config.tool_calls)
    )
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": _model(config, body),
        "content": content,
        "stop_reason": "tool_use" if config.tool_calls else "end_turn",
        "stop_sequence": None,
        # Anthropic counts cached prompt tokens beside input_tokens, not inside it.
        "usage": {
            "input_tokens": usage.prompt - usage.cached,
            "cache_read_input_tokens": usage.cached,
            "cache_creation_input_tokens": 0,
            "output_tokens": usage.completion,
        },
    }


_RESPONSES: dict[str, Callable[[SimModelConfig, JsonObject], JsonObject]] = {
    "chat": _chat_response,
    "completions": _completions_response,
    "responses": _responses_response,
    "messages": _messages_response,
}


# --- streams -----------------------------------------------------------------------------


def _sse(data: JsonObject | str, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else orjson.dumps(data).decode()
    prefix = f"event: {event}\n" if event else ""
    return f"{prefix}data: {payload}\n\n".encode()


def _chunk_events(response: JsonObject, config: SimModelConfig, body: JsonObject) -> list[bytes]:
    """chat.completion.chunk / text_completion events for the chat and completions dialects."""
    chat = response["object"] == "chat.completion"
    head = {k: response[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    choice = response["choices"][0]
    deltas = _chat_deltas(choice["message"], config) if chat else _text_deltas(config)
    events = [_sse({**head, "choices": [{"index": 0, **d, "finish_reason": None}]}) for d in deltas]
    final: JsonObject = {"delta": {}} if chat else {"text": ""}
    last = {"index": 0, **final, "finish_reason": choice["finish_reason"]}
    events.append(_sse({**head, "choices": [last]}))
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append(_sse({**head, "choices": [], "usage": response["usage"]}))
    events.append(_sse("[DONE]"))
    return events


def _chat_deltas(message: JsonObject, config: SimModelConfig) -> list[JsonObject]:
    deltas: list[JsonObject] = [{"delta": {"role": "assistant", "content": ""}}]
    if message.get("reasoning_content"):
        deltas.append({"delta": {"reasoning_content": message["reasoning_content"]}})
    deltas.extend({"delta": {"content": word}} for word in _words(config))
    for index, call in enumerate(message.get("tool_calls") or []):
        function = call["function"]
        opening = {"index": index, "id": call["id"], "type": "function"}
        opening["function"] = {"name": function["name"], "arguments": ""}
        rest = {"index": index, "function": {"arguments": function["arguments"]}}
        deltas.extend([{"delta": {"tool_calls": [opening]}}, {"delta": {"tool_calls": [rest]}}])
    return deltas


def _text_deltas(config: SimModelConfig) -> list[JsonObject]:
    return [{"text": word} for word in _words(config)]


def _responses_events(
    response: JsonObject, config: SimModelConfig, body: JsonObject
) -> list[bytes]:
    sequence = iter(range(1_000_000))

    def event(kind: str, **fields: Any) -> bytes:
        return _sse({"type": kind, "sequence_number": next(sequence), **fields}, kind)

    started = {**response, "status": "in_progress", "output": [], "usage": None}
    events = [event("response.created", response=started)]
    for index, item in enumerate(response["output"]):
        events.append(event("response.output_item.added", output_index=index, item=item))
        if item["type"] == "message":
            for word in _words(config):
                events.append(
                    event(
                        "response.output_text.delta",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        delta=word,
                    )
                )
        events.append(event("response.output_item.done", output_index=index, item=item))
    events.append(event("response.completed", response=response))
    return events


def _messages_events(response: JsonObject, config: SimModelConfig, body: JsonObject) -> list[bytes]:
    usage = response["usage"]
    opening_usage = {**usage, "output_tokens": 1}
    message = {**response, "content": [], "stop_reason": None, "usage": opening_usage}
    events = [_sse({"type": "message_start", "message": message}, "message_start")]
    for index, block in enumerate(response["content"]):
        events.extend(_block_events(index, block, config))
    delta = {"stop_reason": response["stop_reason"], "stop_sequence": None}
    closing = {
        "type": "message_delta",
        "delta": delta,
        "usage": {"output_tokens": usage["output_tokens"]},
    }
    events.append(_sse(closing, "message_delta"))
    events.append(_sse({"type": "message_stop"}, "message_stop"))
    return events


def _block_events(index: int, block: JsonObject, config: SimModelConfig) -> list[bytes]:
    kind = block["type"]
    deltas: list[JsonObject]
    if kind == "text":
        opening: JsonObject = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": word} for word in _words(config)]
    elif kind == "thinking":
        opening = {"type": "thinking", "thinking": ""}
        deltas = [
            {"type": "thinking_delta", "thinking": block["thinking"]},
            {"type": "signature_delta", "signature": block["signature"]},
        ]
    else:
        opening = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
        partial = orjson.dumps(block["input"]).decode()
        deltas = [{"type": "input_json_delta", "partial_json": partial}]
    start = {"type": "content_block_start", "index": index, "content_block": opening}
    events = [_sse(start, "content_block_start")]
    events.extend(
        _sse({"type": "content_block_delta", "index": index, "delta": d}, "content_block_delta")
        for d in deltas
    )
    events.append(_sse({"type": "content_block_stop", "index": index}, "content_block_stop"))
    return events


_EVENTS: dict[str, Callable[[JsonObject, SimModelConfig, JsonObject], list[bytes]]] = {
    "chat": _chunk_events,
    "completions": _chunk_events,
    "responses": _responses_events,
    "messages": _messages_events,
}


# --- command line ------------------------------------------------------------------------


def add_parser(subparsers: Any) -> None:
    """Register ``sim-model --listen HOST:PORT [knobs]``."""
    p = subparsers.add_parser("sim-model", help="run a simulated OpenAI-compatible model server")
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
    )


async def _main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise ConfigError(f"sim-model: {exc}") from exc
    app = build_sim_model_app(config)
    return await serve_until_signal(app, args.listen, "sim-model")
