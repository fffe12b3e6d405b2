"""What an agent's HTTP status says about a try (contracts §5, §11), and the retry reasons."""

from __future__ import annotations

from enum import StrEnum

import orjson

from dispatcher.delivery.limits import Body

# Statuses after which the rollout most likely never ran (§5).
REQUEST_FAILED_STATUSES = frozenset({429, 502, 503, 504})
# A 409 whose body is ``{"detail": "admission_closed"}`` is NeMo Gym's agent refusing
# work during a checkpoint.
ADMISSION_CLOSED = "admission_closed"
# Answers to ``POST /run`` that mean no ``/run`` is served there: a wrong URL.
NO_RUN_STATUSES = frozenset({404, 405})


class RetryReason(StrEnum):
    """Why a try was not delivered: the ``reason`` label of retries (metrics, logs, summary)."""

    NO_ANSWER = "no_answer"
    CONNECT_TIMEOUT = "connect_timeout"
    FIRST_BYTE_TIMEOUT = "first_byte_timeout"
    HTTP_409_ADMISSION_CLOSED = "http_409_admission_closed"
    HTTP_429 = "http_429"
    HTTP_502 = "http_502"
    HTTP_503 = "http_503"
    HTTP_504 = "http_504"


RATE_LIMITED = RetryReason.HTTP_429
BODY_EXCERPT_BYTES = 8000


def is_admission_closed(status: int, raw: Body) -> bool:
    """A NeMo Gym agent's ``409 {"detail": "admission_closed"}``: not delivered (§11).
    A 409 whose body only mentions the word (an agent's own conflict quoting
    it) is what it says, the agent's error: retrying it as a checkpoint
    would hide it behind ``http_409_admission_closed``."""
    if status != 409 or len(raw) > BODY_EXCERPT_BYTES or ADMISSION_CLOSED.encode() not in raw:
        return False
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    return isinstance(body, dict) and body.get("detail") == ADMISSION_CLOSED


def not_delivered_reason(status: int, raw: Body) -> RetryReason | None:
    """The retry reason of an HTTP answer that was not delivered, or None if it was."""
    if status in REQUEST_FAILED_STATUSES:
        return RetryReason(f"http_{status}")
    if is_admission_closed(status, raw):
        return RetryReason.HTTP_409_ADMISSION_CLOSED
    return None
