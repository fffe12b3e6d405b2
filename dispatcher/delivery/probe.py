"""Is ``/run`` served at a replica? One ``POST /run`` that no agent runs (contracts §11).

The probe posts ``{}``. NeMo Gym's agents are FastAPI apps whose ``/run`` body
model requires ``responses_create_params``: they answer 422 without running
anything (our sim agent answers 422 to a body without a task index). Any
HTTP answer means the replica is reachable, except:

- 404/405: no ``/run`` there, a wrong URL: a configuration error (from a
  replica that has answered a rollout 2xx, ``AgentClient.probe`` takes it
  for an ingress in between and keeps the replica out, not misconfigured);
- 429/502/503/504, or 409 ``admission_closed``: alive but taking no work
  now, as a rollout would find it (not delivered).

``validate`` probes every replica once; ``prober.py`` probes, for as long as
the daemon lives, every replica whose breaker is open once its backoff is
over, so an agent marked down comes back by itself.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import StrEnum

from dispatcher.delivery.faults import as_local_fault
from dispatcher.delivery.http1 import Connection
from dispatcher.delivery.http1_pool import Http1Pool
from dispatcher.delivery.limits import Body, BodyLimitError
from dispatcher.delivery.statuses import BODY_EXCERPT_BYTES, NO_RUN_STATUSES, not_delivered_reason
from dispatcher.delivery.target import Target

PROBE_BODY = b"{}"


class ProbeResult(StrEnum):
    REACHABLE = "reachable"
    NO_RUN = "no_run"
    NOT_TAKING_WORK = "not_taking_work"
    NO_ANSWER = "no_answer"
    # Our own fault (EMFILE ...): says nothing about the replica.
    LOCAL_FAULT = "local_fault"


@dataclass(frozen=True, slots=True)
class ProbeAnswer:
    result: ProbeResult
    # The status (``HTTP 422``) or why there was none.
    detail: str
    status: int | None = None


async def probe_run(pool: Http1Pool, target: Target, timeout_s: float) -> ProbeAnswer:
    """``POST /run`` with ``{}`` within ``timeout_s``: what the answer says of the replica."""
    conn: Connection | None = None
    try:
        async with asyncio.timeout(timeout_s):
            conn = await pool.post(target, PROBE_BODY, BODY_EXCERPT_BYTES)
            status, raw = conn.status, await _excerpt(conn)
    except (OSError, TimeoutError) as exc:
        fault = as_local_fault(exc)
        if fault is not None:
            return ProbeAnswer(ProbeResult.LOCAL_FAULT, fault.message)
        return ProbeAnswer(ProbeResult.NO_ANSWER, str(exc) or type(exc).__name__)
    finally:
        if conn is not None:
            pool.release(conn, target)
    if status in NO_RUN_STATUSES:
        result = ProbeResult.NO_RUN
    elif not_delivered_reason(status, raw) is not None:
        result = ProbeResult.NOT_TAKING_WORK
    else:
        result = ProbeResult.REACHABLE
    return ProbeAnswer(result, f"HTTP {status}", status)


async def _excerpt(conn: Connection) -> Body:
    """The body's first ``BODY_EXCERPT_BYTES``: all a probe's answer is judged on."""
    try:
        return await conn.body(None)
    except BodyLimitError as exc:
        return exc.partial
