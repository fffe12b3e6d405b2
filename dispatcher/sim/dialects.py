"""The simulated model's answers, per dialect: the object a call returns and the
SSE events that stream it (reassembled, they give that object back).

Pure functions of the configuration and the request body: ``model.py`` serves
them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from dispatcher.sim.prefix_cache import prompt_tokens

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
    # A prefix cache of this many tokens (0: none, and every answer says
    # ``cached_tokens``), and the prefill time of each prompt token it did not hold.
    prefix_cache_tokens: int = 0
    prefill_s_per_token: float = 0.0
    # Token ids and log-probs in vLLM's shape (``token_ids.py``).
    token_ids: bool = False

    def __post_init__(self) -> None:
        for name in ("error_rate", "truncate_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1]")
        if not 400 <= self.error_status <= 599:
            raise ValueError("error_status must be an HTTP error status (400-599)")
        if min(self.latency_s, self.inter_chunk_s, self.prefill_s_per_token) < 0:
            raise ValueError("latencies must be >= 0")
        if self.prefix_cache_tokens < 0:
            raise ValueError("prefix_cache_tokens must be >= 0")


# --- answers -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Usage:
    prompt: int
    completion: int
    reasoning: int
    cached: int


def prompt_bytes(body: JsonObject) -> bytes:
    """The request's conversation as the sim counts its tokens: about four bytes each."""
    return orjson.dumps(body.get("messages") or body.get("input") or body.get("prompt") or "")


def _usage(config: SimModelConfig, body: JsonObject) -> _Usage:
    # About four bytes per token; what matters is that it is deterministic.
    prompt = prompt_tokens(prompt_bytes(body))
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


RESPONSES: dict[str, Callable[[SimModelConfig, JsonObject], JsonObject]] = {
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


EVENTS: dict[str, Callable[[JsonObject, SimModelConfig, JsonObject], list[bytes]]] = {
    "chat": _chunk_events,
    "completions": _chunk_events,
    "responses": _responses_events,
    "messages": _messages_events,
}


# --- command line ------------------------------------------------------------------------
