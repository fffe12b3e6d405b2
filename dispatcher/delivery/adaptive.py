"""Adaptive concurrency (``--concurrency auto``): each replica's load found and held by itself.

One controller per replica, so a replica that dies (its breaker opens) or
slows down never drags the others' limits with it; an agent's limit is the
sum of its healthy replicas' limits, capped by ``--agent-concurrency``.

The rule is AIMD with a latency guard, after TCP Vegas and the Gradient
limiters of Netflix's concurrency-limits: a limit grows only while latency
holds near its no-load baseline, and is cut on the signals an agent server
gives when it is past its capacity. Every ``interval_s``:

- a congestion signal in the window (HTTP 429, or 503 with ``Retry-After``;
  a rollout timeout) → multiplicative decrease (``× decrease``);
- else the recent p95 near the rollout timeout, or the recent median past a
  tolerance over the baseline (the lowest median of the last
  ``baseline_windows`` windows; the tolerance widens with the window's own
  noise, see ``AimdPolicy``) → a gentler decrease (``× latency_decrease``);
- else, when the limit is in use (demand exists): slow start (``× 1.5``)
  until the first decrease, then additive increase (``+ max(1, 5 %)``).

Pure state and a clock, pinned on a fake clock in tests.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

Clock = Callable[[], float]


@dataclass(frozen=True)
class AimdPolicy:
    initial: int = 8
    minimum: int = 1
    maximum: int = 1024
    interval_s: float = 1.0
    min_samples: int = 20
    decrease: float = 0.7
    latency_decrease: float = 0.97
    # Latency "climbs" past baseline × (min_tolerance + noise_margin × the
    # window median's relative standard error): a noisy agent needs a bigger
    # rise to count, a steady one is caught as soon as it slows.
    min_tolerance: float = 1.05
    noise_margin: float = 3.0
    slow_start: float = 1.5
    additive_share: float = 0.05
    baseline_windows: int = 30
    # Share of the rollout timeout the recent p95 may reach before cutting.
    timeout_share: float = 0.8


@dataclass
class AimdController:
    """One replica's adaptive limit."""

    policy: AimdPolicy
    clock: Clock = time.monotonic
    rollout_timeout_s: float | None = None
    limit: int = field(init=False)
    reason: str = "initial"
    slow_start: bool = True
    _latencies: list[float] = field(default_factory=list)
    _congestion: int = 0
    _peak_in_flight: int = 0
    _medians: deque[float] = field(default_factory=deque)
    _next_tick: float = field(init=False)

    def __post_init__(self) -> None:
        self.limit = max(self.policy.minimum, min(self.policy.initial, self.policy.maximum))
        self._next_tick = self.clock() + self.policy.interval_s

    def on_answer(self, latency_s: float) -> None:
        self._latencies.append(latency_s)

    def on_congestion(self) -> None:
        self._congestion += 1

    def on_in_flight(self, in_flight: int) -> None:
        self._peak_in_flight = max(self._peak_in_flight, in_flight)

    def tick(self) -> bool:
        """Apply the rules once the interval has passed; True when the limit changed.

        A window closes after ``interval_s`` with ``min_samples`` answers, or at
        once on a congestion signal; a slow agent's window stays open longer,
        so its median is not noise.
        """
        now = self.clock()
        if now < self._next_tick:
            return False
        if not self._congestion and len(self._latencies) < self.policy.min_samples:
            return False
        self._next_tick = now + self.policy.interval_s
        before = self.limit
        self.limit, self.reason = self._decide()
        self._latencies, self._congestion, self._peak_in_flight = [], 0, 0
        return self.limit != before

    def _decide(self) -> tuple[int, str]:
        if self._congestion:
            self.slow_start = False
            return self._cut(self.policy.decrease), f"{self._congestion} congestion signals"
        median = statistics.median(self._latencies)
        self._remember(median)
        too_slow = self._too_slow(median)
        if too_slow:
            self.slow_start = False
            return self._cut(self.policy.latency_decrease), too_slow
        if self._peak_in_flight < self.limit * 0.9:
            return self.limit, "limit not in use"
        return self._grow(), "latency holds"

    def _too_slow(self, median: float) -> str:
        timeout_s = self.rollout_timeout_s
        if timeout_s is not None:
            p95 = _p95(self._latencies)
            if p95 > timeout_s * self.policy.timeout_share:
                return f"p95 {p95:.2f} s near the rollout timeout {timeout_s:g} s"
        baseline = min(self._medians)
        if median > baseline * self._tolerance():
            return f"median latency {median:.3f} s vs baseline {baseline:.3f} s"
        return ""

    def _tolerance(self) -> float:
        """How far above the baseline the median may be before it counts as a rise."""
        logs = sorted(math.log(max(v, 1e-6)) for v in self._latencies)
        n = len(logs)
        # Spread from the interquartile range of log latencies (robust, and
        # right for the long right tail rollout latencies have).
        sigma = (logs[(3 * n) // 4] - logs[n // 4]) / 1.349
        relative_se = 1.2533 * sigma / math.sqrt(n)
        return self.policy.min_tolerance + self.policy.noise_margin * relative_se

    def _remember(self, median: float) -> None:
        self._medians.append(median)
        if len(self._medians) > self.policy.baseline_windows:
            self._medians.popleft()

    def _cut(self, factor: float) -> int:
        return max(self.policy.minimum, math.floor(self.limit * factor))

    def _grow(self) -> int:
        if self.slow_start:
            grown = math.ceil(self.limit * self.policy.slow_start)
        else:
            grown = self.limit + max(1, round(self.limit * self.policy.additive_share))
        return min(self.policy.maximum, grown)


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


class StartRateLimiter:
    """``--max-starts-per-s R``: requests spaced at least ``1/R`` apart, never in bursts.

    Waiters queue in order and one timer lets the head go when its turn
    comes; the spacing runs from the moment a request was let go, not from
    when it was scheduled, so a late wake-up never lets the next one crowd it.
    A 2 % stretch keeps the agent's own count under R in any second even
    when the network delivers two requests a little closer than they left.
    """

    STRETCH = 1.02

    def __init__(self, rate_per_s: float, clock: Clock = time.monotonic) -> None:
        self.rate_per_s = rate_per_s
        self._clock = clock
        self._spacing_s = self.STRETCH / rate_per_s
        self._next = -math.inf
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._timer: asyncio.TimerHandle | None = None

    async def acquire(self) -> float:
        """Wait for this request's turn; the seconds waited."""
        now = self._clock()
        if not self._waiters and now >= self._next:
            self._next = now + self._spacing_s
            return 0.0
        turn = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        self._arm()
        try:
            await turn
        finally:
            if not turn.done():
                self._waiters.remove(turn)
        return self._clock() - now

    def _arm(self) -> None:
        if self._timer is None and self._waiters:
            delay_s = max(0.0, self._next - self._clock())
            self._timer = asyncio.get_running_loop().call_later(delay_s, self._let_one_go)

    def _let_one_go(self) -> None:
        self._timer = None
        now = self._clock()
        if now >= self._next:
            while self._waiters:
                turn = self._waiters.popleft()
                if not turn.done():
                    turn.set_result(None)
                    self._next = now + self._spacing_s
                    break
        self._arm()
