"""What an agent's answer becomes, from its status and body bytes (``delivery/answers.py``,
``delivery/statuses.py``; contracts §3, §5, §11): pure functions, fed bytes."""

from __future__ import annotations

import pytest

from dispatcher.delivery.answers import BODY_EXCERPT_CHARS, body_excerpt, classify_response
from dispatcher.delivery.statuses import RetryReason, is_admission_closed, not_delivered_reason
from dispatcher.outcome import Outcome


def test_a_json_object_is_a_success_with_its_big_integers_exact() -> None:
    outcome, result, failure = classify_response(
        200, b'{"reward": 1, "id": 123456789012345678901234567890}'
    )
    assert (outcome, failure) == (Outcome.SUCCESS, None)
    assert result == {"reward": 1, "id": 123456789012345678901234567890}


def test_an_agents_own_failure_class_is_its_reported_failure_and_a_null_one_is_none() -> None:
    assert classify_response(200, b'{"_ng_failure_class": "tool_error"}')[0] is (
        Outcome.AGENT_REPORTED_FAILURE
    )
    assert classify_response(200, b'{"_ng_failure_class": null, "reward": 0}')[0] is Outcome.SUCCESS


@pytest.mark.parametrize(
    ("body", "why"),
    [(b"not json", "body is not JSON"), (b"[1, 2]", "body is a JSON list, not an object")],
)
def test_a_2xx_that_is_no_json_object_is_a_terminal_protocol_violation(
    body: bytes, why: str
) -> None:
    outcome, result, failure = classify_response(200, body)
    assert outcome is Outcome.PROTOCOL_VIOLATION and result is None and failure is not None
    assert failure.terminal and failure.http_status == 200 and why in failure.message


@pytest.mark.parametrize("status", [429, 502, 503, 504])
def test_statuses_after_which_the_rollout_never_ran_are_not_delivered(status: int) -> None:
    outcome, _, failure = classify_response(status, b"busy")
    assert outcome is Outcome.AGENT_REQUEST_FAILED
    assert failure is not None and failure.http_status == status and failure.response_body == "busy"
    assert not_delivered_reason(status, b"") == RetryReason(f"http_{status}")


@pytest.mark.parametrize(("status", "note"), [(500, ""), (302, " (redirects are not followed)")])
def test_other_statuses_are_the_agents_run_error(status: int, note: str) -> None:
    outcome, _, failure = classify_response(status, b"")
    assert outcome is Outcome.AGENT_RUN_ERROR and not_delivered_reason(status, b"") is None
    assert failure is not None and failure.message == f"agent answered HTTP {status}{note}"


def test_only_gyms_exact_admission_closed_409_is_a_checkpoint() -> None:
    assert is_admission_closed(409, b'{"detail": "admission_closed"}')
    assert classify_response(409, b'{"detail": "admission_closed"}')[0] is (
        Outcome.AGENT_REQUEST_FAILED
    )
    # The agent's own conflict that quotes the word is what it says.
    assert not is_admission_closed(409, b'{"detail": "not admission_closed: a clash"}')
    assert not is_admission_closed(409, b"admission_closed")
    assert not is_admission_closed(503, b'{"detail": "admission_closed"}')


def test_a_failures_excerpt_is_bounded_and_survives_bytes_that_are_not_utf8() -> None:
    assert body_excerpt(b"\xff\xfeok") == "\ufffd\ufffdok"
    long = body_excerpt(b"x" * 100_000)
    assert long == "x" * BODY_EXCERPT_CHARS + "…"
