"""The adaptive controller's rules and the hard caps, pinned on a fake clock."""

from __future__ import annotations

import asyncio
import itertools
import math

from dispatcher.delivery.adaptive import AimdController, AimdPolicy, StartRateLimiter
from dispatcher.delivery.replicas import BreakerPolicy, ReplicaSet

POLICY = AimdPolicy(initial=8, minimum=1, maximum=100, interval_s=1.0, min_samples=3)


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def window(
    controller: AimdController,
    clock: FakeClock,
    latency_s: float,
    *,
    in_flight: int | None = None,
    samples: int = 5,
) -> bool:
    """One control interval: answers at ``latency_s`` with the limit in use, then a tick."""
    controller.on_in_flight(controller.limit if in_flight is None else in_flight)
    for _ in range(samples):
        controller.on_answer(latency_s)
    clock.now += 1.0
    return controller.tick()


def test_slow_start_multiplies_while_latency_holds() -> None:
    clock = FakeClock()
    c = AimdController(POLICY, clock)
    limits = []
    for _ in range(4):
        assert window(c, clock, 0.2)
        limits.append(c.limit)
    assert limits == [12, 18, 27, 41]
    assert c.reason == "latency holds"


def test_congestion_cuts_multiplicatively_and_ends_slow_start() -> None:
    clock = FakeClock()
    c = AimdController(POLICY, clock)
    for _ in range(3):
        window(c, clock, 0.2)
    assert c.limit == 27
    c.on_congestion()
    clock.now += 1.0
    assert c.tick()
    assert (c.limit, c.slow_start) == (18, False)  # floor(27 * 0.7)
    assert "congestion" in c.reason
    window(c, clock, 0.2)
    assert c.limit == 19  # additive now: + max(1, 5 %)


def test_a_congestion_signal_closes_the_window_at_once() -> None:
    clock = FakeClock()
    c = AimdController(POLICY, clock)
    c.on_congestion()
    clock.now += 1.0
    assert c.tick() and c.limit == 5


def test_latency_past_the_tolerance_cuts_gently() -> None:
    clock = FakeClock()
    c = AimdController(POLICY, clock)
    window(c, clock, 0.2)  # baseline 0.2 s, limit 12
    assert not window(c, clock, 0.2 * 1.02, in_flight=0)  # within the tolerance
    assert window(c, clock, 0.2 * 1.06)
    assert c.limit == 11  # floor(12 * 0.95)
    assert "baseline 0.200 s" in c.reason


def test_p95_near_the_rollout_timeout_cuts() -> None:
    clock = FakeClock()
    c = AimdController(POLICY, clock, rollout_timeout_s=10.0)
    for latency in (1.0, 1.0, 1.0, 9.0, 9.0):
        c.on_answer(latency)
    c.on_in_flight(c.limit)
    clock.now += 1.0
    assert c.tick()
    assert c.limit == 7 and "rollout timeout" in c.reason


def test_an_unused_limit_is_not_raised() -> None:
    clock = FakeClock()
    c = AimdController(POLICY, clock)
    assert not window(c, clock, 0.2, in_flight=3)
    assert c.limit == 8 and c.reason == "limit not in use"


def test_a_window_waits_for_enough_answers_and_for_the_interval() -> None:
    clock = FakeClock()
    c = AimdController(POLICY, clock)
    c.on_in_flight(8)
    c.on_answer(0.2)
    clock.now += 5.0
    assert not c.tick()  # too few answers: the window stays open
    c.on_answer(0.2)
    c.on_answer(0.2)
    assert c.tick() and c.limit == 12
    for _ in range(5):
        c.on_answer(0.2)
    clock.now += 0.5
    assert not c.tick()  # the interval has not passed


def test_limits_stay_within_min_and_max() -> None:
    clock = FakeClock()
    c = AimdController(AimdPolicy(initial=90, maximum=100, min_samples=1), clock)
    window(c, clock, 0.2)
    assert c.limit == 100
    for _ in range(30):
        c.on_congestion()
        clock.now += 1.0
        c.tick()
    assert c.limit == 1


def test_a_noisy_window_needs_a_bigger_rise_to_count() -> None:
    clock = FakeClock()
    c = AimdController(POLICY, clock)
    window(c, clock, 0.2)  # baseline 0.2 s, limit 12
    # Half the answers at 0.1 s, half at 0.5 s: the median 0.3 s is 1.5x the
    # baseline, but a five-answer window that spread says little.
    for latency in (0.1, 0.1, 0.3, 0.5, 0.5):
        c.on_answer(latency)
    c.on_in_flight(c.limit)
    clock.now += 1.0
    assert c.tick() and c.reason == "latency holds"


def test_the_baseline_forgets_old_windows() -> None:
    clock = FakeClock()
    policy = AimdPolicy(initial=8, min_samples=1, baseline_windows=3)
    c = AimdController(policy, clock)
    window(c, clock, 0.1)
    assert c.limit == 12
    reasons = []
    for _ in range(3):
        window(c, clock, 0.5, in_flight=0)
        reasons.append(c.reason)
    # Twice cut while the 0.1 s window is remembered, then 0.5 s is the baseline.
    assert reasons[:2] == ["median latency 0.500 s vs baseline 0.100 s"] * 2
    assert reasons[2] == "limit not in use" and c.limit == 10
    window(c, clock, 0.5)
    assert (c.reason, c.limit) == ("latency holds", 11)


class RecordingLimiter(StartRateLimiter):
    """Notes the instant each start is let go (each time the next turn is set)."""

    def __init__(self, rate_per_s: float) -> None:
        self.let_go: list[float] = []
        super().__init__(rate_per_s)

    def __setattr__(self, name: str, value: object) -> None:
        if name == "_next" and isinstance(value, float) and math.isfinite(value):
            self.let_go.append(value - self._spacing_s)
        super().__setattr__(name, value)


async def test_starts_are_let_go_one_at_a_time_at_least_the_spacing_apart() -> None:
    limiter = RecordingLimiter(200.0)

    await asyncio.gather(*(limiter.acquire() for _ in range(60)))

    # Measured where the limiter lets each one go, not where its task next ran:
    # a task resumed late says nothing of the spacing the agent sees.
    assert len(limiter.let_go) == 60
    gaps = [b - a for a, b in itertools.pairwise(limiter.let_go)]
    # Never closer than the spacing, however late the loop woke the timer.
    assert min(gaps) >= StartRateLimiter.STRETCH / 200.0 - 1e-9


async def test_a_cancelled_start_gives_its_turn_to_the_next() -> None:
    limiter = StartRateLimiter(100.0)
    await limiter.acquire()  # the first goes at once; the next must wait its turn
    first = asyncio.create_task(limiter.acquire())
    second = asyncio.create_task(limiter.acquire())
    await asyncio.sleep(0)
    first.cancel()
    assert await second >= 0.0
    assert first.cancelled()


def test_routing_never_picks_a_replica_at_its_cap() -> None:
    replicas = ReplicaSet("a", ["http://one", "http://two"], BreakerPolicy(), cap=2)
    one, two = replicas.replicas
    one.in_flight, two.in_flight = 2, 1
    assert all(replicas.pick() is two for _ in range(5))
    two.in_flight = 2
    assert replicas.pick() is None and replicas.at_cap()


def test_routing_prefers_replicas_under_their_adaptive_limit() -> None:
    clock = FakeClock()
    replicas = ReplicaSet(
        "a",
        ["http://one", "http://two"],
        BreakerPolicy(),
        clock,
        controller=lambda: AimdController(POLICY, clock),
    )
    one, two = replicas.replicas
    one.in_flight, two.in_flight = 3, 9  # two is past its limit of 8
    assert replicas.pick() is one
    assert replicas.healthy_limit() == 16


def test_an_open_replica_leaves_the_agents_adaptive_limit_and_only_its_own() -> None:
    clock = FakeClock()
    replicas = ReplicaSet(
        "a",
        ["http://one", "http://two"],
        BreakerPolicy(failures_to_open=1),
        clock,
        controller=lambda: AimdController(POLICY, clock),
    )
    one, two = replicas.replicas
    one.breaker.on_not_delivered()
    assert replicas.healthy_limit() == 8
    assert two.controller is not None and two.controller.limit == 8
