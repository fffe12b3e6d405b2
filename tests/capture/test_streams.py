"""A streamed (SSE) answer rebuilt from its bytes (``capture/streams.py``), in each
dialect: the capture's records read the same whether the agent streamed or not."""

from __future__ import annotations

from typing import Any

import orjson

from dispatcher.capture.streams import iter_sse_events, reassemble
from dispatcher.capture.tokens import TokenCounts, normalize_usage


def events(*payloads: dict[str, Any] | str, named: bool = False) -> bytes:
    out = []
    for payload in payloads:
        data = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
        kind = payload.get("type") if named and isinstance(payload, dict) else None
        out.append((f"event: {kind}\n" if kind else "") + f"data: {data}\n\n")
    return "".join(out).encode()


def test_sse_parsing_follows_the_spec() -> None:
    body = b": comment\r\nevent: x\r\ndata: a\r\ndata: b\r\n\r\ndata:c\n\ndata: dropped"
    parsed = [(e.event, e.data) for e in iter_sse_events(body)]
    assert parsed == [("x", "a\nb"), (None, "c")]


def test_chat_stream_with_tool_calls_and_reasoning() -> None:
    head = {"id": "c", "model": "m", "created": 1}
    body = events(
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {**head, "choices": [{"index": 0, "delta": {"reasoning_content": "think"}}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "Hi"}}]},
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {"index": 0, "id": "t1", "function": {"name": "f", "arguments": '{"a"'}}
                        ]
                    },
                }
            ],
        },
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]},
                }
            ],
        },
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {**head, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}},
        "[DONE]",
    )

    rebuilt = reassemble("chat", body)

    assert rebuilt.complete
    assert rebuilt.response is not None
    (choice,) = rebuilt.response["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Hi"
    assert choice["message"]["reasoning_content"] == "think"
    assert choice["message"]["tool_calls"] == [
        {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    ]
    assert rebuilt.response["usage"] == {"prompt_tokens": 1, "completion_tokens": 2}


def test_chat_stream_without_done_is_incomplete() -> None:
    body = events({"id": "c", "choices": [{"index": 0, "delta": {"content": "Hi"}}]})
    rebuilt = reassemble("chat", body)
    assert not rebuilt.complete
    assert rebuilt.response is not None


def test_responses_stream_takes_the_terminal_response() -> None:
    final = {"id": "r", "status": "completed", "output": [], "usage": {"input_tokens": 3}}
    body = events(
        {"type": "response.created", "response": {"id": "r", "status": "in_progress"}},
        {"type": "response.output_text.delta", "delta": "x"},
        {"type": "response.completed", "response": final},
        named=True,
    )
    assert reassemble("responses", body).response == final


def test_responses_stream_cut_keeps_the_items_it_finished() -> None:
    item = {"type": "message", "id": "m1", "content": []}
    body = events(
        {"type": "response.created", "response": {"id": "r", "status": "in_progress"}},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
    )
    rebuilt = reassemble("responses", body)
    assert not rebuilt.complete
    assert rebuilt.response == {"id": "r", "status": "in_progress", "output": [item]}


def test_messages_stream_rebuilds_blocks_and_cumulative_usage() -> None:
    start_usage = {"input_tokens": 5, "cache_read_input_tokens": 9, "output_tokens": 1}
    body = events(
        {
            "type": "message_start",
            "message": {"id": "m", "role": "assistant", "content": [], "usage": start_usage},
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "He"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "y"}},
        {"type": "content_block_stop", "index": 0},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '{"q": '},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": "2}"},
        },
        {"type": "content_block_stop", "index": 1},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use"},
            "usage": {"output_tokens": 8},
        },
        {"type": "message_stop"},
        named=True,
    )

    rebuilt = reassemble("messages", body)

    assert rebuilt.complete
    assert rebuilt.response is not None
    assert rebuilt.response["content"] == [
        {"type": "text", "text": "Hey"},
        {"type": "tool_use", "id": "t", "name": "f", "input": {"q": 2}},
    ]
    assert rebuilt.response["stop_reason"] == "tool_use"
    assert normalize_usage(rebuilt.response["usage"]) == TokenCounts(14, 8, None, 9, 22)


def test_error_event_is_reported() -> None:
    body = events({"type": "error", "error": {"type": "overloaded_error"}}, named=True)
    assert reassemble("messages", body).error == {"type": "overloaded_error"}


def test_unknown_dialect_rebuilds_nothing() -> None:
    assert reassemble("embeddings", b"data: {}\n\n").response is None
