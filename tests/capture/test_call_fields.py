"""A row's calls keep every field of NeMo Gym 0.7.0's ``ModelCallRecord`` (contracts §6).

``tests/gym/test_gym_schema.py`` compares values with Gym's own collector on
the same capture files; this checks the names without Gym installed.
"""

from __future__ import annotations

import orjson

from dispatcher.capture.call_fields import answer_fields
from dispatcher.capture.records import parse_record

# ``nemo_gym.base_responses_api_model.ModelCallRecord``'s fields but the payloads
# (Gym leaves those out of a row too, unless asked).
GYM_MODEL_CALL_RECORD = {
    "model_call_id", "response_id", "client_session_id", "call_index", "model_ref", "model",
    "dialect", "status_code", "response_status", "finish_reason", "upstream_attempted",
    "response_source", "upstream_status_code", "local_response_reason", "started_at",
    "completed_at", "tokens_in", "tokens_out", "tokens_reasoning", "tokens_total", "tool_calls",
    "reasoning_content", "cache_hit", "cached_tokens", "cache_creation_tokens", "error_category",
    "latency_total_ms", "latency_ttft_ms",
}  # fmt: skip


def test_every_field_of_gyms_record_is_in_a_rows_call_even_when_unreported() -> None:
    call = parse_record(orjson.dumps({"model_call_id": "x"}), include_payloads=False)
    assert call is not None
    row = call.to_row(include_payloads=False)
    assert not GYM_MODEL_CALL_RECORD - set(row)
    assert row["tool_calls"] == [] and row["cache_hit"] is None


def test_tool_calls_reasoning_and_cache_of_each_dialect() -> None:
    big = '{"n": 12345678901234567890123}'
    responses = {
        "output": [
            {"type": "reasoning", "summary": [{"text": "a"}, {"text": "b"}, 5]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": big},
        ],
        "usage": {"input_tokens_details": {"cached_tokens": 0}},
    }  # fmt: skip
    fields = answer_fields(responses)
    assert fields["tool_calls"] == [
        {"call_id": "c", "name": "f", "arguments": {"n": 12345678901234567890123}}
    ]
    assert fields["reasoning_content"] == "a\nb"
    assert (fields["cache_hit"], fields["cached_tokens"]) == (False, 0)
    messages = {
        "content": [{"type": "tool_use", "id": "u", "name": "g"}],
        "usage": {"cache_read_input_tokens": 7, "cache_creation_input_tokens": 2},
    }
    fields = answer_fields(messages)
    assert fields["tool_calls"] == [{"call_id": "u", "name": "g", "arguments": {}}]
    assert (fields["cache_hit"], fields["cached_tokens"], fields["cache_creation_tokens"]) == (
        True,
        7,
        2,
    )
    chat = {"choices": [{"message": {"tool_calls": 5, "reasoning_content": "r"}}], "usage": 3}
    assert answer_fields(chat) == {
        "tool_calls": [],
        "reasoning_content": "r",
        "cache_hit": None,
        "cached_tokens": None,
        "cache_creation_tokens": None,
    }
