"""How an attempt ended: the classes of contracts §5 plus the states that write nothing."""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    """Outcome of one rollout attempt, as it appears in logs and metric labels."""

    SUCCESS = "success"
    # Dispatcher-observed failures (§5), written to the failures sidecar.
    AGENT_REQUEST_FAILED = "agent_request_failed"
    AGENT_RUN_ERROR = "agent_run_error"
    TIMEOUT_EXCEEDED = "timeout_exceeded"
    PROTOCOL_VIOLATION = "protocol_violation"
    # The agent answered with its own ``_ng_failure_class``.
    AGENT_REPORTED_FAILURE = "agent_reported_failure"
    # Written nowhere: the absence of a row makes resume run it again.
    KILL_SHAPED = "kill_shaped"
    CANCELLED = "cancelled"
    DRAINED = "drained"
    # The dispatcher's own fault (contracts §11): back to the queue, nothing spent.
    REQUEUED = "requeued"
    # Not started: every replica of its agent has been down past the delivery deadline.
    AGENT_DOWN = "agent_down"

    @property
    def writes_failure_row(self) -> bool:
        return self not in _NO_FAILURE_ROW


_NO_FAILURE_ROW = frozenset(
    {
        Outcome.SUCCESS,
        Outcome.KILL_SHAPED,
        Outcome.CANCELLED,
        Outcome.DRAINED,
        Outcome.REQUEUED,
        Outcome.AGENT_DOWN,
    }
)
# Never started, so never finished: counted apart from the attempts.
NOT_STARTED = frozenset({Outcome.DRAINED, Outcome.AGENT_DOWN})
