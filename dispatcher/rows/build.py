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
    ENVIRONMENT_SERVER,
    FAILURE_RECORD,
    RESERVED_RESULT_KEYS,
    RESERVED_SUCCESS_KEYS,
    RESULT_TYPE,
    ROLLOUT_ID,
    ROLLOUT_INDEX,
    RUN_ID,
    TASK_INDEX,
    rollout_id_for,
)
from dispatcher.tasks.materialize import Rollout

log = structlog.get_logger(__name__)

# An agent's environment server and that server's implementation (Gym's head config).
Environment = tuple[str, str]


def identity_keys(
    rollout: Rollout, run_id: str | None = None, environment: Environment | None = None
) -> dict[str, Any]:
    keys: dict[str, Any] = {
        TASK_INDEX: rollout.task_index,
        ROLLOUT_INDEX: rollout.rollout_index,
        AGENT_REF: rollout.body[AGENT_REF],
    }
    # Every row names its rollout's stable id (the task row's own, else task-rollout):
    # a first attempt's rollout id is that id (``Rollout.from_materialized``).
    if rollout.attempt_index > 0:
        keys[ATTEMPT_INDEX] = rollout.attempt_index
        keys[ROLLOUT_ID] = rollout_id_for(rollout.body)
    else:
        keys[ROLLOUT_ID] = rollout.rollout_id
    if run_id is not None:
        keys[RUN_ID] = run_id
    # Most runs name no environment: no call, no empty dict, for their rows.
    if environment is not None or ENVIRONMENT_SERVER in rollout.body:
        keys.update(environment_keys(rollout, environment))
    return keys


def environment_keys(rollout: Rollout, environment: Environment | None) -> dict[str, Any]:
    """``_ng_environment_server`` and ``_ng_result_type``, as Gym's collector stamps them:
    the task row's own server (Gym stamps it on materialized rows), else the one that
    fronts the agent in the Gym config; the type when the config names that server."""
    own = rollout.body.get(ENVIRONMENT_SERVER)
    server = own if isinstance(own, str) else environment[0] if environment else None
    if server is None:
        return {}
    if environment is not None and environment[0] == server:
        return {ENVIRONMENT_SERVER: server, RESULT_TYPE: environment[1]}
    return {ENVIRONMENT_SERVER: server}


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
    rollout: Rollout,
    attempt: Attempt,
    run_id: str | None = None,
    environment: Environment | None = None,
) -> dict[str, Any] | None:
    """The row to append for this attempt, or None when it writes nothing.

    With the run's id, every row carries ``_ng_run_id`` and every failure row
    its ``_ng_failure_record`` (§15).
    """
    if attempt.outcome is Outcome.SUCCESS:
        assert attempt.result is not None
        identity = identity_keys(rollout, run_id, environment)
        return _result_row(rollout, attempt, attempt.result, RESERVED_SUCCESS_KEYS, identity)
    if attempt.outcome is Outcome.AGENT_REPORTED_FAILURE:
        assert attempt.result is not None
        return _agent_reported_row(
            rollout, attempt, attempt.result, identity_keys(rollout, run_id, environment)
        )
    if attempt.failure is not None:
        row = {
            **identity_keys(rollout, run_id, environment),
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
    identity: dict[str, Any],
) -> dict[str, Any]:
    # A copy without the reserved keys: most results carry a few (an echo of the
    # request's), so popping them beats filtering every key in Python.
    row = dict(result)
    echoed = reserved.intersection(row)
    for key in echoed:
        del row[key]
    dropped = _forged_keys(result, echoed, identity, rollout.capture_id) if echoed else []
    if dropped:
        log.warning("agent_result_reserved_keys", rollout_id=rollout.rollout_id, keys=dropped)
    row.update(identity)
    row[DISPATCH_KEY] = dispatch_stamp(rollout, attempt, dropped)
    return row


def _forged_keys(
    result: dict[str, Any],
    echoed: frozenset[str],
    identity: dict[str, Any],
    capture_id: str | None,
) -> list[str]:
    # An echo of the dispatcher's own value (or a null) is no attempt to set it.
    forged = []
    for key in echoed:
        value = result[key]
        ours = capture_id if key == CAPTURE_ID else identity.get(key)
        if value is not None and value != ours:
            forged.append(key)
    forged.sort()
    return forged


def _agent_reported_row(
    rollout: Rollout, attempt: Attempt, result: dict[str, Any], identity: dict[str, Any]
) -> dict[str, Any]:
    row = _result_row(rollout, attempt, result, RESERVED_RESULT_KEYS, identity)
    run_id = identity.get(RUN_ID)
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
