"""DispatchLatencyTracker: every rule of contracts §8."""

from __future__ import annotations

import pytest

from dispatcher.latency.tracker import DispatchLatencyTracker


def tracker_with(*durations: float) -> DispatchLatencyTracker:
    tracker = DispatchLatencyTracker()
    for s in durations:
        tracker.record(s)
    return tracker


def test_record_ignores_non_positive_durations() -> None:
    tracker = tracker_with(0.0, -1.0, -0.001)
    assert tracker.count == 0
    assert tracker.completions == 0
    assert tracker.quantile(0.5) is None
    tracker.record(2.0)
    assert tracker.count == 1
    assert tracker.quantile(0.0) == tracker.quantile(1.0) == 2.0


@pytest.mark.parametrize(
    ("q", "expected"),
    [(0.0, 1.0), (0.25, 1.75), (0.5, 2.5), (0.75, 3.25), (0.9, 3.7), (1.0, 4.0)],
)
def test_quantile_interpolates_linearly(q: float, expected: float) -> None:
    # Recorded out of order: the tracker keeps them sorted itself.
    assert tracker_with(4.0, 1.0, 3.0, 2.0).quantile(q) == pytest.approx(expected)


def test_quantile_of_a_single_value_is_that_value() -> None:
    tracker = tracker_with(7.5)
    assert [tracker.quantile(q) for q in (0.0, 0.5, 0.75, 0.99, 1.0)] == [7.5] * 5


def test_quantile_of_nothing_is_none() -> None:
    tracker = DispatchLatencyTracker()
    assert tracker.quantile(0.5) is None
    assert tracker.quantile(0.75) is None


def test_quantile_rejects_out_of_range_q() -> None:
    with pytest.raises(ValueError):
        tracker_with(1.0).quantile(1.5)


def test_record_failure_without_a_completion_is_ignored() -> None:
    tracker = DispatchLatencyTracker()
    tracker.record_failure(100.0)
    assert tracker.count == 0
    assert tracker.quantile(0.5) is None


def test_record_failure_counts_only_at_or_above_the_median() -> None:
    tracker = tracker_with(1.0, 2.0, 3.0)  # median 2.0
    tracker.record_failure(0.01)  # an instant failure says nothing
    tracker.record_failure(1.99)
    assert tracker.count == 3
    assert tracker.quantile(0.5) == 2.0
    tracker.record_failure(2.0)  # exactly the median counts
    assert tracker.count == 4
    assert tracker.quantile(0.5) == 2.0
    tracker.record_failure(10.0)  # a late failure shows how long tasks can run
    assert tracker.count == 5
    assert tracker.quantile(1.0) == 10.0
    # Failures count as durations, never as completions.
    assert tracker.completions == 3


def test_record_failure_compares_with_the_current_median() -> None:
    tracker = tracker_with(1.0)
    tracker.record_failure(5.0)  # median 1.0 -> counts; median is now 3.0
    assert tracker.quantile(0.5) == 3.0
    tracker.record_failure(2.0)  # below the new median
    assert tracker.count == 2
    tracker.record_failure(3.0)
    assert tracker.count == 3


def test_record_failure_ignores_non_positive_durations() -> None:
    tracker = tracker_with(1.0)
    tracker.record_failure(0.0)
    tracker.record_failure(-3.0)
    assert tracker.count == 1


@pytest.mark.parametrize("configured", [0.0, 0.5, 120.0])
def test_drain_margin_is_the_configured_value_whenever_set(configured: float) -> None:
    assert DispatchLatencyTracker().drain_margin(configured) == configured
    tracker = tracker_with(10.0, 20.0, 30.0, 40.0, 50.0, 60.0)
    assert tracker.drain_margin(configured) == configured


def test_drain_margin_zero_is_not_treated_as_unset() -> None:
    tracker = tracker_with(10.0, 20.0, 30.0, 40.0, 50.0)
    margin = tracker.drain_margin(0.0)
    assert margin == 0.0
    assert margin is not None


def test_drain_margin_is_unknown_until_five_durations() -> None:
    tracker = DispatchLatencyTracker()
    for s in (1.0, 2.0, 3.0, 4.0):
        tracker.record(s)
        assert tracker.drain_margin(None) is None
    tracker.record(5.0)
    assert tracker.drain_margin(None) == pytest.approx(4.0)  # p75 of 1..5


def test_drain_margin_counts_failures_that_counted() -> None:
    tracker = tracker_with(1.0, 2.0, 3.0, 4.0)
    tracker.record_failure(0.5)  # below the median: not a duration
    assert tracker.drain_margin(None) is None
    tracker.record_failure(9.0)
    assert tracker.count == 5
    assert tracker.drain_margin(None) == pytest.approx(4.0)  # p75 of 1,2,3,4,9


def test_drain_margin_follows_the_live_p75() -> None:
    tracker = tracker_with(1.0, 2.0, 3.0, 4.0, 5.0)
    tracker.record(100.0)
    # p75 of 1,2,3,4,5,100: pos 3.75 -> 4 + 0.75 * (5 - 4)
    assert tracker.drain_margin(None) == pytest.approx(4.75)


def test_drained_count() -> None:
    tracker = DispatchLatencyTracker()
    assert tracker.drained == 0
    for _ in range(3):
        tracker.record_drained()
    assert tracker.drained == 3
    # Drained rows are not durations.
    assert tracker.count == 0
    assert tracker.drain_margin(None) is None


def test_summary_figures() -> None:
    tracker = tracker_with(*[float(s) for s in range(1, 101)])
    tracker.record_drained()
    tracker.record_drained()
    summary = tracker.summary()
    assert summary["median_s"] == pytest.approx(50.5)
    assert summary["p90_s"] == pytest.approx(90.1)
    assert summary["p99_s"] == pytest.approx(99.01)
    assert summary["max_s"] == 100.0
    assert summary["task_hours_delivered"] == pytest.approx(sum(range(1, 101)) / 3600.0)
    assert summary["drained"] == 2
    note = summary["drained_note"]
    assert "2" in note
    assert "wrote nothing" in note
    assert "resume" in note


def test_summary_task_hours_count_completions_only() -> None:
    tracker = tracker_with(1800.0, 1800.0)
    tracker.record_failure(3600.0)
    assert tracker.summary()["task_hours_delivered"] == pytest.approx(1.0)
    assert tracker.summary()["max_s"] == 3600.0


def test_summary_of_an_empty_tracker() -> None:
    summary = DispatchLatencyTracker().summary()
    assert summary["median_s"] is None
    assert summary["p90_s"] is None
    assert summary["p99_s"] is None
    assert summary["max_s"] is None
    assert summary["task_hours_delivered"] == 0.0
    assert summary["drained"] == 0
    assert "drained_note" not in summary


def test_many_records_stay_exact() -> None:
    tracker = DispatchLatencyTracker()
    n = 200_000
    for i in range(n, 0, -1):
        tracker.record(float(i))
    assert tracker.count == n
    assert tracker.quantile(0.5) == pytest.approx((n + 1) / 2)
    assert tracker.quantile(0.75) == pytest.approx(1 + 0.75 * (n - 1))


@pytest.mark.parametrize("batch", [1, 300, 20_000])
def test_records_joined_in_batches_of_any_size_stay_sorted(batch: int) -> None:
    # Small batches join by insertion, large ones by sorting the whole again.
    tracker = DispatchLatencyTracker()
    values = [float((i * 7919) % 100_003 + 1) for i in range(60_000)]
    highest = 0.0
    for start in range(0, len(values), batch):
        for value in values[start : start + batch]:
            tracker.record(value)
            highest = max(highest, value)
        assert tracker.quantile(1.0) == highest
    ordered = sorted(values)
    assert list(tracker._durations) == ordered
    assert tracker.quantile(0.5) == pytest.approx((ordered[29_999] + ordered[30_000]) / 2)
