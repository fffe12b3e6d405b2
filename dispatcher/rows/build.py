"""Turn an attempt into the row written for it (contracts §4, §5, §15).

Pure, except for one warning when an agent's result tries to set keys that
are the dispatcher's own: those are dropped (the dispatcher's values win),
listed in ``_ng_dispatch.reserved_keys_dropped`` and logged.
"""

from __future__ import annotations

from typing import Any

import structlog

from dispatcher.delivery.client import Attempt
from dispatcher.files.contracts import (
    DISPATCH_KEY,
    FAILURE_HTTP_STATUS,
    FAILURE_MESSAGE,
    FAILURE_RESPONSE_BODY,
    FAILURE_TERMINAL,
    FAILURE_TYPE,
)
from dispatcher.outcome import Outcome
from dispatcher.rows.failure_record import collector_record, environment_record
from dispatcher.tasks.keys import (
    AGENT_REF,
    ATTEMPT_INDEX,
    CAPTURE_ID,
    FAILURE_RECORD,
    RESERVED_RESULT_KEYS,
    RESERVED_SUCCESS_KEYS,
    ROLLOUT_ID,
    ROLLOUT_INDEX,
    RUN_ID,
    TASK_INDEX,
)
from dispatcher.tasks.materialize import Rollout

log = structlog.get_logger(__name__)

def identity_keys(rollout: Rollout, run_id: str | None = None) -> dict[str, Any]:
    keys: dict[str, Any] = {
        TASK_INDEX: rollout.task_index,
        ROLLOUT_INDEX: rollout.rollout_index,
        AGENT_REF: rollout.body[AGENT_REF],
    }
    if rollout.attempt_index > 0:
        keys[ATTEMPT_INDEX] = rollout.attempt_index
    if ROLLOUT_ID in rollout.body:
        keys[ROLLOUT_ID] = rollout.body[ROLLOUT_ID]
    if run_id is not None:
        keys[RUN_ID] = run_id
    return keys


def dispatch_stamp(
    rollout: Rollout, attempt: Attempt, dropped: list[str] | None = None
) -> dict[str, Any]:
    """How the dispatcher saw the attempt; ``dispatcher report`` reads it."""
    stamp: dict[str, Any] = {
        "rollout_id": rollout.rollout_id,
        "replica": attempt.replica,
        "started_at": round(attempt.started_at, 6),
        "duration_s": round(attempt.duration_s, 6),
    }
    if dropped:
        stamp["reserved_keys_dropped"] = dropped
    return stamp


def build_row(
    rollout: Rollout, attempt: Attempt, run_id: str | None = None
) -> dict[str, Any] | None:
    """The row to append for this attempt, or None when it writes nothing.

    With the run's id, every row carries ``_ng_run_id`` and every failure row
    its ``_ng_failure_record`` (§15).
    """
    if attempt.outcome is Outcome.SUCCESS:
        assert attempt.result is not None
        return _result_row(rollout, attempt, attempt.result, RESERVED_SUCCESS_KEYS, run_id)
    if attempt.outcome is Outcome.AGENT_REPORTED_FAILURE:
        assert attempt.result is not None
        return _agent_reported_row(rollout, attempt, attempt.result, run_id)
    if attempt.failure is not None:
        row = {
            **identity_keys(rollout, run_id),
            **attempt.failure.as_row_keys(),
            DISPATCH_KEY: dispatch_stamp(rollout, attempt),
        }
        if run_id is not None:
            row[FAILURE_RECORD] = collector_record(
                row, rollout.attempt_index, run_id, attempt.failure
            )
        return row
    return None


def _result_row(
    rollout: Rollout,
    attempt: Attempt,
    result: dict[str, Any],
    reserved: frozenset[str],
    run_id: str | None,
) -> dict[str, Any]:
    identity = identity_keys(rollout, run_id)
    row = {k: v for k, v in result.items() if k not in reserved}
    dropped = _forged_keys(result, reserved, identity, rollout.capture_id)
    if dropped:
        log.warning("agent_result_reserved_keys", rollout_id=rollout.rollout_id, keys=dropped)
    row.update(identity)
    row[DISPATCH_KEY] = dispatch_stamp(rollout, attempt, dropped)
    return row


def _forged_keys(
    result: dict[str, Any],
    reserved: frozenset[str],
    identity: dict[str, Any],
    capture_id: str | None,
) -> list[str]:
    # An echo of the dispatcher's own value (or a null) is no attempt to set it.
    forged = []
    for key in reserved.intersection(result):
        value = result[key]
        ours = capture_id if key == CAPTURE_ID else identity.get(key)
        if value is not None and value != ours:
            forged.append(key)
    forged.sort()
    return forged


def _agent_reported_row(
    rollout: Rollout, attempt: Attempt, result: dict[str, Any], run_id: str | None
) -> dict[str, Any]:
    row = _result_row(rollout, attempt, result, RESERVED_RESULT_KEYS, run_id)
    for key, value in _AGENT_REPORTED_DEFAULTS.items():
        row.setdefault(key, value)
    if run_id is not None:
        # It reads only ``_ng_*`` keys, which a big answer keeps decoded (rows/wire.py).
        row[FAILURE_RECORD] = environment_record(row, rollout.attempt_index, run_id)
    return row


# The failure keys an agent may leave out of a failure it reports (§5).
_AGENT_REPORTED_DEFAULTS: dict[str, Any] = {
    FAILURE_TYPE: "AgentReportedFailure",
    FAILURE_MESSAGE: "",
    FAILURE_HTTP_STATUS: None,
    FAILURE_RESPONSE_BODY: None,
    FAILURE_TERMINAL: False,
}
