"""What an answer becomes: the values of an attempt and the failure classes.

``classify_response`` classes an HTTP answer (a result, an agent-reported
failure, a dispatcher-observed failure); ``Attempt`` and ``Failure`` are the
values ``AgentClient.run`` returns, whatever happened. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from dispatcher import jsonx
from dispatcher.delivery.faults import LocalFault
from dispatcher.delivery.limits import Body
from dispatcher.delivery.statuses import BODY_EXCERPT_BYTES, RetryReason, not_delivered_reason
from dispatcher.files.contracts import (
    FAILURE_CLASS,
    NO_PERSIST,
    FailureKeys,
    is_terminal,
)
from dispatcher.outcome import Outcome

BODY_EXCERPT_CHARS = 2000


@dataclass(frozen=True, slots=True)
class Failure:
    """Why an attempt failed, as the failure row's ``_ng_failure_*`` keys."""

    failure_class: str
    type: str
    message: str
    http_status: int | None = None
    response_body: str | None = None
    terminal: bool = False
    # §11: the delivery deadline ran out; resume does not count it as an attempt.
    not_delivered: bool = False
    # Why its last try was not delivered (a ``RetryReason``): its Gym failure kind (§15).
    retry_reason: str | None = None

    def as_row_keys(self) -> FailureKeys:
        # Spelled out: a TypedDict's keys are literals (FailureKeys checks them).
        keys: FailureKeys = {
            "_ng_failure_class": self.failure_class,
            "_ng_failure_type": self.type,
            "_ng_failure_message": self.message,
            "_ng_failure_http_status": self.http_status,
            "_ng_failure_response_body": self.response_body,
            "_ng_failure_terminal": self.terminal,
        }
        if self.not_delivered:
            keys["_ng_failure_not_delivered"] = True
        return keys


@dataclass(slots=True)
class Attempt:
    """What one rollout's delivery to an agent came to. Never changed once made
    (``dataclasses.replace`` makes another); not ``frozen``, whose ``__init__``
    sets each field through ``object.__setattr__``: twice its cost per rollout."""

    outcome: Outcome
    replica: str
    started_at: float
    duration_s: float
    result: dict[str, Any] | None = None
    failure: Failure | None = None
    retries: int = 0
    # Size of the answer's body: what its row will cost in the commit queue.
    body_bytes: int = 0
    # The replica answered 404/405 to ``POST /run`` and never 2xx: it serves no ``/run``.
    no_run: bool = False


@dataclass(frozen=True, slots=True)
class NotDelivered:
    """One try that reached no agent: why, and what the replica asked for."""

    reason: RetryReason
    failure: Failure
    retry_after_s: float | None = None


Classified = tuple[Outcome, dict[str, Any] | None, Failure | None]
_REDIRECT_NOTE = " (redirects are not followed)"
# What a status the dispatcher does not act on means, said with it. A 304 is no
# redirect: it answers a conditional request, which a POST /run never is.
_STATUS_NOTES = {
    **dict.fromkeys((301, 302, 303, 307, 308), _REDIRECT_NOTE),
    304: " (Not Modified, to a request that asked for no such check)",
}


Classifier = Callable[[int, Body], Awaitable[Classified]]


async def classify_on_loop(status: int, raw: Body) -> Classified:
    """``classify_here`` as a ``Classifier``."""
    return classify_here(status, raw)


def classify_here(
    status: int, raw: Body, classify: Callable[[int, Body], Classified] | None = None
) -> Classified:
    """``classify`` (``classify_response`` when None) in place; running out of memory
    there is our fault (§11)."""
    try:
        return (classify or classify_response)(status, raw)
    except MemoryError as exc:
        raise LocalFault("MemoryError", "out of memory reading an answer") from exc


def classify_response(status: int, raw: Body) -> Classified:
    """Class an HTTP answer (§3, §5): a result, an agent-reported failure, or ours."""
    if not 200 <= status < 300:
        failure_class = (
            Outcome.AGENT_REQUEST_FAILED
            if not_delivered_reason(status, raw) is not None
            else Outcome.AGENT_RUN_ERROR
        )
        failure = Failure(
            failure_class.value,
            "ClientResponseError",
            f"agent answered HTTP {status}{_STATUS_NOTES.get(status, '')}",
            http_status=status,
            response_body=body_excerpt(raw),
        )
        return failure_class, None, failure
    try:
        result = jsonx.loads(raw)
    except orjson.JSONDecodeError as exc:
        return _protocol_violation(status, raw, type(exc).__name__, f"body is not JSON: {exc}")
    return classify_object(status, raw, result)


def classify_object(status: int, raw: Body, result: Any) -> Classified:
    """Class a 2xx answer's parsed body (``raw`` only for a failure's excerpt)."""
    if not isinstance(result, dict):
        kind = type(result).__name__
        return _protocol_violation(
            status, raw, "TypeError", f"body is a JSON {kind}, not an object"
        )
    if result.get(NO_PERSIST) is True:
        return Outcome.KILL_SHAPED, result, None
    # A null class is no failure: agents built on pydantic models send the key
    # on every result, and NeMo Gym's collector routes those rows as successes.
    if result.get(FAILURE_CLASS) is not None:
        return Outcome.AGENT_REPORTED_FAILURE, result, None
    return Outcome.SUCCESS, result, None


def _protocol_violation(
    status: int, raw: Body, type_name: str, message: str
) -> tuple[Outcome, None, Failure]:
    failure = Failure(
        Outcome.PROTOCOL_VIOLATION.value,
        type_name,
        message,
        http_status=status,
        response_body=body_excerpt(raw),
        terminal=True,
    )
    return Outcome.PROTOCOL_VIOLATION, None, failure


def body_excerpt(raw: Body) -> str:
    """At most 2000 characters decoded from at most the first 8000 bytes, ``…`` if longer."""
    text = raw[:BODY_EXCERPT_BYTES].decode("utf-8", errors="replace")
    if len(raw) > BODY_EXCERPT_BYTES or len(text) > BODY_EXCERPT_CHARS:
        return text[:BODY_EXCERPT_CHARS] + "…"
    return text


def agent_reported_terminal(result: dict[str, Any]) -> bool:
    return is_terminal(result)
