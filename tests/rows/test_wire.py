"""A big answer split at its top level (``rows/wire.py``): what the dispatcher reads
of it is decoded, the rest stays the agent's bytes; a body the splitter cannot
vouch for is classed by the full parse, as a small one is."""

from __future__ import annotations

from typing import Any

import msgspec
import orjson
import pytest

from dispatcher.delivery.client import classify_response
from dispatcher.outcome import Outcome
from dispatcher.rows.capture import attach_agent_trajectory
from dispatcher.rows.finalize import GENERATED_TOKENS, row_facts
from dispatcher.rows.jsonworker import answer_for
from dispatcher.rows.wire import (
    DecodedView,
    WireResult,
    classify_big,
    numbers_in_range,
    row_line,
    split_body,
    wire_result,
)
from tests.rows.test_big_rows import big_body, joined

# Deeper than the decoder goes (the interpreter's recursion limit).
DEEP = b'"deep":' + b"[" * 5000 + b"]" * 5000


def test_a_body_nested_too_deep_is_a_protocol_violation_as_the_full_parse_says() -> None:
    body = big_body(extra=DEEP)
    assert split_body(body) is None
    outcome, result, failure = classify_big(200, body)
    assert (outcome, result) == (Outcome.PROTOCOL_VIOLATION, None)
    assert failure == classify_response(200, body)[2]


def test_the_worker_process_classes_a_body_nested_too_deep_not_as_our_fault() -> None:
    kind, answer = answer_for(big_body(extra=DEEP))
    assert kind == "classified" and answer[0] is Outcome.PROTOCOL_VIOLATION


def test_the_reward_and_the_mask_a_row_is_counted_by_are_decoded() -> None:
    body = big_body(extra=b'"mask_sample":true,"other":[1]')
    _, result, _ = classify_big(200, body)
    assert isinstance(result, WireResult)
    assert result["reward"] == 1.0 and result["mask_sample"] is True
    assert isinstance(result["other"], msgspec.Raw)
    # What service mode's group filter and the run's coverage read (rows/finalize.py).
    assert row_facts(result, count_tokens=False) == {"reward": 1.0, "mask_sample": True}


def test_a_big_rows_generated_tokens_are_counted_from_its_kept_response() -> None:
    # A token target (service mode) counts them: a big row counted none before.
    usage = b'"response":{"output":[{"type":"message"}],"usage":{"output_tokens":12}}'
    _, result, _ = classify_big(200, big_body(extra=usage))
    assert isinstance(result, WireResult) and isinstance(result["response"], msgspec.Raw)
    assert row_facts(result) == {"reward": 1.0, GENERATED_TOKENS: 12}
    # A response of another shape counts none, as a parsed one does.
    for odd in (b'"response":[1]', b'"response":{"usage":"x"}', b'"response":null'):
        _, result, _ = classify_big(200, big_body(extra=odd))
        assert row_facts(result) == {"reward": 1.0}


@pytest.mark.parametrize(
    ("kept", "task_id"),
    [(b'"t-1"', "t-1"), (b"12", "12"), (b"null", "7")],
)
def test_a_trajectory_names_the_task_id_a_big_row_keeps_as_bytes(kept: bytes, task_id: str) -> None:
    row: dict[str, Any] = {"task_id": msgspec.Raw(kept), "_ng_task_index": 7}
    attach_agent_trajectory(row, rollout_id="7-0", task_id=7, agent_result={"ng_trajectory": {}})
    assert row["ng_trajectory"]["task_id"] == task_id


def test_a_decoded_view_reads_a_row_of_kept_and_plain_values() -> None:
    row = {"kept": msgspec.Raw(b'{"a":[1,2]}'), "plain": {"b": 1}}
    view = DecodedView(row)
    assert dict(view) == {"kept": {"a": [1, 2]}, "plain": {"b": 1}}
    assert orjson.loads(orjson.dumps(dict(view))) == dict(view)


def test_a_decoded_view_says_a_key_is_there_without_decoding_its_value() -> None:
    view = DecodedView({"bad": msgspec.Raw(b"[1e400]")})
    assert "bad" in view and "other" not in view


def test_numbers_in_range_and_number_like_text_in_strings_are_still_split() -> None:
    numbers = b"[1e-400,1.7976931348623157e308,-5e-324,1E+99," + b"9" * 4300 + b"]"
    text = b'"msg_ab12e345 x1e999 a-e400","' + b"1" * 300 + b'"'
    body = big_body(extra=b'"n":' + numbers + b',"t":[' + text + b"]")
    split = split_body(body)
    assert split is not None
    line = joined(row_line(wire_result(body, split)))
    assert numbers in line and text in line


def test_a_body_with_more_suspects_than_a_look_is_worth_takes_the_full_parse() -> None:
    body = b'{"h":"' + b"ae123," * 2000 + b'"}'
    assert not numbers_in_range(body)
    assert split_body(body) is None
    assert classify_big(200, body)[0] is Outcome.SUCCESS
