"""Pure functions that turn an attempt into the row written for it (DESIGN A4, A5)."""

from __future__ import annotations

from typing import Any

from dispatcher.agents import Attempt
from dispatcher.outcome import Outcome
from dispatcher.state import AGENT_REF, ATTEMPT_INDEX, ROLLOUT_ID, ROLLOUT_INDEX, TASK_INDEX
from dispatcher.tasks import Rollout

DISPATCH_KEY = "_ng_dispatch"


def identity_keys(rollout: Rollout) -> dict[str, Any]:
    keys: dict[str, Any] = {
        TASK_INDEX: rollout.task_index,
        ROLLOUT_INDEX: rollout.rollout_index,
        AGENT_REF: rollout.body[AGENT_REF],
    }
    if rollout.attempt_index > 0:
        keys[ATTEMPT_INDEX] = rollout.attempt_index
    if ROLLOUT_ID in rollout.body:
        keys[ROLLOUT_ID] = rollout.body[ROLLOUT_ID]
    return keys


def dispatch_stamp(rollout: Rollout, attempt: Attempt) -> dict[str, Any]:
    """How the dispatcher saw the attempt; ``dispatcher report`` reads it."""
    return {
        "rollout_id": rollout.rollout_id,
        "replica": attempt.replica,
        "started_at": round(attempt.started_at, 6),
        "duration_s": round(attempt.duration_s, 6),
    }


def build_row(rollout: Rollout, attempt: Attempt) -> dict[str, Any] | None:
    """The row to append for this attempt, or None when it writes nothing."""
    if attempt.outcome is Outcome.SUCCESS:
        assert attempt.result is not None
        return {
            **attempt.result,
            **identity_keys(rollout),
            DISPATCH_KEY: dispatch_stamp(rollout, attempt),
        }
    if attempt.outcome is Outcome.AGENT_REPORTED_FAILURE:
        assert attempt.result is not None
        return _agent_reported_row(rollout, attempt, attempt.result)
    if attempt.failure is not None:
        return {
            **identity_keys(rollout),
            **attempt.failure.as_row_keys(),
            DISPATCH_KEY: dispatch_stamp(rollout, attempt),
        }
    return None


def _agent_reported_row(
    rollout: Rollout, attempt: Attempt, result: dict[str, Any]
) -> dict[str, Any]:
    row = {**result, **identity_keys(rollout), DISPATCH_KEY: dispatch_stamp(rollout, attempt)}
    row.setdefault("_ng_failure_type", "AgentReportedFailure")
    row.setdefault("_ng_failure_message", "")
    row.setdefault("_ng_failure_http_status", None)
    row.setdefault("_ng_failure_response_body", None)
    row.setdefault("_ng_failure_terminal", False)
    return row


def is_terminal(row: dict[str, Any]) -> bool:
    return row.get("_ng_failure_terminal") is True
