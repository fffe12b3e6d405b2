"""One HTTP exchange with a replica (contracts §3, §5): ``POST /run``, the status
line, the body within its limits; whatever happens becomes values.

``post_run`` returns ``(status, body, not delivered, failure)``: a try that
reached no agent (no status line, a refusal that says it never ran) is a
``NotDelivered`` for ``AgentClient`` to retry; a delivered answer that broke a
limit or timed out is a ``Failure``. Only the dispatcher's own faults
(EMFILE, MemoryError, ...) raise, as ``LocalFault``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any

from dispatcher.delivery.answers import Failure, NotDelivered, body_excerpt
from dispatcher.delivery.deadlines import Deadlines
from dispatcher.delivery.faults import as_local_fault
from dispatcher.delivery.http1 import Connection
from dispatcher.delivery.http1_errors import ConnectTimeout
from dispatcher.delivery.http1_pool import Http1Pool
from dispatcher.delivery.limits import Body, BodyLimitError, ResponseLimits
from dispatcher.delivery.retry import parse_retry_after
from dispatcher.delivery.statuses import RetryReason, not_delivered_reason
from dispatcher.delivery.suspend import SuspendableTimeouts
from dispatcher.delivery.target import Target
from dispatcher.outcome import Outcome

Exchanged = tuple[int, Body, NotDelivered | None, Failure | None]

# No timeout configured: skip building a timeout scope for every call.
_NO_TIMEOUT: contextlib.AbstractAsyncContextManager[Any] = contextlib.nullcontext()


@dataclass(frozen=True, slots=True)
class ExchangeLimits:
    """The bounds of one exchange: the whole call, the status line, the body."""

    rollout_timeout_s: float | None
    # The first-byte timeout: every call's deadline on one shared timer.
    first_byte: Deadlines | None
    body: ResponseLimits
    # ``--pause-deadlines``: the rollout timeout, stopped while admission is paused.
    suspendable: SuspendableTimeouts | None = None

    @classmethod
    def of(
        cls,
        rollout_timeout_s: float | None,
        first_byte_s: float | None,
        body: ResponseLimits,
        pause_deadlines: bool = False,
    ) -> ExchangeLimits:
        first_byte = Deadlines(first_byte_s) if first_byte_s is not None else None
        suspendable = None
        if pause_deadlines and rollout_timeout_s is not None:
            suspendable = SuspendableTimeouts(rollout_timeout_s)
        return cls(rollout_timeout_s, first_byte, body, suspendable)


async def post_run(
    pool: Http1Pool, url: str, target: Target, body: bytes, limits: ExchangeLimits
) -> Exchanged:
    """One HTTP exchange: (status, body, not delivered, failure of a delivered one).

    The call waits here for its answer, one coroutine deep (no helper for the
    head, none in the pool): at 10,000 in flight every frame a waiting call
    holds is walked by each young GC pass (``aio.tune_gc``).
    """
    conn = pool.reused(target)
    try:
        async with _timeout(limits):
            # Until the status line, whatever goes wrong is not delivered.
            try:
                if conn is None:
                    conn = await pool.connect(target)
                head = conn.send(target.head, body, limits.body.max_bytes)
                if limits.first_byte is None:
                    await head
                else:
                    limits.first_byte.bound(head, conn)
                    try:
                        await head
                    finally:
                        limits.first_byte.settled()
            # The rollout timeout expiring meanwhile arrives as a CancelledError
            # (not caught here) and becomes a TimeoutError below.
            except (OSError, TimeoutError) as exc:
                raise _NotDeliveredError(_head_missed(url, exc, limits)) from exc
            raw, failure = await _read_body(conn, limits.body)
            return _answered(conn, raw, failure)
    except _NotDeliveredError as exc:
        return 0, b"", exc.missed, None
    except TimeoutError as exc:
        message = f"no answer from {url} within {limits.rollout_timeout_s} s"
        return 0, b"", None, _failure(Outcome.TIMEOUT_EXCEEDED, exc, message)
    except OSError as exc:
        _raise_if_local(exc)
        # After the status line (before it, it was not delivered: above).
        return _broken(url, conn, exc)
    finally:
        # After the answer is judged: the connection's status and headers are its.
        # One whose answer is not whole (a cancel, a timeout, an error) is closed.
        if conn is not None:
            pool.release(conn, target)


def _answered(conn: Connection, raw: Body, failure: Failure | None) -> Exchanged:
    reason = not_delivered_reason(conn.status, raw)
    if reason is not None:
        return conn.status, raw, _refused(reason, conn, raw), None
    return conn.status, raw, None, failure


def _broken(url: str, conn: Connection | None, exc: OSError) -> Exchanged:
    """An answer broken after its status line: delivered, an ``agent_run_error``,
    unless the status itself says the rollout never ran (a 503 stays a 503)."""
    status = conn.status if conn is not None else 0
    reason = not_delivered_reason(status, b"")
    if conn is not None and reason is not None:
        return status, b"", _refused(reason, conn, b""), None
    message = f"reading the answer of {url} failed: {exc}"
    failure = _failure(Outcome.AGENT_RUN_ERROR, exc, message)
    return status, b"", None, replace(failure, http_status=status or None)


def _head_missed(url: str, exc: OSError | TimeoutError, limits: ExchangeLimits) -> NotDelivered:
    """Why no status line came: every way of getting none is not delivered, but
    the dispatcher's own faults (EMFILE, ...) raise ``LocalFault``."""
    # A connect timeout is also a TimeoutError: test it first.
    if isinstance(exc, ConnectTimeout):
        return _no_answer(url, RetryReason.CONNECT_TIMEOUT, exc)
    if isinstance(exc, TimeoutError):
        first_byte_s = limits.first_byte.seconds if limits.first_byte is not None else None
        return _no_answer(url, RetryReason.FIRST_BYTE_TIMEOUT, exc, f"after {first_byte_s} s")
    _raise_if_local(exc)
    return _no_answer(url, RetryReason.NO_ANSWER, exc)


async def _read_body(conn: Connection, limits: ResponseLimits) -> tuple[Body, Failure | None]:
    """The answer's body within the limits; a 2xx that breaks one is an ``agent_run_error``.

    An error status keeps its own class, judged on the part of the body read.
    """
    try:
        return await conn.body(limits.read_timeout_s), None
    except BodyLimitError as exc:
        if not 200 <= conn.status < 300:
            return exc.partial, None
        failure = Failure(
            Outcome.AGENT_RUN_ERROR.value,
            exc.kind,
            str(exc),
            http_status=conn.status,
            response_body=body_excerpt(exc.partial),
        )
        return exc.partial, failure


class _NotDeliveredError(Exception):
    def __init__(self, missed: NotDelivered) -> None:
        super().__init__(missed.reason)
        self.missed = missed


def _timeout(limits: ExchangeLimits) -> contextlib.AbstractAsyncContextManager[Any]:
    if limits.suspendable is not None:
        return limits.suspendable.scope()
    seconds = limits.rollout_timeout_s
    return _NO_TIMEOUT if seconds is None else asyncio.timeout(seconds)


def _raise_if_local(exc: BaseException) -> None:
    fault = as_local_fault(exc)
    if fault is not None:
        raise fault from exc


def _no_answer(
    url: str, reason: RetryReason, exc: BaseException, detail: str | None = None
) -> NotDelivered:
    message = f"no answer from {url}: {detail or exc or type(exc).__name__}"
    return NotDelivered(reason, _failure(Outcome.AGENT_REQUEST_FAILED, exc, message))


def _refused(reason: RetryReason, conn: Connection, raw: Body) -> NotDelivered:
    failure = Failure(
        Outcome.AGENT_REQUEST_FAILED.value,
        "ClientResponseError",
        f"agent answered HTTP {conn.status}",
        http_status=conn.status,
        response_body=body_excerpt(raw),
    )
    retry_after = parse_retry_after(conn.header(b"retry-after"), time.time())
    return NotDelivered(reason, failure, retry_after)


def _failure(outcome: Outcome, exc: BaseException, message: str) -> Failure:
    return Failure(outcome.value, type(exc).__name__, message)
