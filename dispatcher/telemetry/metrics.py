"""Prometheus metrics of one run, on a registry of their own.

Every series here is bounded: labels are agents, outcome classes, gap codes
and fixed quantiles, never rollout ids, so a run of millions of rollouts keeps
the same handful of series.

Figures the run only sometimes knows (latency quantiles before the first
completion, the drain margin before five durations exist, the budget when none
is configured, the rollouts left when the input size is unknown) are *absent*
from the scrape while unknown rather than exported as NaN: `absent()` alerts
work, graphs show a gap instead of a line at zero, and NaN cannot poison a
`sum()` or a comparison.
"""

from __future__ import annotations

import math
import platform
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric

from dispatcher import __version__
from dispatcher.outcome import NOT_STARTED, Outcome
from dispatcher.telemetry.hot_series import PlainHistogram, RolloutSeries
from dispatcher.urls import replica_names

# Agent runs last seconds to hours; the top bucket is the two-hour ceiling the
# per-rollout timeout is usually set below.
# Steps of at most 1.5x from 0.1 s to 10 s, where most agents' rollouts end: a
# histogram_quantile() there reads within a third of the tracker's figure (a step of
# 2.5x put the p95 30 % above it).
DURATION_BUCKETS_S = (
    0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.5,
    10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1200.0, 1800.0, 2700.0,
    3600.0, 5400.0, 7200.0,
)  # fmt: skip
# Quiescence polls every 0.05 s and gives up after 10 s (contracts §6).
CAPTURE_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
START_ORDER_ERROR_BUCKETS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
# The lag goal is a p99 under 10 ms, so the resolution sits around it.
LOOP_LAG_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
LATENCY_QUANTILES = (0.5, 0.75, 0.95)
# contracts §6 gap codes, pre-declared at zero so `increase()` sees the first one.
CAPTURE_GAP_CODES = (
    "model_call_capture_no_records",
    "model_call_capture_incomplete",
    "model_call_capture_records_unreadable",
    "model_call_capture_unreadable",
    "model_call_capture_pending",
)


class RateWindow:
    """Events per hour over a sliding window, in one-second buckets.

    Adding is O(1) amortized (a bucket opens at most once a second and is
    evicted once), so it can sit on a path taken thousands of times a second.
    Until the window has filled, the rate is taken over the time since the
    first event, so it does not start out diluted by an empty window.
    """

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not window_s > 0:
            raise ValueError(f"rate window must be positive, got {window_s!r}")
        self._window_s = window_s
        self._clock = clock
        self._buckets: deque[list[int]] = deque()  # [second, count], oldest first
        self._total = 0
        self._since: float | None = None
        # The newest bucket and its second: where most adds go.
        self._second, self._newest = -1, [-1, 0]

    def start(self) -> None:
        """Start measuring now (dispatch began), even before the first event."""
        if self._since is None:
            self._since = self._clock()

    def add(self) -> None:
        now = self._clock()
        second = int(now)
        if second == self._second:
            self._newest[1] += 1
        else:
            if self._since is None:
                self._since = now
            self._second, self._newest = second, [second, 1]
            self._buckets.append(self._newest)
            self._evict(second)
        self._total += 1

    def per_hour(self) -> float:
        now = self._clock()
        self._evict(int(now))
        if self._since is None or self._total == 0:
            return 0.0
        # Floor of one second: a burst right at the start is not a huge rate.
        span_s = max(1.0, min(self._window_s, now - self._since))
        return self._total * 3600.0 / span_s

    def _evict(self, second: int) -> None:
        buckets = self._buckets
        oldest_kept = second - self._window_s
        while buckets and buckets[0][0] <= oldest_kept:
            self._total -= buckets.popleft()[1]


class _RunFigures:
    """Collector for the figures `Metrics.update` sets; unknown ones are left out."""

    def __init__(self, rate: RateWindow) -> None:
        self.rate = rate
        self.quantiles: dict[str, float] = {}
        self.drain_margin_s: float | None = None
        self.budget_remaining_s: float | None = None
        self.remaining: int | None = None

    def describe(self) -> Iterator[Metric]:
        return self._families(with_samples=False)

    def collect(self) -> Iterator[Metric]:
        return self._families(with_samples=True)

    def _families(self, *, with_samples: bool) -> Iterator[Metric]:
        # A summary, not a gauge: a `quantile` label is reserved for summaries
        # and promtool rejects it anywhere else. No _count/_sum: the tracker's
        # quantiles are precomputed, the duration histogram has the counts.
        quantiles = Metric(
            "dispatcher_rollout_latency_quantile_seconds",
            "Rollout duration quantiles from the dispatch latency tracker.",
            "summary",
        )
        if with_samples:
            for label, value in self.quantiles.items():
                quantiles.add_sample(quantiles.name, {"quantile": label}, value)
        yield quantiles
        yield _gauge(
            "dispatcher_rollouts_per_hour",
            "Successful rollouts per hour over the sliding rate window.",
            self.rate.per_hour() if with_samples else None,
        )
        yield _gauge(
            "dispatcher_drain_margin_seconds",
            "Remaining budget below which a rollout is drained instead of started.",
            self.drain_margin_s if with_samples else None,
        )
        yield _gauge(
            "dispatcher_dispatch_budget_remaining_seconds",
            "Seconds left in the dispatch budget.",
            self.budget_remaining_s if with_samples else None,
        )
        yield _gauge(
            "dispatcher_rollouts_remaining",
            "Rollouts of this run without a final outcome yet.",
            self.remaining if with_samples else None,
        )


def _gauge(name: str, documentation: str, value: float | None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    if value is not None:
        family.add_metric([], value)
    return family


def _known(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


class _WithoutCreated:
    """A view of a registry without the `_created` series.

    prometheus-client adds a creation timestamp next to every counter and
    histogram; in the classic text format they become extra gauge series that
    double the series count and that nobody graphs. Filtering at scrape time
    keeps `disable_created_metrics()`, which is process-wide, out of a library.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            if family.type in ("counter", "histogram", "summary"):
                family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class Metrics:
    """All the daemon's metrics, updated by its jobs on their completion path (``Job.record``).

    Pairing contract: every `rollout_started` is followed by exactly one
    `rollout_left_agent` (when its agent answered, or it was cancelled or put
    back), so the in-flight gauge returns to zero, and by one `rollout_finished`
    (any outcome, cancelled and kill-shaped included). A drained rollout never
    started and is only counted by `rollout_drained`.

    `rate_outcomes` are the outcomes the rollouts-per-hour rate counts
    (successes: the rows a trainer gets); `clock` is injectable for tests;
    `process_metrics` adds the standard `process_*` series (CPU, memory, fds).
    """

    def __init__(
        self,
        *,
        registry: CollectorRegistry | None = None,
        rate_window_s: float = 300.0,
        rate_outcomes: Collection[str] = (Outcome.SUCCESS,),
        clock: Callable[[], float] = time.monotonic,
        process_metrics: bool = True,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._rate = RateWindow(rate_window_s, clock)
        self._rate_outcomes = frozenset(rate_outcomes)
        self._figures = _RunFigures(self._rate)
        self._define_rollout_metrics()
        self._define_runtime_metrics()
        self.registry.register(self._figures)
        if process_metrics:
            ProcessCollector(registry=self.registry)

    def _define_rollout_metrics(self) -> None:
        registry = self.registry
        # The per-rollout series: plain numbers, rendered at each scrape.
        self._series = RolloutSeries(DURATION_BUCKETS_S)
        registry.register(self._series)
        self._drained = Counter(
            "dispatcher_rollouts_drained",
            "Rollouts the dispatch budget never started; they run on resume.",
            registry=registry,
        )
        self._define_delivery_metrics()

    def _define_delivery_metrics(self) -> None:
        registry = self.registry
        self._retries = Counter(
            "dispatcher_retries",
            "Not-delivered tries retried within the run (no answer, 429/502/503/504), by reason.",
            ("agent", "reason"),
            registry=registry,
        )
        self._replica_up = Gauge(
            "dispatcher_replica_up",
            "1 while a replica's circuit breaker lets requests through, 0 while it is open.",
            ("agent", "replica"),
            registry=registry,
        )
        self._agent_up = Gauge(
            "dispatcher_agent_up",
            "0 once every replica of an agent has been down past the delivery deadline.",
            ("agent",),
            registry=registry,
        )
        self._local_faults = Counter(
            "dispatcher_local_faults",
            "The dispatcher's own faults (EMFILE, MemoryError, ...); the rollout was requeued.",
            ("kind",),
            registry=registry,
        )
        self._pool_limit = Gauge(
            "dispatcher_pool_limit",
            "Rollouts allowed in flight across agents (below the setting while own faults last).",
            registry=registry,
        )
        self._concurrency_limit = Gauge(
            "dispatcher_concurrency_limit",
            "An agent's limit of rollouts in flight (adaptive with --concurrency auto).",
            ("agent",),
            registry=registry,
        )

    def _define_runtime_metrics(self) -> None:
        registry = self.registry
        self._capture_wait = Histogram(
            "dispatcher_capture_wait_seconds",
            "Time spent waiting for a rollout's model-call captures to quiesce.",
            buckets=CAPTURE_WAIT_BUCKETS_S,
            registry=registry,
        )
        self._capture_gaps = Counter(
            "dispatcher_capture_gaps",
            "Model-call capture gaps attached to output rows, by gap code.",
            ("code",),
            registry=registry,
        )
        for code in CAPTURE_GAP_CODES:
            self._capture_gaps.labels(code)
        self._start_order_error = PlainHistogram(
            "dispatcher_start_order_estimate_error",
            "How far a rollout's latency was from the start order's estimate: "
            "|ln(actual / expected)| (0.1 is about 10% off).",
            START_ORDER_ERROR_BUCKETS,
        )
        registry.register(self._start_order_error)
        self.loop_lag = Histogram(
            "dispatcher_event_loop_lag_seconds",
            "How late the event loop woke a sleeping sampler task.",
            buckets=LOOP_LAG_BUCKETS_S,
            registry=registry,
        )
        Info("dispatcher_build", "Dispatcher build.", registry=registry).info(
            {"version": __version__, "python": platform.python_version()}
        )

    def start_order_error(self, error: float) -> None:
        # A NaN (or a negative) would spoil the ``_sum`` for good: it is no error to count.
        if error >= 0:
            self._start_order_error.observe(error)

    def declare_agents(self, agents: Iterable[str]) -> None:
        """Create each agent's series at zero so the first increment shows in `rate()`."""
        outcomes = [outcome.value for outcome in Outcome if outcome not in NOT_STARTED]
        for agent in agents:
            self._agent_up.labels(agent).set(1)
            self._series.declare(agent, outcomes)

    def dispatch_started(self) -> None:
        """Mark the start of dispatch: the rate is measured from here."""
        self._rate.start()

    def rollout_started(self, agent: str) -> None:
        self._series.started(agent)

    def rollout_left_agent(self, agent: str) -> None:
        self._series.left_agent(agent)

    def rollout_finished(self, agent: str, outcome: str, duration_s: float) -> None:
        """Count one finished attempt; O(1), called once per rollout."""
        self._series.finished(agent, outcome, duration_s)
        if outcome in self._rate_outcomes:
            self._rate.add()

    def rollout_drained(self) -> None:
        self._drained.inc()

    def declare_replicas(self, agents: Mapping[str, Iterable[str]]) -> None:
        for agent, urls in agents.items():
            # Labels are shown to anyone who can scrape: never a password.
            for name in replica_names(list(urls)):
                self._replica_up.labels(agent, name).set(1)

    def retried(self, agent: str, reason: str) -> None:
        self._retries.labels(agent, reason).inc()

    def replica_up(self, agent: str, replica: str, up: bool) -> None:
        self._replica_up.labels(agent, replica).set(1 if up else 0)

    def agent_up(self, agent: str, up: bool) -> None:
        self._agent_up.labels(agent).set(1 if up else 0)

    def local_fault(self, kind: str) -> None:
        self._local_faults.labels(kind).inc()

    def pool_limit(self, limit: int | None) -> None:
        if limit is not None:
            self._pool_limit.set(limit)

    def concurrency_limit(self, agent: str, limit: int) -> None:
        self._concurrency_limit.labels(agent).set(limit)

    def capture_waited(self, wait_s: float, gaps: Iterable[str]) -> None:
        """Record one row's capture quiescence wait and the gap codes attached to it."""
        self._capture_wait.observe(max(0.0, wait_s))
        for code in gaps:
            self._capture_gaps.labels(code).inc()

    def update(
        self,
        *,
        quantiles: Mapping[float, float | None],
        drain_margin_s: float | None,
        budget_remaining_s: float | None,
        remaining: int | None,
    ) -> None:
        """Set the run-level figures; None (or NaN) leaves a series out of the scrape."""
        figures = self._figures
        known = {q: _known(v) for q, v in quantiles.items()}
        figures.quantiles = {repr(float(q)): v for q, v in known.items() if v is not None}
        figures.drain_margin_s = _known(drain_margin_s)
        figures.budget_remaining_s = _known(budget_remaining_s)
        figures.remaining = remaining

    def rollouts_per_hour(self) -> float:
        return self._rate.per_hour()

    def render(self) -> bytes:
        """The registry in the Prometheus text format (version 0.0.4)."""
        return generate_latest(_WithoutCreated(self.registry))
