"""The per-rollout series, kept as plain numbers and rendered at each scrape.

Every rollout moves three series: its agent's in-flight gauge (up and down), the
finished count and the duration histogram of its agent and outcome. Through
``prometheus_client``'s metric objects each move takes a lock and checks the
metric's state: at thousands of rollouts a second that was a tenth of what the
dispatcher spent on a row apart from its HTTP call. Here a move is an integer
add on the event loop; ``collect`` reads the numbers when Prometheus scrapes.
The exposition is the one the metric objects gave: the same names, help,
labels, buckets, and no ``_created`` series.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector


class _Durations:
    """One label set's histogram: a count per bucket (not cumulative) and the sum."""

    __slots__ = ("counts", "total_s")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * (buckets + 1)  # the last one is +Inf
        self.total_s = 0.0


class RolloutSeries(Collector):
    """``dispatcher_rollouts_total``, ``dispatcher_rollouts_in_flight`` and
    ``dispatcher_rollout_duration_seconds`` of one registry."""

    def __init__(self, buckets_s: Sequence[float]) -> None:
        self._bounds = list(buckets_s)
        # Go's float format, as prometheus_client writes ``le`` (for these bounds).
        self._les = [repr(float(b)) for b in self._bounds] + ["+Inf"]
        self._finished: dict[tuple[str, str], int] = {}
        self._durations: dict[tuple[str, str], _Durations] = {}
        self._in_flight: dict[str, int] = {}

    def declare(self, agent: str, outcomes: Sequence[str]) -> None:
        """Show the agent's series at zero before its first rollout."""
        self._in_flight.setdefault(agent, 0)
        for outcome in outcomes:
            self._finished.setdefault((agent, outcome), 0)

    def started(self, agent: str) -> None:
        self._in_flight[agent] = self._in_flight.get(agent, 0) + 1

    def left_agent(self, agent: str) -> None:
        self._in_flight[agent] = self._in_flight.get(agent, 0) - 1

    def finished(self, agent: str, outcome: str, duration_s: float) -> None:
        key = (agent, outcome)
        self._finished[key] = self._finished.get(key, 0) + 1
        durations = self._durations.get(key)
        if durations is None:
            durations = self._durations[key] = _Durations(len(self._bounds))
        if not duration_s >= 0:  # also NaN, which would poison the _sum
            return
        durations.counts[bisect.bisect_left(self._bounds, duration_s)] += 1
        durations.total_s += duration_s

    def collect(self) -> Iterator[Metric]:
        # Copies first: a scrape from another thread must not see a dict resized.
        finished = dict(self._finished)
        in_flight = dict(self._in_flight)
        durations = [(key, list(d.counts), d.total_s) for key, d in dict(self._durations).items()]
        total = CounterMetricFamily(
            "dispatcher_rollouts",
            "Rollout attempts finished, by agent and outcome class.",
            labels=("agent", "outcome"),
        )
        for (agent, outcome), count in finished.items():
            total.add_metric((agent, outcome), count)
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
        for (agent, outcome), counts, total_s in durations:
            cumulative, buckets = 0, []
            for le, count in zip(self._les, counts, strict=True):
                cumulative += count
                buckets.append((le, cumulative))
            histogram.add_metric((agent, outcome), buckets, total_s)
        yield histogram
