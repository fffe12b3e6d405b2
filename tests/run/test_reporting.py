"""The ``rollout_finished`` event: its fields and levels, the same line by either path."""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import structlog

from dispatcher.delivery.answers import Attempt, Failure
from dispatcher.outcome import Outcome
from dispatcher.run.reporting import RolloutFinishedLog
from dispatcher.tasks.materialize import Rollout
from dispatcher.telemetry.event_log import EventLog
from dispatcher.telemetry.logs import configure_logging, get_logger, reset_logging

ROLLOUT = Rollout(
    task_index=7, rollout_index=2, attempt_index=1, rollout_id="7-2", agent="a", body={}
)
FAILURE = Failure("agent_run_error", "HTTPError", 'boom "\n', http_status=500)
TERMINAL_ROW = {"_ng_failure_terminal": True}


def attempt(failure: Failure | None = None) -> Attempt:
    outcome = Outcome.SUCCESS if failure is None else Outcome.AGENT_RUN_ERROR
    return Attempt(outcome, "http://127.0.0.1:1", 0.0, 1.0, failure=failure, retries=3)


# (outcome, final, duration_s, attempt, row, capture): each way the line can go.
CASES: list[tuple[Outcome, bool, float, Attempt | None, Any, Any]] = [
    (Outcome.SUCCESS, True, 0.123456, attempt(), {}, None),
    (Outcome.SUCCESS, True, 1.5, attempt(), {}, {"calls": 2, "gaps": ["x"], "wait_s": 1e20}),
    (Outcome.AGENT_RUN_ERROR, False, 2.0, attempt(FAILURE), {}, None),
    (Outcome.AGENT_RUN_ERROR, True, 2.0, attempt(FAILURE), TERMINAL_ROW, None),
    (Outcome.CANCELLED, False, 3e16, None, None, None),
    (Outcome.CANCELLED, False, float("nan"), None, None, {}),
]


@pytest.fixture(autouse=True)
def clean_logging() -> Iterator[None]:
    structlog.contextvars.bind_contextvars(run_id="r1")
    yield
    structlog.contextvars.clear_contextvars()
    reset_logging()


def expected_fields(case: tuple[Outcome, bool, float, Attempt | None, Any, Any]) -> dict[str, Any]:
    outcome, final, duration_s, tried, _, capture = case
    failure = tried.failure if tried else None
    return {
        "rollout_id": "7-2",
        "task_index": 7,
        "rollout_index": 2,
        "attempt": 1,
        "agent": "a",
        "replica": tried.replica if tried else None,
        "outcome": outcome.value,
        "final": final,
        "duration_s": round(duration_s, 4),
        "retries": tried.retries if tried else 0,
        "http_status": failure.http_status if failure else None,
        "failure_message": failure.message if failure else None,
        "capture": capture or None,
    }


def test_each_attempt_logs_the_line_structlog_writes_for_its_fields(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ours, theirs = io.StringIO(), io.StringIO()
    configure_logging("json", stream=ours)
    log_finished = RolloutFinishedLog(get_logger("dispatcher.run").bind())
    as_dict: list[int] = []
    by_dict = EventLog.__call__

    def noting_the_line(self: EventLog, *args: Any) -> None:
        as_dict.append(len(ours.getvalue().splitlines()))
        by_dict(self, *args)

    monkeypatch.setattr(EventLog, "__call__", noting_the_line)
    for case in CASES:
        outcome, final, duration_s, tried, row, capture = case
        log_finished(ROLLOUT, outcome, final, duration_s, tried, row, capture)
    # A capture's figures and durations msgspec renders unlike orjson go by a dict.
    assert as_dict == [1, 4, 5]
    configure_logging("json", stream=theirs)
    log = get_logger("dispatcher.run").bind()
    for level, case in zip(
        (logging.INFO, logging.INFO, logging.WARNING, logging.ERROR, logging.INFO, logging.INFO),
        CASES,
        strict=True,
    ):
        log.log(level, "rollout_finished", **expected_fields(case))

    written, wanted = ours.getvalue().splitlines(), theirs.getvalue().splitlines()
    assert len(written) == len(wanted) == len(CASES)
    # Byte for byte, the timestamps aside.
    stamp = re.compile(r'"timestamp":"[^"]+"')
    assert [stamp.sub("", line) for line in written] == [stamp.sub("", line) for line in wanted]
    assert orjson.loads(written[1])["capture"]["wait_s"] == 1e20
    assert orjson.loads(written[4])["duration_s"] == 3e16


def test_events_go_to_structlog_when_captured() -> None:
    configure_logging("json", stream=io.StringIO())
    log_finished = RolloutFinishedLog(get_logger("dispatcher.run").bind())
    with structlog.testing.capture_logs() as captured:
        log_finished(ROLLOUT, Outcome.AGENT_RUN_ERROR, False, 2.0, attempt(FAILURE), {}, None)
    assert captured == [
        {"event": "rollout_finished", "log_level": "warning", **expected_fields(CASES[2])}
    ]
