"""HTTP client to agent servers (contracts §3, §5, §11): delivery, replicas, failure classes.

An attempt is one rollout's ``POST {replica}/run`` until an agent answers.
An answer is *delivered*; no answer, 429/502/503/504, or a 409 that says
``admission_closed`` (a NeMo Gym agent taking a checkpoint) is *not delivered*
(the rollout most likely never ran) and is retried here, within the run, on
another healthy replica where there is one, with full-jitter backoff that
honours ``Retry-After``, until the delivery deadline. Not-delivered tries
spend nothing; only a rollout whose deadline ran out becomes a failure,
marked ``_ng_failure_not_delivered`` so resume does not count it.

Whatever happens becomes an ``Attempt`` value (``answers.py``: the values
and the failure classes of an answer; ``exchange.py``: one HTTP exchange
with a replica); nothing here raises for an agent's
misbehaviour. The dispatcher's own faults (EMFILE, MemoryError, ...)
raise ``LocalFault`` instead: they are not the agent's. A 404 or 405 to
``POST /run`` from a replica that never answered 2xx is neither: that
replica serves no ``/run`` (a wrong URL); it leaves routing until a probe
finds ``/run`` there, and when every replica of the agent has left ``run``
raises ``AgentMisconfigured`` (exit 2), never a failure row. From a replica
that has answered 2xx, a 404 is its task's failure (``agent_run_error``).

What the client is given (its ``DeliveryPolicy``, its observer) is in
``policy.py``; the errors that stop a run, with their messages, in
``agent_errors.py``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from dispatcher import jsonx
from dispatcher.aio import Wakeup
from dispatcher.delivery.adaptive import AimdController, StartRateLimiter
from dispatcher.delivery.agent_errors import AgentMisconfigured, no_run_message
from dispatcher.delivery.answers import (
    Attempt,
    Classified,
    Classifier,
    Failure,
    NotDelivered,
    agent_reported_terminal,
    body_excerpt,
    classify_object,
    classify_on_loop,
    classify_response,
)
from dispatcher.delivery.exchange import ExchangeLimits, post_run
from dispatcher.delivery.http1_pool import Http1Pool
from dispatcher.delivery.policy import DeliveryObserver, DeliveryPolicy, Progress, Sending
from dispatcher.delivery.probe import ProbeResult, probe_run
from dispatcher.delivery.replicas import Replica, ReplicaSet
from dispatcher.delivery.statuses import NO_RUN_STATUSES, RATE_LIMITED, RetryReason
from dispatcher.outcome import Outcome

# What an attempt's values are, for those who import them from here.
__all__ = [
    "AgentClient",
    "AgentMisconfigured",
    "Attempt",
    "Classified",
    "Classifier",
    "DeliveryObserver",
    "DeliveryPolicy",
    "Failure",
    "NotDelivered",
    "Progress",
    "Sending",
    "agent_reported_terminal",
    "body_excerpt",
    "classify_object",
    "classify_on_loop",
    "classify_response",
    "no_run_message",
]


Try = tuple[Attempt | None, NotDelivered | None]


class AgentClient:
    """Delivers rollouts to agents, routing each to the healthiest least-loaded replica."""

    def __init__(
        self,
        agents: dict[str, list[str]],
        pool: Http1Pool,
        policy: DeliveryPolicy,
        observer: DeliveryObserver,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self._pool = pool
        self._policy = policy
        self._exchange = ExchangeLimits.of(
            policy.rollout_timeout_s,
            policy.first_byte_timeout_s,
            policy.limits,
            policy.pause_deadlines,
        )
        # What the admission pause stops and starts again (None: nothing).
        self.suspendable = self._exchange.suspendable
        self._observer = observer
        self._clock = clock
        self._rng = rng or random.Random()
        self.replica_sets = {
            name: ReplicaSet(
                name,
                urls,
                policy.breaker,
                clock,
                cap=policy.replica_cap,
                controller=self._controller_factory(),
            )
            for name, urls in agents.items()
        }
        # Fired when a breaker closes, so rollouts waiting for a replica go at
        # once; and when a try ends or a limit changes, for those waiting for room.
        self._recovered = {name: Wakeup() for name in agents}
        # Set by the run's first try: the agents watch counts from it.
        self.first_try = asyncio.Event()
        self._room = {name: Wakeup() for name in agents}
        self._starts = (
            StartRateLimiter(policy.max_starts_per_s, clock)
            if policy.max_starts_per_s is not None
            else None
        )

    def _controller_factory(self) -> Callable[[], AimdController] | None:
        aimd = self._policy.aimd
        if aimd is None:
            return None
        timeout_s = self._policy.rollout_timeout_s
        return lambda: AimdController(aimd, self._clock, timeout_s)

    def tick_controllers(self) -> list[str]:
        """Let each replica's controller apply its rules; the agents whose limit changed."""
        changed = []
        for name, replicas in self.replica_sets.items():
            ticked = [r.controller.tick() for r in replicas.replicas if r.controller is not None]
            if any(ticked):
                changed.append(name)
                self._room[name].fire()
        return changed

    def never_reached(self) -> dict[str, list[str]]:
        """Agents that were sent rollouts but none of whose replicas ever accepted a
        connection, with their replicas' URLs (credentials masked)."""
        reached = self._pool.reached
        return {
            name: replicas.urls()
            for name, replicas in self.replica_sets.items()
            if any(r.stats.sent for r in replicas.replicas)
            and not any(
                (r.run_target.host, r.run_target.port) in reached for r in replicas.replicas
            )
        }

    def in_flight(self) -> dict[str, dict[str, int]]:
        return {
            name: {r.url: r.in_flight for r in rs.replicas}
            for name, rs in self.replica_sets.items()
        }

    def replicas_view(self) -> dict[str, dict[str, dict[str, object]]]:
        return {
            name: {r.url: r.view() for r in rs.replicas} for name, rs in self.replica_sets.items()
        }

    def down_for_s(self, agent: str) -> float | None:
        return self.replica_sets[agent].down_for_s()

    def due_for_probe(self) -> list[Replica]:
        """Open replicas whose backoff is over and whose half-open probe nobody took yet."""
        return [
            r
            for replicas in self.replica_sets.values()
            for r in replicas.open_replicas()
            if r.breaker.admits()
        ]

    async def probe(self, replica: Replica, timeout_s: float) -> None:
        """The half-open probe of an open replica (``probe.probe_run``); its answer
        closes the breaker, no answer reopens it for longer. A replica with no
        ``/run`` is probed too: it is back in routing once a probe finds one."""
        breaker = replica.breaker
        replica.stats.probes += breaker.on_send()
        try:
            answer = await probe_run(self._pool, replica.run_target, timeout_s)
        except BaseException:
            breaker.on_abandoned()
            raise
        if answer.result is ProbeResult.LOCAL_FAULT:
            breaker.on_abandoned()
        elif answer.result is ProbeResult.REACHABLE:
            replica.no_run = False
            self._delivered(replica)
        elif answer.result is ProbeResult.NO_RUN and not replica.served_run:
            self._mark_no_run(replica, answer.status or 0)
        else:
            # Not taking work; or a 404 from a replica that has served /run (an
            # ingress restarting): kept out until a probe is answered otherwise.
            replica.stats.not_delivered += 1
            breaker.on_not_delivered()

    async def run(
        self,
        agent: str,
        body: dict[str, Any],
        rollout_id: str,
        progress: Progress | None = None,
        data: bytes | None = None,
    ) -> Attempt:
        """Deliver one rollout; retries not-delivered tries until the delivery deadline.

        ``data`` is ``body`` already encoded, when the caller has it.

        ``progress.sending`` is true only while a request is at a replica: a
        rollout waiting for a backoff or a replica runs nowhere, and shutdown
        may cancel it at once.
        """
        progress = progress or Sending()
        replicas = self.replica_sets[agent]
        if data is None:
            data = jsonx.dumps(body)  # once: every try sends the same bytes
        # Waits for room or pacing push the deadline back (``_ready_replica``).
        deadline_at = self._clock() + self._policy.deadline_s
        last: Replica | None = None
        retry = 0
        while True:
            replica = self._ready_now(replicas, last)
            if replica is None:
                replica, deadline_at = await self._ready_replica(replicas, last, deadline_at)
            if replica is None:
                return self._deadline_attempt(replicas, last, retry)
            progress.sending = True
            try:
                attempt, missed = await self._try(replica, data)
            finally:
                progress.sending = False
            if attempt is not None and attempt.no_run:
                self._no_run(replicas, replica, attempt)
                last = replica
                continue
            if attempt is not None:
                return _with_retries(attempt, retry)
            assert missed is not None
            delay_s = self._retry_delay(replicas, replica, retry, missed)
            # A retry that would start past the deadline is not made.
            if self._clock() + delay_s >= deadline_at:
                return self._deadline_attempt(replicas, replica, retry, missed)
            await self._wait_to_retry(agent, rollout_id, replica, missed, delay_s, retry)
            last, retry = replica, retry + 1

    def _ready_now(self, replicas: ReplicaSet, last: Replica | None) -> Replica | None:
        """The replica to send to at once, when no wait may come first (else None:
        ``_ready_replica`` decides), without a coroutine for the common case."""
        if self._starts is not None or replicas.all_no_run():
            return None
        return replicas.pick(avoid=last)

    async def _ready_replica(
        self, replicas: ReplicaSet, last: Replica | None, deadline_at: float
    ) -> tuple[Replica | None, float]:
        """The replica to send to now, after any wait for one (None past the
        deadline), and the deadline pushed back by the time waits did not count."""
        while True:
            if replicas.all_no_run():
                raise AgentMisconfigured(no_run_message(replicas.agent, replicas.urls()))
            replica = replicas.pick(avoid=last)
            if replica is None:
                if replicas.at_cap():
                    # Waiting for room under a cap is not time spent delivering.
                    deadline_at += await self._wait_for_room(replicas.agent)
                elif not await self._wait_for_replica(replicas.agent, deadline_at):
                    return None, deadline_at
                continue
            if self._starts is None:
                return replica, deadline_at
            # Kept to ``--max-starts-per-s``: the pacing wait is not spent delivering.
            paced_s = await self._starts.acquire()
            if paced_s <= 0:
                return replica, deadline_at
            deadline_at += paced_s
            # Others may have filled it, or taken its probe, meanwhile.
            if replica.routable() and replica.has_room():
                return replica, deadline_at

    def _retry_delay(
        self, replicas: ReplicaSet, failed: Replica, retry: int, missed: NotDelivered
    ) -> float:
        # Another replica that admits a request now takes the retry at once:
        # a dead replica must not slow the rollouts it bounced.
        other = replicas.pick(avoid=failed)
        if other is not None and other is not failed:
            return 0.0
        return self._policy.backoff.delay_s(retry, self._rng, missed.retry_after_s)

    async def _wait_to_retry(
        self,
        agent: str,
        rollout_id: str,
        replica: Replica,
        missed: NotDelivered,
        delay_s: float,
        retry: int,
    ) -> None:
        """Report the retry to come, then wait ``delay_s`` for it (the retry path only)."""
        self._observer.retrying(replica, rollout_id, missed.reason, delay_s, retry)
        if missed.retry_after_s is not None:
            await asyncio.sleep(delay_s)  # the agent said when: not a moment earlier
        else:
            await self._sleep(agent, delay_s)

    async def _wait_for_replica(self, agent: str, deadline: float) -> bool:
        """Wait until a breaker may admit a probe or one closes; False past the deadline."""
        left_s = deadline - self._clock()
        if left_s <= 0:
            return False
        wait_s = self.replica_sets[agent].next_admission_in_s()
        if wait_s <= 0:
            # A probe is out: its answer closes the breaker (and wakes us), or
            # reopens it; look again after the breaker's shortest backoff.
            wait_s = self._policy.breaker.open_s
        await self._sleep(agent, min(left_s, wait_s))
        return True

    async def _wait_for_room(self, agent: str) -> float:
        """Wait until a try of this agent ends (or a limit changes); the seconds waited."""
        started = self._clock()
        await self._room[agent].wait(self._policy.breaker.open_s)
        return self._clock() - started

    async def _sleep(self, agent: str, delay_s: float) -> None:
        if delay_s > 0:
            await self._recovered[agent].wait(delay_s)

    async def _try(self, replica: Replica, data: bytes) -> Try:
        breaker = replica.breaker
        replica.stats.probes += breaker.on_send()
        replica.in_flight += 1
        replica.stats.sent += 1
        self.first_try.set()  # (a no-op once set: Event.set checks)
        if replica.controller is not None:
            replica.controller.on_in_flight(replica.in_flight)
        started_at, t0 = time.time(), time.perf_counter()
        try:
            status, raw, missed, failure = await post_run(
                self._pool, replica.url, replica.run_target, data, self._exchange
            )
        except BaseException:
            breaker.on_abandoned()
            raise
        finally:
            replica.in_flight -= 1
            self._room[replica.agent].fire()
        if missed is not None:
            self._not_delivered(replica, missed)
            return None, missed
        self._delivered(replica)
        duration_s = time.perf_counter() - t0
        if failure is not None:
            outcome = Outcome(failure.failure_class)
            attempt = Attempt(outcome, replica.url, started_at, duration_s, None, failure)
        else:
            classify = self._policy.classify or classify_on_loop
            outcome, result, failure = await classify(status, raw)
            attempt = Attempt(
                outcome,
                replica.url,
                started_at,
                duration_s,
                result,
                failure,
                body_bytes=len(raw),
                no_run=_says_no_run(replica, status),
            )
        _tell_controller(replica, attempt)
        return attempt, None

    def _no_run(self, replicas: ReplicaSet, replica: Replica, attempt: Attempt) -> None:
        """A replica without ``/run`` leaves routing; an agent left with none is misconfigured."""
        status = attempt.failure.http_status if attempt.failure is not None else None
        self._mark_no_run(replica, status or 0)
        if all(r.no_run for r in replicas.replicas):
            raise AgentMisconfigured(no_run_message(replicas.agent, replicas.urls()))

    def _mark_no_run(self, replica: Replica, status: int) -> None:
        # Its breaker held open: the prober looks again after the backoff, and
        # a daemon gets the replica back once ``/run`` is served there.
        replica.breaker.hold_open()
        if not replica.no_run:
            replica.no_run = True
            self._observer.replica_has_no_run(replica, status)

    def _delivered(self, replica: Replica) -> None:
        replica.stats.delivered += 1
        if replica.breaker.on_delivered():
            self._observer.replica_changed(replica, opened=False)
            self._recovered[replica.agent].fire()

    def _not_delivered(self, replica: Replica, missed: NotDelivered) -> None:
        replica.stats.not_delivered += 1
        if replica.controller is not None and _is_congestion(missed):
            replica.controller.on_congestion()
        if missed.reason == RATE_LIMITED:
            # A 429 comes from a live replica asking for time: its Retry-After
            # (or the backoff) paces the retry; ejecting it would starve a
            # lone replica for the breaker's whole backoff.
            replica.breaker.on_abandoned()
            return
        if replica.breaker.on_not_delivered():
            replica.stats.opened += 1
            self._observer.replica_changed(replica, opened=True)

    def _deadline_attempt(
        self,
        replicas: ReplicaSet,
        replica: Replica | None,
        retry: int,
        missed: NotDelivered | None = None,
    ) -> Attempt:
        deadline_s = self._policy.deadline_s
        why = f" (last: {missed.failure.message})" if missed is not None else ""
        failure = Failure(
            Outcome.AGENT_REQUEST_FAILED.value,
            "DeliveryDeadlineExceeded",
            f"not delivered to agent {replicas.agent!r} within {deadline_s} s; "
            f"replicas: {', '.join(replicas.urls())}{why}",
            http_status=missed.failure.http_status if missed else None,
            response_body=missed.failure.response_body if missed else None,
            not_delivered=True,
            retry_reason=missed.reason if missed else None,
        )
        url = replica.url if replica is not None else replicas.urls()[0]
        return Attempt(
            Outcome.AGENT_REQUEST_FAILED, url, time.time(), 0.0, None, failure, retries=retry
        )


def _is_congestion(missed: NotDelivered) -> bool:
    """An agent past its capacity says so with 429, or 503 with a Retry-After."""
    return missed.reason == RATE_LIMITED or (
        missed.reason == RetryReason.HTTP_503 and missed.retry_after_s is not None
    )


# Answers whose latency is the agent's work; an instant error says nothing about load.
_TIMED_OUTCOMES = frozenset({Outcome.SUCCESS, Outcome.AGENT_REPORTED_FAILURE})


def _tell_controller(replica: Replica, attempt: Attempt) -> None:
    controller = replica.controller
    if controller is None:
        return
    if attempt.outcome in _TIMED_OUTCOMES:
        controller.on_answer(attempt.duration_s)
    elif attempt.outcome is Outcome.TIMEOUT_EXCEEDED:
        controller.on_congestion()


def _says_no_run(replica: Replica, status: int) -> bool:
    """A 404/405 says "no ``/run`` here" only from a replica that never answered 2xx."""
    if 200 <= status < 300:
        replica.served_run = True
    return status in NO_RUN_STATUSES and not replica.served_run


def _with_retries(attempt: Attempt, retries: int) -> Attempt:
    if retries == 0:
        return attempt
    return replace(attempt, retries=retries)
