"""Is ``/run`` served at a replica? One ``POST /run`` that no agent runs (DESIGN A11).

The probe posts ``{}``. NeMo Gym's agents are FastAPI apps whose ``/run`` body
model requires ``responses_create_params``: they answer 422 without running
anything (our sim agent answers 422 to a body without a task index). Any
HTTP answer means the replica is reachable, except:

- 404/405: no ``/run`` there, a wrong URL: a configuration error;
- 429/502/503/504, or 409 ``admission_closed``: alive but taking no work
  now, as a rollout would find it (not delivered).

``validate`` probes every replica once; the ``Prober`` probes, for as long as
the daemon lives, every replica whose breaker is open once its backoff is
over, so an agent marked down comes back by itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import aiohttp

from dispatcher.delivery.faults import as_local_fault
from dispatcher.delivery.replicas import BreakerState
from dispatcher.delivery.statuses import BODY_EXCERPT_BYTES, NO_RUN_STATUSES, not_delivered_reason

if TYPE_CHECKING:
    from dispatcher.delivery.client import AgentClient

PROBE_BODY = b"{}"
# Never look again sooner than this: a breaker's probe in flight ends on its own.
MIN_LOOK_S = 0.01


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


async def probe_run(session: aiohttp.ClientSession, run_url: str, timeout_s: float) -> ProbeAnswer:
    """``POST {run_url}`` with ``{}`` within ``timeout_s``: what the answer says of the replica."""
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(
                run_url,
                data=PROBE_BODY,
                headers={"Content-Type": "application/json"},
                allow_redirects=False,
            ) as resp:
                raw = await resp.content.read(BODY_EXCERPT_BYTES)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        fault = as_local_fault(exc)
        if fault is not None:
            return ProbeAnswer(ProbeResult.LOCAL_FAULT, fault.message)
        return ProbeAnswer(ProbeResult.NO_ANSWER, str(exc) or type(exc).__name__)
    status = resp.status
    if status in NO_RUN_STATUSES:
        result = ProbeResult.NO_RUN
    elif not_delivered_reason(status, raw) is not None:
        result = ProbeResult.NOT_TAKING_WORK
    else:
        result = ProbeResult.REACHABLE
    return ProbeAnswer(result, f"HTTP {status}", status)


class Prober:
    """Probes every replica whose breaker is open, once its backoff is over (half-open).

    Without it an agent whose every replica is open gets no traffic once its
    rollouts are no longer started, so no breaker would ever half-open again.
    The breaker keeps the rule: a failed probe reopens it for twice as long
    (up to its cap), an answer closes it.
    """

    def __init__(
        self,
        agents: AgentClient,
        timeout_s: float,
        idle_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._agents = agents
        self._timeout_s = timeout_s
        # How often to look when no breaker is open.
        self._idle_s = idle_s
        self._clock = clock

    async def run(self) -> None:
        while True:
            due = self._agents.due_for_probe()
            if due:
                await asyncio.gather(*(self._agents.probe(r, self._timeout_s) for r in due))
            await asyncio.sleep(self.next_look_in_s())

    def next_look_in_s(self) -> float:
        """Until the first open breaker's backoff ends, at most ``idle_s``."""
        now = self._clock()
        waits = [
            r.breaker.reopen_at - now
            for replicas in self._agents.replica_sets.values()
            for r in replicas.open_replicas()
            if r.breaker.state is BreakerState.OPEN and not r.no_run
        ]
        return max(MIN_LOOK_S, min([self._idle_s, *waits]))
