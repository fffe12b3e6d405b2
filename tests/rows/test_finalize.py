"""A row's line and facts (``rows/finalize.py``): what ``Job.record`` reads of a row,
and the line itself, for the answers of the agents the benchmarks meet."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from dispatcher.delivery.answers import Attempt, classify_response
from dispatcher.outcome import Outcome
from dispatcher.rows.capture import attach_agent_trajectory
from dispatcher.rows.finalize import GENERATED_TOKENS, Finalizer, row_facts
from dispatcher.settings.config import RunSettings
from dispatcher.tasks.materialize import Rollout

REQUEST = {
    "agent_ref": {"name": "sim"},
    "responses_create_params": {"input": [{"role": "user", "content": "Solve 7."}]},
    "expected_answer": "7",
    "_ng_task_index": 7,
    "_ng_rollout_index": 0,
}
# A Responses API answer of the shape a plain agent sends: the request echoed back.
RESPONSE = {
    "id": "resp_7",
    "created_at": 1796435940.8194983,
    "output": [{"type": "message", "content": [{"type": "output_text", "text": "7"}]}],
    "usage": {"input_tokens": 24, "output_tokens": 12, "total_tokens": 36},
}
ANSWER = orjson.dumps({**REQUEST, "response": RESPONSE, "reward": 1.0})


def finalizer(count_tokens: bool = True) -> Finalizer:
    settings = RunSettings(input=Path("tasks.jsonl"), output=Path("out.jsonl"))
    made = Finalizer(settings, None, count_tokens=count_tokens)  # type: ignore[arg-type]
    made.run_id = "run"
    return made


def attempt_of(body: bytes, status: int = 200) -> Attempt:
    outcome, result, failure = classify_response(status, body)
    started = time.time()
    return Attempt(outcome, "http://agent", started, 0.25, result, failure, body_bytes=len(body))


def test_facts_carry_the_generated_tokens_only_where_they_are_counted() -> None:
    row = {"reward": 0.5, "response": {"usage": {"output_tokens": 12}}}
    assert row_facts(row) == {"reward": 0.5, GENERATED_TOKENS: 12}
    assert row_facts(row, count_tokens=False) == {"reward": 0.5}


def test_facts_are_the_keys_the_finality_rule_and_coverage_read() -> None:
    row = {
        "_ng_failure_class": "agent_run_error",
        "_ng_failure_terminal": True,
        "_ng_failure_not_delivered": True,
        "mask_sample": True,
        "reward": None,
        "other": 1,
    }
    assert row_facts(row, count_tokens=False) == {k: v for k, v in row.items() if k != "other"}


@pytest.mark.parametrize("count_tokens", [True, False])
def test_the_line_is_the_same_whether_tokens_are_counted(count_tokens: bool) -> None:
    rollout = Rollout.from_materialized(dict(REQUEST), 0)
    attempt = attempt_of(ANSWER)
    line, facts, capture = finalizer(count_tokens).finalize_now(rollout, attempt)
    assert isinstance(line, bytes) and line.endswith(b"\n") and line.count(b"\n") == 1
    row = orjson.loads(line)
    stamp = row.pop("_ng_dispatch")
    assert stamp["rollout_id"] == "7-0" and stamp["replica"] == "http://agent"
    # The agent's keys in its order, then the dispatcher's (contracts §4).
    assert list(row) == [
        "responses_create_params",
        "expected_answer",
        "response",
        "reward",
        "_ng_task_index",
        "_ng_rollout_index",
        "agent_ref",
        "_ng_rollout_id",
        "_ng_run_id",
    ]
    assert row["response"] == RESPONSE and row["reward"] == 1.0
    assert facts == ({"reward": 1.0, GENERATED_TOKENS: 12} if count_tokens else {"reward": 1.0})
    assert capture == {}


def test_a_failure_the_agent_reports_has_its_facts() -> None:
    body = orjson.dumps({**REQUEST, "_ng_failure_class": "agent_run_error", "reward": 0.0})
    rollout = Rollout.from_materialized(dict(REQUEST), 0)
    attempt = attempt_of(body)
    assert attempt.outcome is Outcome.AGENT_REPORTED_FAILURE
    line, facts, _ = finalizer(count_tokens=False).finalize_now(rollout, attempt)
    assert line is not None and orjson.loads(line)["_ng_failure_type"] == "AgentReportedFailure"
    # The failure keys it left out are the defaults (contracts §5).
    assert facts == {
        "_ng_failure_class": "agent_run_error",
        "_ng_failure_terminal": False,
        "reward": 0.0,
    }


@pytest.mark.parametrize("key", ["ng_trajectory", "ng_agent_observations"])
def test_an_agent_trajectory_is_normalized_when_the_answer_has_either_key(key: str) -> None:
    row: dict[str, Any] = {"_ng_task_index": 0}
    attach_agent_trajectory(row, rollout_id="0-0", task_id=0, agent_result={key: {}})
    assert row["ng_trajectory"]["rollout_id"] == "0-0"


def test_an_answer_without_a_trajectory_leaves_the_row_as_it_is() -> None:
    row: dict[str, Any] = {"_ng_task_index": 0}
    attach_agent_trajectory(row, rollout_id="0-0", task_id=0, agent_result={"reward": 1})
    attach_agent_trajectory(row, rollout_id="0-0", task_id=0, agent_result=None)
    assert row == {"_ng_task_index": 0}
