"""One quantile everywhere (contracts §8: linear interpolation between the closest
ranks): the tracker, the live window, the report, the stream delays, the loop lag
and Gym's drain margin all give the same figure for the same values."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from dispatcher.client.gym_plan import Durations
from dispatcher.latency.tracker import DispatchLatencyTracker
from dispatcher.ops.report import duration_stats
from dispatcher.serve.metrics import submit_durations
from dispatcher.telemetry.lag import LoopLagMonitor
from dispatcher.telemetry.metrics import Metrics

VALUES = [float(v) for v in (7, 1, 4, 10, 2, 9, 3)]


def tracked(q: float) -> float:
    tracker = DispatchLatencyTracker()
    for value in VALUES:
        tracker.record(value)
    figure = tracker.quantile(q)
    assert figure is not None
    return figure


def test_the_tracker_interpolates_between_the_closest_ranks() -> None:
    # Sorted: 1 2 3 4 7 9 10; p99 sits at rank 5.94, between 9 and 10.
    assert tracked(0.99) == pytest.approx(9.94)
    assert tracked(0.5) == 4.0


def test_the_report_the_stream_delays_and_the_loop_lag_agree_with_it() -> None:
    assert duration_stats(VALUES)["p99"] == pytest.approx(tracked(0.99))
    recorded = submit_durations(CollectorRegistry())
    for value in VALUES:
        recorded.observe(value)
    delays = recorded.quantiles()
    assert delays["p50"] == pytest.approx(tracked(0.5))
    assert delays["p99"] == pytest.approx(tracked(0.99))
    lag = LoopLagMonitor(Metrics(process_metrics=False))
    for value in VALUES:
        lag.observe(value)
    assert lag.p99_s() == pytest.approx(tracked(0.99))


def test_gyms_drain_margin_is_the_same_p75() -> None:
    durations = Durations()
    for value in VALUES:
        durations.add(value)
    assert durations.margin(None) == pytest.approx(tracked(0.75))
