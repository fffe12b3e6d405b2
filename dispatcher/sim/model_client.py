"""How the simulated agent calls a model through the capture proxy.

:func:`call_model` makes one call in any dialect, streamed or not, under the
rollout's ``/ng-rollout/<rollout_id>/`` prefix, and returns the final response
object (a stream is reassembled the way the proxy records it).
:func:`agent_trajectory` builds the ``ng_trajectory`` an agent may return,
referencing its calls by ``(model_ref, response_id)``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import orjson

from dispatcher.capture.records import DIALECT_BY_PATH
from dispatcher.capture.streams import reassemble

JsonObject = dict[str, Any]

DIALECT_PATHS = {dialect: path for path, dialect in DIALECT_BY_PATH.items()}


class ModelCallError(Exception):
    """The model (or the proxy in front of it) did not give a complete answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"model call failed with HTTP {status}: {message}")
        self.status = status


def request_body(
    dialect: str,
    *,
    stream: bool,
    prompt: str,
    model: str,
    messages: Sequence[Mapping[str, str]] | None = None,
) -> JsonObject:
    """A minimal valid request of ``dialect`` (``messages``, for chat: the conversation so
    far); usage is asked for on streams too."""
    messages = list(messages) if messages else [{"role": "user", "content": prompt}]
    body: JsonObject
    if dialect == "chat":
        body = {"model": model, "messages": messages}
    elif dialect == "responses":
        body = {"model": model, "input": prompt}
    elif dialect == "messages":
        body = {"model": model, "max_tokens": 1024, "messages": messages}
    elif dialect == "completions":
        body = {"model": model, "prompt": prompt}
    else:
        raise ValueError(f"unknown dialect {dialect!r}; expected one of {sorted(DIALECT_PATHS)}")
    body["stream"] = stream
    if stream and dialect in ("chat", "completions"):
        body["stream_options"] = {"include_usage": True}
    return body


async def call_model(
    session: aiohttp.ClientSession,
    base_url: str,
    rollout_id: str,
    *,
    dialect: str,
    stream: bool,
    prompt: str = "Solve the task.",
    model: str = "sim-model",
    headers: Mapping[str, str] | None = None,
    messages: Sequence[Mapping[str, str]] | None = None,
) -> JsonObject:
    """POST one call to ``{base_url}/ng-rollout/{rollout_id}/v1/...``; the final response."""
    body = request_body(dialect, stream=stream, prompt=prompt, model=model, messages=messages)
    url = f"{base_url.rstrip('/')}/ng-rollout/{rollout_id}{DIALECT_PATHS[dialect]}"
    sent_headers = {"Content-Type": "application/json", **(headers or {})}
    async with session.post(url, data=orjson.dumps(body), headers=sent_headers) as answer:
        payload = await answer.read()
        status = answer.status
    if status >= 400:
        raise ModelCallError(status, payload[:2000].decode("utf-8", "replace"))
    if stream:
        rebuilt = reassemble(dialect, payload)
        if rebuilt.response is None or not rebuilt.complete:
            raise ModelCallError(status, "stream ended before its final event")
        return rebuilt.response
    value = orjson.loads(payload)
    if not isinstance(value, dict):
        raise ModelCallError(status, "answer is not a JSON object")
    return value


def agent_trajectory(
    *,
    task_id: int | str,
    rollout_id: str,
    responses: Sequence[Mapping[str, Any]],
    model_ref: str,
    invocation_id: str = "agent",
) -> JsonObject:
    """An agent-side ``ng_trajectory`` in NeMo Gym's ``TrajectoryRecord`` shape: one
    invocation, one turn per response, calls referenced by ``(model_ref, response_id)``
    with ``model_ref`` naming the model server as Gym does (``{type, name}``)."""
    server = {"type": "responses_api_models", "name": model_ref}
    answered = [r for r in responses if isinstance(r.get("id"), str)]
    refs = [{"model_ref": server, "response_id": r["id"]} for r in answered]
    turns = [
        {
            "invocation_id": invocation_id,
            "task_id": str(task_id),
            "rollout_id": rollout_id,
            "turn_no": n,
            "timestamp": time.time(),
            "answer": _answer(response),
            "step_count": 0,
            "model_calls": [ref],
        }
        for n, (response, ref) in enumerate(zip(answered, refs, strict=True), start=1)
    ]
    return {
        "schema_version": "1.0",
        "task_id": str(task_id),
        "rollout_id": rollout_id,
        "invocations": [
            {"invocation_id": invocation_id, "status": "completed", "model_calls": refs}
        ],
        "turns": turns,
        "tool_calls": [],
        "gaps": [],
    }


def _answer(response: Mapping[str, Any]) -> Any:
    for key in ("output", "choices", "content"):
        if response.get(key) is not None:
            return response[key]
    return None
