"""What a call's answer says beyond our own fields, as NeMo Gym's ``ModelCallRecord``
says it (contracts §6): structured tool calls, reasoning text, and the prompt cache.

Gym's model servers write each call's record with these fields, and a row's
``ng_model_call_capture.calls`` keeps every field Gym's record has, so a
reader of Gym's rows reads ours. Each is read the way Gym reads it, whatever
the dialect: Responses ``output`` items, Chat Completions ``choices``,
Anthropic Messages ``content`` blocks; ``usage`` in any of their shapes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

JsonObject = dict[str, Any]


def answer_fields(response: Mapping[str, Any]) -> JsonObject:
    """``tool_calls``, ``reasoning_content``, ``cache_hit``, ``cached_tokens`` and
    ``cache_creation_tokens`` of one answer (an empty answer reports none)."""
    tool_calls, reasoning = tool_calls_and_reasoning(response)
    usage = response.get("usage")
    cache_hit, cached = cache_signal(usage)
    creation = None
    if isinstance(usage, Mapping):
        creation = _count(usage.get("cache_creation_input_tokens"))
    return {
        "tool_calls": tool_calls,
        "reasoning_content": reasoning,
        "cache_hit": cache_hit,
        "cached_tokens": cached,
        "cache_creation_tokens": creation,
    }


def cache_signal(usage: object) -> tuple[bool | None, int | None]:
    """Whether the prompt cache served any token, and how many it served; None, None
    when the answer does not say."""
    if not isinstance(usage, Mapping):
        return None, None
    cached = None
    for group in ("prompt_tokens_details", "input_tokens_details"):
        details = usage.get(group)
        if isinstance(details, Mapping):
            cached = _first_count(details, "cached_tokens", "cached_input_tokens")
            if cached is not None:
                break
    if cached is None:
        cached = _first_count(usage, "cache_read_input_tokens", "cached_input_tokens")
    if cached is None:
        return None, None
    return cached > 0, cached


def tool_calls_and_reasoning(response: Mapping[str, Any]) -> tuple[list[JsonObject], str | None]:
    """The tool calls an answer asks for (``call_id``, ``name``, ``arguments`` as an
    object) and its reasoning text, lines joined; None without any."""
    output = response.get("output")
    if isinstance(output, list):
        return _responses(output)
    choices = response.get("choices")
    if isinstance(choices, list):
        return _chat(choices)
    content = response.get("content")
    if isinstance(content, list):
        return _messages(content)
    return [], None


def _responses(output: list[Any]) -> tuple[list[JsonObject], str | None]:
    calls: list[JsonObject] = []
    reasoning: list[str] = []
    for item in _dicts(output):
        if item.get("type") == "function_call":
            call_id = item.get("call_id") or item.get("id")
            calls.append(_call(call_id, item.get("name"), arguments(item.get("arguments"))))
        elif item.get("type") == "reasoning":
            for summary in _dicts(item.get("summary")):
                text = summary.get("text")
                if isinstance(text, str) and text:
                    reasoning.append(text)
    return calls, "\n".join(reasoning) or None


def _chat(choices: list[Any]) -> tuple[list[JsonObject], str | None]:
    calls: list[JsonObject] = []
    reasoning: list[str] = []
    for choice in _dicts(choices):
        message = choice.get("message")
        if not isinstance(message, Mapping):
            continue
        for call in _dicts(message.get("tool_calls")):
            function = call.get("function") or {}
            if not isinstance(function, Mapping):
                function = {}
            calls.append(
                _call(call.get("id"), function.get("name"), arguments(function.get("arguments")))
            )
        # vLLM says `reasoning`, older servers `reasoning_content` (which wins).
        text = message.get("reasoning_content") or message.get("reasoning")
        if isinstance(text, str) and text:
            reasoning.append(text)
    return calls, "\n".join(reasoning) or None


def _messages(content: list[Any]) -> tuple[list[JsonObject], str | None]:
    calls: list[JsonObject] = []
    reasoning: list[str] = []
    for block in _dicts(content):
        if block.get("type") == "tool_use":
            calls.append(_call(block.get("id"), block.get("name"), block.get("input") or {}))
        elif block.get("type") in _THINKING and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
    return calls, "\n".join(reasoning) or None


def arguments(value: object) -> Any:
    """A tool call's arguments as an object: JSON text parsed, else ``{"_raw": text}``."""
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        # As Gym parses them: the stdlib keeps integers of any size exact.
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return {"_raw": value}
    return {}


_THINKING = ("thinking", "redacted_thinking")


def _call(call_id: object, name: object, args: Any) -> JsonObject:
    return {"call_id": call_id, "name": name, "arguments": args}


def _dicts(items: object) -> list[dict[str, Any]]:
    """The objects of a list; nothing from any other shape (a line is whatever a server wrote)."""
    return [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []


def _first_count(values: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        count = _count(values.get(key))
        if count is not None:
            return count
    return None


def _count(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None
