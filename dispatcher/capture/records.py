"""One captured model call: what the proxy observes, the line it writes, and how it reads back.

The proxy's hot path only collects bytes and timestamps into an
:class:`Exchange`; parsing JSON, reassembling streams and encoding the line
happen in :func:`encode_record`, which the store runs in a worker thread.
:func:`parse_record` is the reverse, used when a row is finalized.

A line holds ``model_call_id, rollout_id, dialect, path, stream, model_ref,
started_at, completed_at, latency_ms, latency_ttft_ms, status_code,
error_category, request, response`` (contracts §6), plus ``request_raw`` /
``response_raw`` when a body was not JSON and ``error_detail`` when there is one.
Values have the types NeMo Gym's model servers write: ``model_ref`` is
``{"type": "responses_api_models", "name": <the request's model>}``, the times
are Unix seconds.
Request headers are never part of a record, so credentials never reach the disk.
"""

from __future__ import annotations

import time
import uuid
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

import orjson

from dispatcher.capture.call_fields import answer_fields
from dispatcher.capture.streams import reassemble
from dispatcher.capture.tokens import TokenCounts, normalize_usage
from dispatcher.delivery.inflate import GZIP_OR_ZLIB, INFLATED

JsonObject = dict[str, Any]

DIALECT_BY_PATH = {
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/completions": "completions",
}
PAYLOAD_KEYS = ("request", "response", "request_raw", "response_raw")


class ErrorCategory(StrEnum):
    """Why a call did not return a complete answer, as written in ``error_category``."""

    UPSTREAM_HTTP_ERROR = "upstream_http_error"
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_DISCONNECTED = "upstream_disconnected"
    STREAM_TRUNCATED = "stream_truncated"
    STREAM_ERROR = "stream_error"
    INVALID_RESPONSE = "invalid_response"
    CLIENT_DISCONNECTED = "client_disconnected"
    PROXY_ERROR = "proxy_error"


@dataclass(slots=True)
class Exchange:
    """What the proxy saw of one call, filled in as the call progresses."""

    rollout_id: str
    dialect: str
    path: str
    model_call_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started_at: float = field(default_factory=time.time)
    started_perf: float = field(default_factory=time.perf_counter)
    request_body: bytes = b""
    status_code: int | None = None
    content_type: str = ""
    content_encoding: str = ""
    chunks: list[bytes] = field(default_factory=list)
    ttft_s: float | None = None
    duration_s: float | None = None
    error_category: ErrorCategory | None = None
    error_detail: str | None = None
    # The upstream the call went to (its last one, after a fail-over), credentials masked.
    upstream: str | None = None

    @property
    def streamed(self) -> bool:
        return self.content_type.startswith("text/event-stream")

    def on_headers(self, status: int, content_type: str, content_encoding: str) -> None:
        self.status_code = status
        self.content_type = content_type.lower()
        self.content_encoding = content_encoding.lower()
        if status >= 400:
            self.fail(ErrorCategory.UPSTREAM_HTTP_ERROR)

    def on_chunk(self, chunk: bytes) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.started_perf
        self.chunks.append(chunk)

    def fail(self, category: ErrorCategory, detail: str | None = None) -> None:
        """Keep the first failure: later ones are usually its consequences."""
        if self.error_category is None:
            self.error_category = category
            self.error_detail = detail

    def finish(self) -> None:
        if self.duration_s is None:
            self.duration_s = time.perf_counter() - self.started_perf


def encode_record(exchange: Exchange) -> bytes:
    """The capture line of a finished exchange (CPU-heavy for big bodies: run it in a thread)."""
    return orjson.dumps(capture_record(exchange)) + b"\n"


def capture_record(exchange: Exchange) -> JsonObject:
    """The capture record of a finished exchange, as ``encode_record`` writes it."""
    exchange.finish()
    duration_s = exchange.duration_s or 0.0
    request, request_raw = _json_body(exchange.request_body)
    response, response_raw, late_error = _response_view(exchange)
    if late_error is not None:
        exchange.fail(late_error)
    record: JsonObject = {
        "model_call_id": exchange.model_call_id,
        "rollout_id": exchange.rollout_id,
        "dialect": exchange.dialect,
        "path": exchange.path,
        "stream": exchange.streamed,
        "model_ref": model_server_ref(_model_ref(request, response)),
        # Unix seconds, as NeMo Gym's model servers write them, so Gym's readers take ours.
        "started_at": round(exchange.started_at, 6),
        "completed_at": round(exchange.started_at + duration_s, 6),
        "latency_ms": round(duration_s * 1000.0, 3),
        "latency_ttft_ms": _ttft_ms(exchange),
        "status_code": exchange.status_code,
        "error_category": exchange.error_category,
        "request": request,
        "response": response,
    }
    if exchange.error_detail:
        record["error_detail"] = exchange.error_detail
    if exchange.upstream is not None:
        record["upstream"] = exchange.upstream
    if request_raw is not None:
        record["request_raw"] = request_raw
    if response_raw is not None:
        record["response_raw"] = response_raw
    return record


def _response_view(
    exchange: Exchange,
) -> tuple[JsonObject | None, str | None, ErrorCategory | None]:
    body = _decoded(b"".join(exchange.chunks), exchange.content_encoding)
    answered = exchange.status_code is not None and exchange.status_code < 400
    if exchange.streamed:
        rebuilt = reassemble(exchange.dialect, body)
        raw = None if rebuilt.response is not None or not body else _text(body)
        if rebuilt.error is not None:
            return rebuilt.response, raw, ErrorCategory.STREAM_ERROR
        late = ErrorCategory.STREAM_TRUNCATED if answered and not rebuilt.complete else None
        return rebuilt.response, raw, late
    response, raw = _json_body(body)
    late = ErrorCategory.INVALID_RESPONSE if answered and response is None else None
    return response, raw, late


def _json_body(body: bytes) -> tuple[JsonObject | None, str | None]:
    if not body:
        return None, None
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, _text(body)
    if isinstance(value, dict):
        return value, None
    return None, _text(body)


def _decoded(body: bytes, encoding: str) -> bytes:
    if encoding.encode("latin-1", "replace") in INFLATED:
        try:
            return zlib.decompress(body, GZIP_OR_ZLIB)
        except zlib.error:
            return body
    return body


def _text(body: bytes) -> str:
    return body.decode("utf-8", "replace")


def _model_ref(request: JsonObject | None, response: JsonObject | None) -> str | None:
    for source in (request, response):
        model = source.get("model") if source else None
        if isinstance(model, str):
            return model
    return None


def _ttft_ms(exchange: Exchange) -> float | None:
    if not exchange.streamed or exchange.ttft_s is None:
        return None
    return round(exchange.ttft_s * 1000.0, 3)


# --- reading back ------------------------------------------------------------------------
#
# Two writers produce these lines: our proxy (``model_ref`` the request's model
# name, ISO timestamps) and NeMo Gym's model servers (``model_ref`` a
# ``{type, name}`` object naming the model server, Unix-second timestamps,
# sometimes ``client_session_id``). Both read into one CapturedCall. A line is
# whatever some server wrote: every field is checked for its shape, and a shape
# we do not expect reads as "not reported", never as an exception.

MODEL_SERVER_TYPE = "responses_api_models"


@dataclass(frozen=True, slots=True)
class ToolCallRef:
    tool_call_id: str | None
    tool_name: str | None


@dataclass(frozen=True, slots=True)
class CapturedCall:
    """A capture line as finalization needs it; ``payloads`` only when asked for."""

    model_call_id: str
    call_index: int
    dialect: str | None
    model_ref: str | dict[str, str] | None
    request_model: str | None
    response_model: str | None
    response_id: str | None
    response_status: str | None
    finish_reason: str | None
    client_session_id: str | None
    started_at: float | None
    completed_at: float | None
    latency_ms: float | None
    latency_ttft_ms: float | None
    status_code: int | None
    error_category: str | None
    tokens: TokenCounts
    tool_calls: tuple[ToolCallRef, ...]
    has_response: bool
    payloads: JsonObject | None = None
    # How Gym's model server produced the answer (its capture records say; ours do not).
    execution: JsonObject = field(default_factory=dict)
    # Gym's fields read from the answer: tool calls, reasoning, the cache (``call_fields``).
    answer: JsonObject = field(default_factory=dict)

    @property
    def returned_response(self) -> bool:
        """True when the call produced an answer an agent could act on: one turn."""
        ok = self.status_code is not None and 200 <= self.status_code < 300
        return ok and self.has_response and self.error_category is None

    def to_row(self, *, include_payloads: bool) -> JsonObject:
        """The call as ``ng_model_call_capture.calls`` lists it: our keys plus every
        field of Gym's ``ModelCallRecord`` (None where the record does not say)."""
        row: JsonObject = {
            "model_call_id": self.model_call_id,
            "call_index": self.call_index,
            "dialect": self.dialect,
            "model_ref": self.model_ref,
            "model": self.response_model or self.request_model,
            "response_id": self.response_id,
            "response_status": self.response_status,
            "finish_reason": self.finish_reason,
            "started_at": self.started_at,
            "completed_at": self.completed_at,
            "latency_ms": self.latency_ms,
            "latency_total_ms": self.latency_ms,
            "latency_ttft_ms": self.latency_ttft_ms,
            "status_code": self.status_code,
            "error_category": self.error_category,
            **token_fields(self.tokens),
            "num_tool_calls": len(self.tool_calls),
            "client_session_id": self.client_session_id,
            **{key: self.execution.get(key) for key in _EXECUTION_KEYS},
            **EMPTY_ANSWER,
            **self.answer,
        }
        if include_payloads and self.payloads:
            row.update(self.payloads)
        return row


EMPTY_ANSWER = answer_fields({})


def token_fields(tokens: TokenCounts) -> JsonObject:
    """Token counts under the names rows use (``ng_model_call_capture`` metrics and calls)."""
    return {
        "tokens_in": tokens.prompt,
        "tokens_out": tokens.completion,
        "tokens_reasoning": tokens.reasoning,
        "tokens_total": tokens.total,
        "cached_tokens": tokens.cached,
    }


def model_server_ref(model_ref: object) -> dict[str, str] | None:
    """A record's ``model_ref`` as Gym's ``{type, name}``: Gym writes that object; our proxy
    writes the model's name, which stands for the server that serves it."""
    if isinstance(model_ref, str) and model_ref:
        return {"type": MODEL_SERVER_TYPE, "name": model_ref}
    if isinstance(model_ref, Mapping):
        name, kind = model_ref.get("name"), model_ref.get("type")
        if isinstance(name, str) and kind == MODEL_SERVER_TYPE:
            return {"type": MODEL_SERVER_TYPE, "name": name}
    return None


def parse_record(
    line: bytes, *, call_index: int = 0, include_payloads: bool
) -> CapturedCall | None:
    """A capture line → CapturedCall; None when the line is not a readable record."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("model_call_id"), str):
        return None
    response = _dict(record.get("response"))
    request = _dict(record.get("request"))
    dialect = _str(record.get("dialect"))
    payloads = None
    if include_payloads:
        payloads = {key: record[key] for key in PAYLOAD_KEYS if record.get(key) is not None}
    return CapturedCall(
        model_call_id=record["model_call_id"],
        call_index=call_index,
        dialect=dialect,
        model_ref=_model_ref_of(record.get("model_ref")),
        request_model=_str(request.get("model")),
        response_model=_str(response.get("model")),
        response_id=_str(response.get("id")),
        response_status=_str(response.get("status")),
        finish_reason=finish_reason_of(response),
        client_session_id=_str(record.get("client_session_id")),
        started_at=timestamp(record.get("started_at")),
        completed_at=timestamp(record.get("completed_at")),
        latency_ms=_number(record.get("latency_ms", record.get("latency_total_ms"))),
        latency_ttft_ms=_number(record.get("latency_ttft_ms")),
        status_code=_int(record.get("status_code")),
        error_category=_str(record.get("error_category")),
        tokens=normalize_usage(response.get("usage")),
        tool_calls=tool_calls_of(dialect, response),
        has_response=isinstance(record.get("response"), dict),
        payloads=payloads,
        execution=execution_of(record),
        answer=answer_fields(response),
    )


_EXECUTION_KEYS = {
    "upstream_attempted": bool,
    "response_source": str,
    "upstream_status_code": int,
    "local_response_reason": str,
}


def execution_of(record: Mapping[str, Any]) -> JsonObject:
    """Gym's facts about how an answer was produced, each kept only in its expected type."""
    return {
        key: record[key]
        for key, kind in _EXECUTION_KEYS.items()
        if isinstance(record.get(key), kind) and not (kind is int and isinstance(record[key], bool))
    }


def _model_ref_of(value: object) -> str | dict[str, str] | None:
    if isinstance(value, str):
        return value
    return model_server_ref(value)


def timestamp(value: object) -> float | None:
    """Unix seconds from Gym's float or our proxy's ISO 8601 string."""
    number = _number(value)
    if number is not None:
        return number
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            return None
    return None


def finish_reason_of(response: Mapping[str, Any]) -> str | None:
    """Why the model stopped, from whichever place the dialect reports it."""
    choices = response.get("choices")
    first = _dict(choices[0]) if isinstance(choices, list) and choices else {}
    details = _dict(response.get("incomplete_details"))
    for value in (response.get("stop_reason"), first.get("finish_reason"), details.get("reason")):
        if isinstance(value, str):
            return value
    return None


def tool_calls_of(dialect: str | None, response: Mapping[str, Any]) -> tuple[ToolCallRef, ...]:
    """Tool calls a response asks for, in order, whatever the dialect."""
    if dialect == "responses":
        return tuple(
            ToolCallRef(_str(i.get("call_id") or i.get("id")), _str(i.get("name")))
            for i in _dicts(response.get("output"))
            if str(i.get("type", "")).endswith("_call")
        )
    if dialect == "messages":
        return tuple(
            ToolCallRef(_str(b.get("id")), _str(b.get("name")))
            for b in _dicts(response.get("content"))
            if b.get("type") in ("tool_use", "server_tool_use")
        )
    return _chat_tool_calls(response)


def _chat_tool_calls(response: Mapping[str, Any]) -> tuple[ToolCallRef, ...]:
    refs: list[ToolCallRef] = []
    for choice in _dicts(response.get("choices")):
        for call in _dicts(_dict(choice.get("message")).get("tool_calls")):
            function = _dict(call.get("function"))
            refs.append(ToolCallRef(_str(call.get("id")), _str(function.get("name"))))
    return tuple(refs)


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _dicts(value: object) -> list[dict[str, Any]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None
