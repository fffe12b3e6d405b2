"""LatencyWindow: the tracker's rules over a sliding window, within the stated error."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable

import pytest

from dispatcher.latency.tracker import DispatchLatencyTracker
from dispatcher.latency.window import LatencyWindow, LogBuckets
from dispatcher.run.views import LatencyView

ALPHA = 0.01
# Float rounding at a bucket's edge may land a value one bucket over.
TOLERANCE = ALPHA * (1 + 1e-9)
QUANTILES = (0.0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 0.999, 1.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def window(clock: FakeClock | None = None, **kwargs: float) -> LatencyWindow:
    return LatencyWindow(
        buckets=LogBuckets(alpha=ALPHA),
        sub_window_s=kwargs.get("sub_window_s", 60.0),
        sub_windows=int(kwargs.get("sub_windows", 10)),
        clock=clock or FakeClock(),
    )


def assert_close(estimate: float | None, exact: float | None) -> None:
    assert estimate is not None and exact is not None
    assert abs(estimate - exact) <= TOLERANCE * exact, (estimate, exact)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("shape", ["lognormal", "uniform", "pareto"])
def test_quantiles_are_within_the_stated_relative_error(seed: int, shape: str) -> None:
    rng = random.Random(seed)
    draw: Callable[[], float] = {
        "lognormal": lambda: rng.lognormvariate(3.0, 1.5),
        "uniform": lambda: rng.uniform(0.01, 600.0),
        "pareto": lambda: rng.paretovariate(1.2),
    }[shape]
    live, exact = window(), DispatchLatencyTracker()
    for _ in range(rng.randrange(1, 5_000)):
        s = draw()
        live.record(s)
        exact.record(s)
    assert live.count == exact.count
    for q in QUANTILES:
        assert_close(live.quantile(q), exact.quantile(q))


def test_every_bucket_reads_back_within_alpha_of_what_it_holds() -> None:
    buckets = LogBuckets(alpha=ALPHA)
    rng = random.Random(7)
    for _ in range(10_000):
        s = 10 ** rng.uniform(-3, 6)
        assert_close(buckets.value(buckets.index(s)), s)


def test_out_of_range_durations_are_clamped_to_the_edge_buckets() -> None:
    buckets = LogBuckets(alpha=ALPHA, min_s=1e-3, max_s=1e6)
    assert buckets.index(1e-9) == 0
    assert buckets.index(1e12) == buckets.count - 1
    assert buckets.value(0) <= 1e-3 * (1 + ALPHA)


def test_non_positive_durations_are_ignored() -> None:
    live = window()
    for s in (0.0, -1.0):
        live.record(s)
        live.record_failure(s)
    assert live.count == 0
    assert live.quantile(0.5) is None


def test_quantile_rejects_out_of_range_q() -> None:
    live = window()
    live.record(1.0)
    with pytest.raises(ValueError):
        live.quantile(1.5)


def test_quantile_of_nothing_and_of_one_value() -> None:
    live = window()
    assert live.quantile(0.75) is None
    live.record(7.5)
    for q in (0.0, 0.5, 1.0):
        assert_close(live.quantile(q), 7.5)


def test_failure_needs_a_completion_and_at_least_the_median() -> None:
    live, exact = window(), DispatchLatencyTracker()
    for t in (live, exact):
        t.record_failure(100.0)  # no completion yet: says nothing
    assert live.count == exact.count == 0
    for s in (10.0, 20.0, 30.0):
        live.record(s)
        exact.record(s)
    for s in (0.5, 19.0, 25.0, 300.0):  # instant and short ones must not count
        live.record_failure(s)
        exact.record_failure(s)
    assert live.count == exact.count == 5
    assert live.completions == exact.completions == 3
    assert_close(live.quantile(0.75), exact.quantile(0.75))


def test_drain_margin_follows_the_tracker() -> None:
    live, exact = window(), DispatchLatencyTracker()
    assert live.drain_margin(0.0) == 0.0
    assert live.drain_margin(12.5) == 12.5
    for s in (1.0, 2.0, 3.0, 4.0):
        live.record(s)
        exact.record(s)
        assert live.drain_margin(None) is None
    live.record(5.0)
    exact.record(5.0)
    assert_close(live.drain_margin(None), exact.drain_margin(None))
    assert live.drain_margin(0.0) == 0.0


def test_old_sub_windows_are_forgotten() -> None:
    clock = FakeClock()
    live = window(clock, sub_window_s=60.0, sub_windows=10)
    clock.now = 6_000.0  # the start of a sub-window
    for _ in range(100):
        live.record(100.0)
    clock.now += 60.0
    for _ in range(100):
        live.record(1.0)
    assert live.count == 200
    clock.now += 8 * 60.0  # the first sub-window is still the oldest of ten
    assert live.count == 200
    clock.now += 60.0
    assert live.count == 100
    assert live.completions == 100
    assert_close(live.quantile(1.0), 1.0)
    clock.now += 60.0
    assert live.count == 0
    assert live.quantile(0.5) is None
    assert live.drain_margin(None) is None


def test_a_long_idle_gap_forgets_everything_at_once() -> None:
    clock = FakeClock()
    live = window(clock)
    for s in (1.0, 2.0, 3.0):
        live.record(s)
    clock.now += 1e6
    assert live.count == 0
    live.record(4.0)
    assert live.count == 1
    assert_close(live.quantile(0.5), 4.0)


def test_a_failure_counts_against_the_window_not_forgotten_completions() -> None:
    clock = FakeClock()
    live = window(clock, sub_windows=2)
    live.record(1.0)
    clock.now += 200.0
    live.record_failure(50.0)
    assert live.count == 0


def test_a_clock_that_steps_back_keeps_the_newest_window() -> None:
    clock = FakeClock()
    live = window(clock)
    live.record(1.0)
    clock.now -= 3_600.0
    live.record(2.0)
    assert live.count == 2


def test_it_is_the_latency_view_the_daemon_holds() -> None:
    live: LatencyView = window()  # checked by mypy against the daemon's protocol
    live.record_drained()
    live.record_drained()
    assert isinstance(live, LatencyWindow) and live.drained == 2
    assert live.quantile(0.5) is None  # a drained row is no duration


def test_snapshot_shows_the_live_figures() -> None:
    live = window()
    for s in range(1, 101):
        live.record(float(s))
    snap = live.snapshot()
    assert snap.count == snap.completions == 100
    assert snap.window_s == 600.0
    assert snap.relative_error == ALPHA
    assert_close(snap.p50_s, 50.5)
    assert_close(snap.p99_s, 99.01)


def deep_size(obj: object, seen: set[int] | None = None) -> int:
    """Bytes held by ``obj`` and everything it references (containers and attributes)."""
    seen = seen if seen is not None else set()
    if id(obj) in seen or callable(obj) or isinstance(obj, type):
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in obj.items())
    elif isinstance(obj, list | tuple | set):
        size += sum(deep_size(item, seen) for item in obj)
    for slot in getattr(type(obj), "__slots__", ()):
        size += deep_size(getattr(obj, slot, None), seen)
    if hasattr(obj, "__dict__"):
        size += deep_size(vars(obj), seen)
    return size


def test_memory_does_not_grow_with_the_record_count() -> None:
    clock = FakeClock()
    live = window(clock)
    rng = random.Random(3)
    values = [rng.lognormvariate(2.0, 2.0) for _ in range(10_000)]

    def feed(count: int) -> None:
        # Every sub-window of the ring sees the whole spread of values.
        for i in range(count):
            clock.now += 600.0 / count
            live.record(values[i % len(values)])

    feed(250_000)
    after_first = deep_size(live)
    feed(250_000)
    after_second = deep_size(live)
    assert live.count > 225_000
    # Past a few hundred per bucket every count is a same-sized int: the bytes
    # held stay put while another quarter of a million records go through.
    assert after_second <= after_first * 1.01
    # O(buckets × sub-windows): each bucket costs at most a dict slot and two ints.
    assert after_second < 200 * live.buckets.count * 10
