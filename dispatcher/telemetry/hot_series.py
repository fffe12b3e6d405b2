"""The per-rollout series, kept as plain numbers and rendered at each scrape.

Every rollout moves three series: its agent's in-flight gauge (up and down), the
finished count and the duration histogram of its agent and outcome. Through
``prometheus_client``'s metric objects each move takes a lock and checks the
metric's state: at thousands of rollouts a second that was a tenth of what the
dispatcher spent on a row apart from its HTTP call. Here a move is an integer
add on the event loop; ``collect`` reads the numbers when Prometheus scrapes.
The exposition is the one the metric objects gave: the same names, help,
labels, buckets, and no ``_created`` series. ``PlainHistogram`` does the same for a
histogram without labels observed once per rollout (the start order's error).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_go_float: Callable[[float], str] = floatToGoString


class _Finished:
    """One agent and outcome: its finished count, a count per bucket (not cumulative)
    and the sum of its durations."""

    __slots__ = ("count", "counts", "total_s")

    def __init__(self, buckets: int) -> None:
        self.count = 0
        self.counts = [0] * (buckets + 1)  # the last one is +Inf
        self.total_s = 0.0


class RolloutSeries(Collector):
    """``dispatcher_rollouts_total``, ``dispatcher_rollouts_in_flight`` and
    ``dispatcher_rollout_duration_seconds`` of one registry."""

    def __init__(self, buckets_s: Sequence[float]) -> None:
        self._bounds = _finite(buckets_s)
        self._les = _les(self._bounds)
        # By agent, then outcome: two lookups of strings whose hash is kept, where a
        # key (agent, outcome) would be a tuple made and hashed on every rollout.
        self._by_agent: dict[str, dict[str, _Finished]] = {}
        # The counter's series in the order they were declared or first finished;
        # the histogram's in the order they first finished.
        self._finished: dict[tuple[str, str], _Finished] = {}
        self._observed: list[tuple[tuple[str, str], _Finished]] = []
        self._in_flight: dict[str, int] = {}

    def declare(self, agent: str, outcomes: Sequence[str]) -> None:
        """Show the agent's series at zero before its first rollout."""
        self._in_flight.setdefault(agent, 0)
        for outcome in outcomes:
            self._series(agent, outcome)

    def started(self, agent: str) -> None:
        self._in_flight[agent] = self._in_flight.get(agent, 0) + 1

    def left_agent(self, agent: str) -> None:
        self._in_flight[agent] = self._in_flight.get(agent, 0) - 1

    def finished(self, agent: str, outcome: str, duration_s: float) -> None:
        try:
            series = self._by_agent[agent][outcome]
        except KeyError:
            series = self._series(agent, outcome)
        series.count += 1
        if series.count == 1:
            self._observed.append(((agent, outcome), series))
        if not duration_s >= 0:  # also NaN, which would poison the _sum
            return
        series.counts[bisect.bisect_left(self._bounds, duration_s)] += 1
        series.total_s += duration_s

    def _series(self, agent: str, outcome: str) -> _Finished:
        outcomes = self._by_agent.setdefault(agent, {})
        series = outcomes.get(outcome)
        if series is None:
            series = outcomes[outcome] = self._finished[agent, outcome] = _Finished(
                len(self._bounds)
            )
        return series

    def collect(self) -> Iterator[Metric]:
        # Copies first: a scrape from another thread must not see a dict resized.
        finished = [(key, series.count) for key, series in list(self._finished.items())]
        in_flight = dict(self._in_flight)
        durations = [(key, list(s.counts), s.total_s) for key, s in list(self._observed)]
        total = CounterMetricFamily(
            "dispatcher_rollouts",
            "Rollout attempts finished, by agent and outcome class.",
            labels=("agent", "outcome"),
        )
        for labels, count in finished:
            total.add_metric(labels, count)
        yield total
        gauge = GaugeMetricFamily(
            "dispatcher_rollouts_in_flight",
            "Rollouts at agents: admitted and not answered yet (commits not included).",
            labels=("agent",),
        )
        for agent, count in in_flight.items():
            gauge.add_metric((agent,), count)
        yield gauge
        histogram = HistogramMetricFamily(
            "dispatcher_rollout_duration_seconds",
            "Wall time of finished rollout attempts, by agent and outcome class.",
            labels=("agent", "outcome"),
        )
        for labels, counts, total_s in durations:
            histogram.add_metric(labels, _cumulative(self._les, counts), total_s)
        yield histogram


class PlainHistogram(Collector):
    """A histogram without labels, observed on the event loop: what
    ``prometheus_client.Histogram`` renders (name, help, buckets, a NaN counted in no
    bucket but added to the sum), without a lock and a state check per observation."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self._name, self._documentation = name, documentation
        self._bounds = _finite(buckets)
        self._les = _les(self._bounds)
        self._counts = [0] * (len(self._bounds) + 1)  # the last one is +Inf
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._sum += value
        if value == value:  # not NaN
            self._counts[bisect.bisect_left(self._bounds, value)] += 1

    def collect(self) -> Iterator[Metric]:
        histogram = HistogramMetricFamily(self._name, self._documentation)
        histogram.add_metric((), _cumulative(self._les, list(self._counts)), self._sum)
        yield histogram


def _finite(buckets: Sequence[float]) -> list[float]:
    # +Inf is always the last bucket, given or not (as prometheus_client has it).
    return [float(b) for b in buckets if float(b) != math.inf]


def _les(bounds: Sequence[float]) -> list[str]:
    # The ``le`` labels, as prometheus_client writes them (Go's float format).
    return [_go_float(b) for b in bounds] + ["+Inf"]


def _cumulative(les: list[str], counts: list[int]) -> list[tuple[str, int]]:
    cumulative, buckets = 0, []
    for le, count in zip(les, counts, strict=True):
        cumulative += count
        buckets.append((le, cumulative))
    return buckets
