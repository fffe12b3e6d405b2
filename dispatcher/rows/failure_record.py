"""NeMo Gym Main's typed failure record, and the rows of rollouts left without a result
(contracts §15).

Each failure row carries ``_ng_failure_record`` beside its flat ``_ng_failure_*``
keys, shaped as Gym's ``RolloutFailure``: ``{schema_version, episode_id:
{rollout_id, attempt}, run_id, source, delivery, failure: {failure_reason,
terminal, failure_kind, stage}, http_status, exception_type}``. ``kind`` and
``stage`` are left out when unknown, as Gym writes them.

``FailureKind`` holds Gym's shared vocabulary (``nemo_gym.failure_kinds``);
``kind_for_class`` and ``kind_for_retry_reason`` map our failure classes and
retry reasons onto it, here and nowhere else. ``omitted_row`` builds the sidecar
row ``--record-omitted`` writes for a drained, cancelled or kill-shaped rollout.
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, Literal

from dispatcher.delivery.answers import Failure
from dispatcher.delivery.statuses import RetryReason
from dispatcher.outcome import Outcome
from dispatcher.tasks.keys import (
    FAILURE_CLASS,
    FAILURE_HTTP_STATUS,
    FAILURE_MESSAGE,
    FAILURE_RECORD,
    FAILURE_TERMINAL,
    FAILURE_TYPE,
    NO_PERSIST,
    OMITTED_CAUSE,
    OMITTED_ROLLOUT,
    ROLLOUT_ID,
    ROLLOUT_INDEX,
    TASK_INDEX,
)
from dispatcher.tasks.schema import FAILURE_STAGE

SCHEMA_VERSION: Final = 1
REASON_CHARS: Final = 2000
STAGE_KEY: Final = FAILURE_STAGE

Source = Literal["environment", "collector"]


class Delivery(StrEnum):
    """The collector's evidence that the request reached the agent (Gym's ``delivery``)."""

    NOT_SENT = "not_sent"
    POSSIBLY_DELIVERED = "possibly_delivered"
    DELIVERED = "delivered"


class FailureKind(StrEnum):
    """Gym's shared names for why a rollout failed: low cardinality, safe as a label."""

    TRANSPORT_UNREACHABLE = "transport_unreachable"
    TRANSPORT_PEER_DROP = "transport_peer_drop"
    TRANSPORT_TIMEOUT = "transport_timeout"
    TRANSPORT_LOCAL_RESOURCE = "transport_local_resource"
    AGENT_RUN_ERROR = "agent_run_error"
    AGENT_REQUEST_FAILED = "agent_request_failed"
    AGENT_TIMEOUT = "agent_timeout"
    AGENT_COMMAND_NOT_ALLOWED = "agent_command_not_allowed"
    ENVIRONMENT_SERVER_FAILED = "environment_server_failed"
    PROTOCOL_VIOLATION = "protocol_violation"
    JUDGE_FAILED = "judge_failed"
    JUDGE_UNPARSEABLE = "judge_unparseable"
    VERIFIER_ERROR = "verifier_error"
    PROVIDER_UNAVAILABLE = "provider_unavailable"
    PROVIDER_QUOTA_EXHAUSTED = "provider_quota_exhausted"
    PROVIDER_OOM_KILLED = "provider_oom_killed"
    SESSION_LOST = "session_lost"
    SESSION_EXPIRED = "session_expired"
    SESSION_RELEASE_FAILED = "session_release_failed"
    CANCELLED = "cancelled"
    KILL_SHAPED = "kill_shaped"
    SHUTDOWN = "shutdown"
    PERSISTENCE_FAILED = "persistence_failed"
    COHORT_INCOMPLETE = "cohort_incomplete"


# Where an episode failed (Gym's ``FailureStage``); a collector's observation has none.
STAGES: Final = frozenset({"admission", "seed", "agent", "verification", "cleanup"})

_CLASS_KINDS: Final[Mapping[str, FailureKind]] = {
    Outcome.AGENT_REQUEST_FAILED: FailureKind.AGENT_REQUEST_FAILED,
    Outcome.AGENT_RUN_ERROR: FailureKind.AGENT_RUN_ERROR,
    Outcome.TIMEOUT_EXCEEDED: FailureKind.AGENT_TIMEOUT,
    Outcome.PROTOCOL_VIOLATION: FailureKind.PROTOCOL_VIOLATION,
    Outcome.KILL_SHAPED: FailureKind.KILL_SHAPED,
    Outcome.CANCELLED: FailureKind.CANCELLED,
    # Never started: the allocation's budget ran out.
    Outcome.DRAINED: FailureKind.SHUTDOWN,
}

_REASON_KINDS: Final[Mapping[RetryReason, FailureKind]] = {
    RetryReason.NO_ANSWER: FailureKind.TRANSPORT_UNREACHABLE,
    RetryReason.CONNECT_TIMEOUT: FailureKind.TRANSPORT_TIMEOUT,
    RetryReason.FIRST_BYTE_TIMEOUT: FailureKind.TRANSPORT_TIMEOUT,
    # Something in front of the agent answered: the rollout never ran.
    RetryReason.HTTP_409_ADMISSION_CLOSED: FailureKind.AGENT_REQUEST_FAILED,
    RetryReason.HTTP_429: FailureKind.AGENT_REQUEST_FAILED,
    RetryReason.HTTP_502: FailureKind.AGENT_REQUEST_FAILED,
    RetryReason.HTTP_503: FailureKind.AGENT_REQUEST_FAILED,
    RetryReason.HTTP_504: FailureKind.AGENT_REQUEST_FAILED,
}


def kind_for_class(failure_class: str) -> FailureKind:
    """The Gym kind of one of our failure classes (or omitted-row causes); an agent's
    own class is kept when Gym knows it, else it reads as the environment's failure."""
    known = _CLASS_KINDS.get(failure_class)
    if known is not None:
        return known
    if failure_class in FailureKind.__members__.values():
        return FailureKind(failure_class)
    return FailureKind.ENVIRONMENT_SERVER_FAILED


def kind_for_retry_reason(reason: str | None) -> FailureKind:
    """The Gym kind of a rollout not delivered, by the reason of its last try."""
    if reason is None:
        return FailureKind.TRANSPORT_UNREACHABLE
    return _REASON_KINDS.get(RetryReason(reason), FailureKind.AGENT_REQUEST_FAILED)


@dataclass(frozen=True, slots=True)
class FailureRecord:
    """Gym's ``RolloutFailure``: one observed failure of one attempt of a rollout."""

    rollout_id: str
    attempt: int
    run_id: str
    source: Source
    delivery: Delivery
    failure_reason: str
    terminal: bool
    failure_kind: FailureKind
    stage: str | None = None
    http_status: int | None = None
    exception_type: str | None = None

    def to_json(self) -> dict[str, Any]:
        failure: dict[str, Any] = {
            "failure_reason": self.failure_reason[:REASON_CHARS],
            "terminal": self.terminal,
            "failure_kind": self.failure_kind.value,
        }
        if self.stage is not None:
            failure["stage"] = self.stage
        return {
            "schema_version": SCHEMA_VERSION,
            "episode_id": {"rollout_id": self.rollout_id, "attempt": self.attempt},
            "run_id": self.run_id,
            "source": self.source,
            "delivery": self.delivery.value,
            "failure": failure,
            "http_status": self.http_status,
            "exception_type": self.exception_type,
        }


def logical_rollout_id(row: Mapping[str, Any]) -> str:
    """A rollout's id without its attempt suffix (Gym's ``episode_id.rollout_id``)."""
    own = row.get(ROLLOUT_ID)
    return str(own) if own is not None else f"{row[TASK_INDEX]}-{row[ROLLOUT_INDEX]}"


def collector_record(
    row: Mapping[str, Any], attempt: int, run_id: str, failure: Failure
) -> dict[str, Any]:
    """The record of a failure the dispatcher observed (its failure row's ``row``)."""
    if failure.not_delivered:
        delivery, kind = Delivery.NOT_SENT, kind_for_retry_reason(failure.retry_reason)
    else:
        delivery, kind = _delivery_of(failure), kind_for_class(failure.failure_class)
    return FailureRecord(
        rollout_id=logical_rollout_id(row),
        attempt=attempt,
        run_id=run_id,
        source="collector",
        delivery=delivery,
        failure_reason=failure.message or failure.failure_class,
        terminal=failure.terminal,
        failure_kind=kind,
        http_status=_http_status(failure.http_status),
        exception_type=failure.type[:REASON_CHARS],
    ).to_json()


def _delivery_of(failure: Failure) -> Delivery:
    # An HTTP status came back: the agent had the request. A timeout may have run it.
    return Delivery.DELIVERED if failure.http_status is not None else Delivery.POSSIBLY_DELIVERED


def environment_record(row: Mapping[str, Any], attempt: int, run_id: str) -> dict[str, Any]:
    """The record of a failure the agent reported (its row, flat keys filled in)."""
    message = row.get(FAILURE_MESSAGE)
    failure_class = str(row.get(FAILURE_CLASS))
    exception_type = row.get(FAILURE_TYPE)
    stage = row.get(STAGE_KEY)
    return FailureRecord(
        rollout_id=logical_rollout_id(row),
        attempt=attempt,
        run_id=run_id,
        source="environment",
        delivery=Delivery.DELIVERED,
        failure_reason=str(message) if message else failure_class,
        terminal=row.get(FAILURE_TERMINAL) is True,
        failure_kind=kind_for_class(failure_class),
        stage=stage if stage in STAGES else None,
        http_status=_http_status(row.get(FAILURE_HTTP_STATUS)),
        exception_type=str(exception_type)[:REASON_CHARS] if exception_type else None,
    ).to_json()


def _http_status(value: Any) -> int | None:
    return value if type(value) is int and 100 <= value <= 599 else None


# The cause of an omitted row: how the rollout came to have no result on this hop.
_OMITTED: Final[Mapping[Outcome, tuple[Source, Delivery, str]]] = {
    Outcome.DRAINED: (
        "collector", Delivery.NOT_SENT, "not started: the dispatch budget ran out",
    ),
    Outcome.CANCELLED: (
        "collector", Delivery.POSSIBLY_DELIVERED, "cancelled at its agent; it runs on resume",
    ),
    Outcome.KILL_SHAPED: (
        "environment", Delivery.DELIVERED, "the agent asked for nothing to be written",
    ),
}  # fmt: skip
OMITTED_CAUSES: Final = frozenset(_OMITTED)


def omitted_row(
    identity: Mapping[str, Any], attempt: int, run_id: str, cause: Outcome
) -> dict[str, Any]:
    """The sidecar row of a rollout left without a result on this hop (``--record-omitted``).

    It carries Gym's ``_ng_no_persist`` and a failure record, marked
    ``_ng_omitted_rollout``: no reader counts it as a failure or an attempt.
    """
    source, delivery, reason = _OMITTED[cause]
    record = FailureRecord(
        rollout_id=logical_rollout_id(identity),
        attempt=attempt,
        run_id=run_id,
        source=source,
        delivery=delivery,
        failure_reason=reason,
        terminal=False,
        failure_kind=kind_for_class(cause),
    )
    return {
        **identity,
        OMITTED_ROLLOUT: True,
        OMITTED_CAUSE: cause.value,
        NO_PERSIST: True,
        FAILURE_CLASS: cause.value,
        FAILURE_MESSAGE: reason,
        FAILURE_TERMINAL: False,
        FAILURE_RECORD: record.to_json(),
    }
