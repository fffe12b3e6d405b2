"""Reassemble a streamed (SSE) model answer into the object a non-streamed call returns.

The proxy relays a stream untouched and keeps a copy of its bytes; this module
turns that copy into one final response with its usage, so a capture record
reads the same whether the agent streamed or not. ``complete`` says whether the
stream reached its dialect's terminal event: a stream that ends without one was
cut short even if the connection closed cleanly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

JsonObject = dict[str, Any]


@dataclass(frozen=True, slots=True)
class SseEvent:
    event: str | None
    data: str


@dataclass(frozen=True, slots=True)
class Reassembled:
    """The final response rebuilt from a stream; ``error`` is an error event's payload."""

    response: JsonObject | None
    complete: bool
    error: JsonObject | None = None


def iter_sse_events(body: bytes) -> Iterator[SseEvent]:
    """Events of an SSE body; a trailing event without its blank line is dropped, per the spec."""
    text = body.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")
    blocks = text.split("\n\n")
    for block in blocks[:-1]:
        event, data = _parse_block(block)
        if data is not None:
            yield SseEvent(event, data)


def _parse_block(block: str) -> tuple[str | None, str | None]:
    event: str | None = None
    data: list[str] = []
    for line in block.split("\n"):
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
    return event, ("\n".join(data) if data else None)


def reassemble(dialect: str, body: bytes) -> Reassembled:
    """Rebuild the final response of a stream in one of the four dialects."""
    builder = _BUILDERS.get(dialect)
    if builder is None:
        return Reassembled(None, complete=False)
    return builder(iter_sse_events(body))


def _loads_object(data: str) -> JsonObject | None:
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


# --- chat/completions and completions --------------------------------------------------


@dataclass
class _ToolCallParts:
    id: str | None = None
    type: str = "function"
    name: str = ""
    arguments: list[str] = field(default_factory=list)

    def add(self, delta: JsonObject) -> None:
        self.id = delta.get("id") or self.id
        self.type = delta.get("type") or self.type
        function = delta.get("function") or {}
        self.name += function.get("name") or ""
        self.arguments.append(function.get("arguments") or "")

    def build(self) -> JsonObject:
        function = {"name": self.name, "arguments": "".join(self.arguments)}
        return {"id": self.id, "type": self.type, "function": function}


@dataclass
class _ChoiceParts:
    index: int
    role: str = "assistant"
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, _ToolCallParts] = field(default_factory=dict)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, choice: JsonObject) -> None:
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            # Legacy completions stream carries text on the choice itself.
            delta = {"content": choice.get("text")}
        self.role = delta.get("role") or self.role
        self.content.append(delta.get("content") or "")
        # vLLM and SGLang name the reasoning channel differently.
        self.reasoning.append(delta.get("reasoning_content") or delta.get("reasoning") or "")
        for call in delta.get("tool_calls") or []:
            self.tool_calls.setdefault(call.get("index", 0), _ToolCallParts()).add(call)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            self.logprobs.extend(logprobs["content"])
        self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def build_message(self) -> JsonObject:
        message: JsonObject = {"role": self.role, "content": "".join(self.content)}
        reasoning = "".join(self.reasoning)
        if reasoning:
            message["reasoning_content"] = reasoning
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i].build() for i in sorted(self.tool_calls)]
        choice: JsonObject = {"index": self.index, "message": message}
        choice["finish_reason"] = self.finish_reason
        if self.logprobs:
            choice["logprobs"] = {"content": self.logprobs}
        return choice

    def build_text(self) -> JsonObject:
        text = "".join(self.content)
        return {"index": self.index, "text": text, "finish_reason": self.finish_reason}


@dataclass
class _ChunkStream:
    head: JsonObject = field(default_factory=dict)
    choices: dict[int, _ChoiceParts] = field(default_factory=dict)
    usage: JsonObject | None = None
    error: JsonObject | None = None
    done: bool = False

    def feed(self, events: Iterator[SseEvent]) -> None:
        for event in events:
            if event.data.strip() == "[DONE]":
                self.done = True
                continue
            chunk = _loads_object(event.data)
            if chunk is not None:
                self._add(chunk)

    def _add(self, chunk: JsonObject) -> None:
        if isinstance(chunk.get("error"), dict):
            self.error = chunk["error"]
        for key in ("id", "created", "model", "system_fingerprint"):
            if key in chunk:
                self.head.setdefault(key, chunk[key])
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            self.choices.setdefault(index, _ChoiceParts(index)).add(choice)


def _reassemble_chat(events: Iterator[SseEvent]) -> Reassembled:
    stream = _ChunkStream()
    stream.feed(events)
    if not stream.head and not stream.choices:
        return Reassembled(None, stream.done, stream.error)
    choices = [stream.choices[i].build_message() for i in sorted(stream.choices)]
    response = {**stream.head, "object": "chat.completion", "choices": choices}
    response["usage"] = stream.usage
    return Reassembled(response, stream.done, stream.error)


def _reassemble_completions(events: Iterator[SseEvent]) -> Reassembled:
    stream = _ChunkStream()
    stream.feed(events)
    if not stream.head and not stream.choices:
        return Reassembled(None, stream.done, stream.error)
    choices = [stream.choices[i].build_text() for i in sorted(stream.choices)]
    response = {**stream.head, "object": "text_completion", "choices": choices}
    response["usage"] = stream.usage
    return Reassembled(response, stream.done, stream.error)


# --- responses ---------------------------------------------------------------------------

_RESPONSES_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


def _reassemble_responses(events: Iterator[SseEvent]) -> Reassembled:
    snapshot: JsonObject | None = None
    items: dict[int, JsonObject] = {}
    error: JsonObject | None = None
    for event in events:
        payload = _loads_object(event.data)
        if payload is None:
            continue
        kind = payload.get("type") or event.event
        if kind in _RESPONSES_TERMINAL and isinstance(payload.get("response"), dict):
            # The terminal event carries the whole response, usage included.
            return Reassembled(payload["response"], complete=True, error=error)
        if isinstance(payload.get("response"), dict):
            snapshot = payload["response"]
        elif kind == "response.output_item.done" and isinstance(payload.get("item"), dict):
            items[payload.get("output_index", len(items))] = payload["item"]
        elif kind == "error":
            error = payload
    if snapshot is None:
        return Reassembled(None, complete=False, error=error)
    partial = {**snapshot, "output": [items[i] for i in sorted(items)]}
    return Reassembled(partial, complete=False, error=error)


# --- messages (Anthropic) ----------------------------------------------------------------


@dataclass
class _MessageStream:
    message: JsonObject | None = None
    blocks: dict[int, JsonObject] = field(default_factory=dict)
    partial_json: dict[int, list[str]] = field(default_factory=dict)
    error: JsonObject | None = None
    done: bool = False

    def add(self, kind: str | None, payload: JsonObject) -> None:
        handler = _MESSAGE_HANDLERS.get(kind or "")
        if handler is not None:
            handler(self, payload)

    def start(self, payload: JsonObject) -> None:
        if isinstance(payload.get("message"), dict):
            self.message = dict(payload["message"])

    def block_start(self, payload: JsonObject) -> None:
        block = payload.get("content_block")
        if isinstance(block, dict):
            self.blocks[payload.get("index", len(self.blocks))] = dict(block)

    def block_delta(self, payload: JsonObject) -> None:
        index, delta = payload.get("index", 0), payload.get("delta") or {}
        block = self.blocks.setdefault(index, {"type": "text", "text": ""})
        kind = delta.get("type")
        if kind == "text_delta":
            block["text"] = block.get("text", "") + (delta.get("text") or "")
        elif kind == "thinking_delta":
            block["thinking"] = block.get("thinking", "") + (delta.get("thinking") or "")
        elif kind == "signature_delta":
            block["signature"] = delta.get("signature")
        elif kind == "input_json_delta":
            self.partial_json.setdefault(index, []).append(delta.get("partial_json") or "")

    def block_stop(self, payload: JsonObject) -> None:
        index = payload.get("index", 0)
        parts = self.partial_json.pop(index, None)
        if parts is not None and index in self.blocks:
            text = "".join(parts)
            parsed = _loads_object(text) if text else {}
            self.blocks[index]["input"] = parsed if parsed is not None else text

    def message_delta(self, payload: JsonObject) -> None:
        if self.message is None:
            self.message = {}
        self.message.update(payload.get("delta") or {})
        usage = payload.get("usage")
        if isinstance(usage, dict):
            # message_delta's counts are cumulative and supersede message_start's.
            merged = dict(self.message.get("usage") or {})
            merged.update({k: v for k, v in usage.items() if v is not None})
            self.message["usage"] = merged

    def stop(self, payload: JsonObject) -> None:
        self.done = True

    def fail(self, payload: JsonObject) -> None:
        self.error = payload.get("error") if isinstance(payload.get("error"), dict) else payload


_MESSAGE_HANDLERS: dict[str, Callable[[_MessageStream, JsonObject], None]] = {
    "message_start": _MessageStream.start,
    "content_block_start": _MessageStream.block_start,
    "content_block_delta": _MessageStream.block_delta,
    "content_block_stop": _MessageStream.block_stop,
    "message_delta": _MessageStream.message_delta,
    "message_stop": _MessageStream.stop,
    "error": _MessageStream.fail,
}


def _reassemble_messages(events: Iterator[SseEvent]) -> Reassembled:
    stream = _MessageStream()
    for event in events:
        payload = _loads_object(event.data)
        if payload is not None:
            stream.add(payload.get("type") or event.event, payload)
    if stream.message is None:
        return Reassembled(None, complete=stream.done, error=stream.error)
    content = [stream.blocks[i] for i in sorted(stream.blocks)]
    return Reassembled({**stream.message, "content": content}, stream.done, stream.error)


_BUILDERS: dict[str, Callable[[Iterator[SseEvent]], Reassembled]] = {
    "chat": _reassemble_chat,
    "completions": _reassemble_completions,
    "responses": _reassemble_responses,
    "messages": _reassemble_messages,
}
