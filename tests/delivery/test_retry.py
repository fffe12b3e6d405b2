"""The rules of delivery (contracts §11) on a fake clock: breakers, routing, backoff, own faults."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from dispatcher.admission.pool import Limiter
from dispatcher.delivery.agent_errors import AgentMisconfigured
from dispatcher.delivery.client import AgentClient
from dispatcher.delivery.faults import FaultPersisted, LocalFault, LocalFaultPolicy, as_local_fault
from dispatcher.delivery.http1_pool import Http1Pool
from dispatcher.delivery.policy import DeliveryPolicy
from dispatcher.delivery.replicas import (
    Breaker,
    BreakerPolicy,
    BreakerState,
    Replica,
    ReplicaSet,
)
from dispatcher.delivery.retry import BackoffPolicy, parse_retry_after
from dispatcher.files.resume import RunState
from dispatcher.outcome import Outcome
from tests.helpers import serve


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


POLICY = BreakerPolicy(failures_to_open=3, open_s=1.0, open_cap_s=4.0)


def test_a_breaker_opens_after_consecutive_not_delivered_attempts() -> None:
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    assert [breaker.on_not_delivered() for _ in range(3)] == [False, False, True]
    assert breaker.state is BreakerState.OPEN
    assert not breaker.admits()


def test_a_delivered_answer_resets_the_count() -> None:
    breaker = Breaker(POLICY, FakeClock())
    breaker.on_not_delivered()
    breaker.on_not_delivered()
    assert breaker.on_delivered() is False  # it was closed: no transition
    assert [breaker.on_not_delivered() for _ in range(3)] == [False, False, True]


def test_half_open_lets_one_probe_through_and_backs_off_on_failure() -> None:
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    for _ in range(3):
        breaker.on_not_delivered()
    clock.now += 1.0
    assert breaker.admits()
    breaker.on_send()
    assert breaker.state is BreakerState.HALF_OPEN
    assert not breaker.admits()  # one probe at a time
    assert breaker.on_not_delivered() is False  # opened again, not a new opening
    assert breaker.state is BreakerState.OPEN and breaker.open_for_s == 2.0
    for expected in (4.0, 4.0):  # doubles up to the cap
        clock.now = breaker.reopen_at
        assert breaker.admits()
        breaker.on_send()
        breaker.on_not_delivered()
        assert breaker.open_for_s == expected


def test_a_probe_that_is_answered_closes_the_breaker() -> None:
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    for _ in range(3):
        breaker.on_not_delivered()
    clock.now += 1.0
    assert breaker.admits()
    breaker.on_send()
    assert breaker.on_delivered() is True
    assert breaker.state is BreakerState.CLOSED and breaker.admits()


def test_an_abandoned_probe_frees_the_half_open_slot() -> None:
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    for _ in range(3):
        breaker.on_not_delivered()
    clock.now += 1.0
    assert breaker.admits()
    breaker.on_send()
    breaker.on_abandoned()
    assert breaker.admits()


def test_routing_skips_open_replicas_even_with_fewer_in_flight() -> None:
    clock = FakeClock()
    replicas = ReplicaSet("a", ["http://dead", "http://live"], POLICY, clock)
    dead, live = replicas.replicas
    live.in_flight = 50
    for _ in range(3):
        dead.breaker.on_not_delivered()
    assert all(replicas.pick() is live for _ in range(10))


def test_routing_prefers_another_replica_for_a_retry() -> None:
    replicas = ReplicaSet("a", ["http://one", "http://two"], POLICY, FakeClock())
    one, two = replicas.replicas
    two.in_flight = 5
    assert replicas.pick() is one
    assert replicas.pick(avoid=one) is two


def test_an_agent_is_down_only_while_every_replica_is_open() -> None:
    clock = FakeClock()
    replicas = ReplicaSet("a", ["http://one", "http://two"], POLICY, clock)
    one, two = replicas.replicas
    for _ in range(3):
        one.breaker.on_not_delivered()
    assert replicas.down_for_s() is None
    clock.now += 2.0
    for _ in range(3):
        two.breaker.on_not_delivered()
    clock.now += 5.0
    assert replicas.down_for_s() == 5.0
    assert replicas.pick() is not None  # both half-open now: probes go through
    assert replicas.next_admission_in_s() == 0.0


def test_full_jitter_stays_within_the_doubling_ceiling() -> None:
    policy = BackoffPolicy(base_s=0.5, cap_s=4.0)
    rng = random.Random(1)
    for retry, ceiling in [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (10, 4.0)]:
        delays = [policy.delay_s(retry, rng) for _ in range(200)]
        assert min(delays) >= 0.0 and max(delays) <= ceiling
        assert max(delays) > ceiling * 0.8  # spread over the whole window


def test_retry_after_is_a_floor() -> None:
    policy = BackoffPolicy(base_s=0.5, cap_s=4.0)
    rng = random.Random(2)
    assert all(policy.delay_s(0, rng, retry_after_s=3.0) >= 3.0 for _ in range(100))


def test_retry_after_parses_seconds_and_http_dates() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after("7", now) == 7.0
    assert parse_retry_after("Tue, 14 Nov 2023 22:13:30 GMT", now) == pytest.approx(10.0)
    assert parse_retry_after("soon", now) is None
    assert parse_retry_after(None, now) is None


def test_max_tries_within_a_deadline_follows_the_mean_delays() -> None:
    policy = BackoffPolicy(base_s=1.0, cap_s=4.0)
    # Mean delays 0.5, 1, 2, 2, 2...: 5 tries fit in 5.5 s, a 6th needs 7.5 s.
    assert policy.max_tries_within(5.5) == 5
    assert policy.max_tries_within(7.4) == 5
    assert policy.max_tries_within(7.5) == 6


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (OSError(errno.EMFILE, "Too many open files"), "EMFILE"),
        (OSError(errno.ENFILE, "File table overflow"), "ENFILE"),
        (OSError(errno.ENOBUFS, "No buffer space"), "ENOBUFS"),
        (MemoryError(), "MemoryError"),
    ],
)
def test_local_faults_are_recognised(exc: BaseException, kind: str) -> None:
    fault = as_local_fault(exc)
    assert fault is not None and fault.kind == kind


def test_emfile_names_the_descriptor_limit() -> None:
    fault = as_local_fault(OSError(errno.EMFILE, "Too many open files"))
    assert fault is not None and "ulimit -n" in fault.message


def test_an_emfile_inside_an_aiohttp_connect_error_is_ours() -> None:
    key = aiohttp.client_reqrep.ConnectionKey("h", 1, False, True, None, None, None)
    exc = aiohttp.ClientConnectorError(key, OSError(errno.EMFILE, "Too many open files"))
    fault = as_local_fault(exc)
    assert fault is not None and fault.kind == "EMFILE"


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionRefusedError(errno.ECONNREFUSED, "refused"),
        OSError(errno.ECONNRESET, "reset"),
        ValueError("x"),
    ],
)
def test_faults_of_the_peer_are_not_ours(exc: BaseException) -> None:
    assert as_local_fault(exc) is None


def test_a_fault_that_persists_with_nothing_delivered_ends_the_run() -> None:
    clock = FakeClock()
    policy = LocalFaultPolicy(persist_s=10.0, clock=clock)
    fault = LocalFault("EMFILE", "too many open files (EMFILE)")
    policy.on_fault(fault)
    clock.now += 9.0
    policy.on_fault(fault)
    policy.on_delivered()  # cleared: the clock starts again
    clock.now += 9.0
    policy.on_fault(fault)
    clock.now += 10.0
    with pytest.raises(FaultPersisted, match="EMFILE"):
        policy.on_fault(fault)


async def test_the_limiter_shrinks_without_taking_slots_back_and_grows_by_one() -> None:
    limiter = Limiter(8)
    for _ in range(6):
        await limiter.acquire()
    assert limiter.shrink() == 3
    waiter = asyncio.create_task(limiter.acquire())
    for _ in range(3):
        limiter.release()
    await asyncio.sleep(0)
    assert not waiter.done()  # 3 in use, limit 3
    limiter.grow()
    await waiter
    assert (limiter.in_use, limiter.limit) == (4, 4)


async def test_a_cancelled_waiter_does_not_leak_a_slot() -> None:
    limiter = Limiter(1)
    await limiter.acquire()
    waiter = asyncio.create_task(limiter.acquire())
    await asyncio.sleep(0)
    limiter.release()  # hands the slot to the waiter...
    waiter.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert limiter.in_use == 0


def test_a_not_delivered_row_spends_no_attempt() -> None:
    state = RunState(max_attempts=1)
    state.add_failure(7, {"_ng_failure_class": "agent_request_failed"})
    state.add_failure(
        8, {"_ng_failure_class": "agent_request_failed", "_ng_failure_not_delivered": True}
    )
    assert state.is_final(7) and not state.is_final(8)
    assert state.attempt_index(8) == 0 and state.not_delivered == 1


# ---- a 404 to POST /run: a wrong URL, or a task's failure ------------------------------


class NoRunSeen:
    """A ``DeliveryObserver`` that keeps the statuses of the replicas said to have no /run."""

    def __init__(self) -> None:
        self.statuses: list[int] = []

    def retrying(self, *args: object) -> None:
        pass

    def replica_changed(self, replica: Replica, opened: bool) -> None:
        pass

    def replica_has_no_run(self, replica: Replica, status: int) -> None:
        self.statuses.append(status)


@contextlib.asynccontextmanager
async def agent_on(
    run: Callable[[web.Request], Awaitable[web.Response]],
) -> AsyncIterator[tuple[AgentClient, FakeClock, NoRunSeen]]:
    """Agent ``sim`` on a fake clock, its one replica answering ``POST /run`` with ``run``."""
    app = web.Application()
    app.router.add_post("/run", run)
    runner, url = await serve(app)
    clock, pool, seen = FakeClock(), Http1Pool(5.0), NoRunSeen()
    agents = AgentClient({"sim": [url]}, pool, DeliveryPolicy(breaker=POLICY), seen, clock=clock)
    try:
        yield agents, clock, seen
    finally:
        await pool.close()
        await runner.cleanup()


async def test_a_replica_that_404s_before_any_2xx_is_back_once_a_probe_finds_run() -> None:
    # An ingress answering 404 while the agent behind it starts: out of routing,
    # and in a daemon that lives on, back once a probe finds /run (a restart was needed).
    serving = False

    async def run(request: web.Request) -> web.Response:
        if not serving:
            return web.json_response({"detail": "Not Found"}, status=404)
        if "_ng_task_index" not in await request.json():
            return web.json_response({"detail": "field required"}, status=422)
        return web.json_response({"reward": 1.0})

    async with agent_on(run) as (agents, clock, seen):
        with pytest.raises(AgentMisconfigured):
            await agents.run("sim", {"_ng_task_index": 0}, "0-0")
        [replica] = agents.replica_sets["sim"].replicas
        assert agents.due_for_probe() == []
        clock.now += POLICY.open_s
        assert agents.due_for_probe() == [replica]
        await agents.probe(replica, 5.0)  # still 404: held open, for longer
        assert replica.no_run and replica.breaker.open_for_s == 2 * POLICY.open_s
        serving = True
        clock.now = replica.breaker.reopen_at
        await agents.probe(replica, 5.0)
        attempt = await agents.run("sim", {"_ng_task_index": 0}, "0-0")
    assert attempt.outcome is Outcome.SUCCESS
    assert seen.statuses == [404] and not replica.no_run


async def test_a_probes_404_from_a_replica_that_served_run_keeps_it_out_but_not_misconfigured() -> (
    None
):
    # An ingress restarting in front of an agent that has answered rollouts: the
    # replica waits for a later probe; its agent is no wrong URL.
    not_found = False

    async def run(request: web.Request) -> web.Response:
        if not_found:
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response({"reward": 1.0})

    async with agent_on(run) as (agents, clock, seen):
        assert (await agents.run("sim", {"_ng_task_index": 0}, "0-0")).outcome is Outcome.SUCCESS
        [replica] = agents.replica_sets["sim"].replicas
        for _ in range(POLICY.failures_to_open):
            replica.breaker.on_not_delivered()  # it stopped answering for a while
        not_found = True
        clock.now = replica.breaker.reopen_at
        await agents.probe(replica, 5.0)
    assert replica.breaker.state is BreakerState.OPEN and not replica.no_run
    assert seen.statuses == []
