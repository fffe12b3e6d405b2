"""The daemon-wide live latency view: bounded memory, stated error (issue 10).

Each job keeps its exact ``DispatchLatencyTracker`` (contracts §8) for its own
summary. A daemon that lives for days cannot: the exact tracker grows with
every record. ``LatencyWindow`` is what the daemon's live view (drain margin
across jobs, ``/status``, metrics) reads instead.

Two bounds, each stated:

* Value error. Durations fall into log-spaced buckets (the DDSketch mapping):
  bucket ``k`` holds ``(γ^(k-1), γ^k]`` with ``γ = (1 + α) / (1 - α)`` and is
  read back as ``2γ^k / (γ + 1)``, so any rank's value comes back within a
  relative error ``α`` (1 % by default) of the exact one. ``quantile`` uses the
  tracker's rule (linear interpolation between the two nearest ranks), and a
  convex combination of two values each within ``α`` is itself within ``α`` of
  the exact interpolation. Durations outside ``[min_s, max_s]`` are clamped to
  the edge buckets (an absolute error below ``min_s`` at the low end).
* Memory and time. The window is a ring of ``sub_windows`` sub-windows of
  ``sub_window_s`` each (10 × 60 s by default); a sub-window older than the
  ring is forgotten as a whole, so the view covers the last
  ``(sub_windows - 1) × sub_window_s`` to ``sub_windows × sub_window_s``
  seconds. Each sub-window is a sparse map of at most ``bucket_count`` buckets
  and the live total is one Fenwick tree over the buckets: memory is
  O(buckets × sub-windows) whatever the record count, a record is O(log
  buckets) and a quantile is O(log buckets).

Pure bookkeeping, no I/O; time comes from an injected clock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from dispatcher.latency.quantile import quantile_at
from dispatcher.latency.tracker import DRAIN_MARGIN_QUANTILE, MIN_DURATIONS_FOR_MARGIN

DEFAULT_RELATIVE_ERROR = 0.01
DEFAULT_SUB_WINDOW_S = 60.0
DEFAULT_SUB_WINDOWS = 10
# 1 ms to ~11.6 days: about 1,040 buckets at 1 %. A rollout outside this range
# is clamped rather than allowed to widen the structure.
DEFAULT_MIN_S = 1e-3
DEFAULT_MAX_S = 1e6


class LogBuckets:
    """The value ↔ bucket mapping: relative error ``alpha`` within ``[min_s, max_s]``."""

    __slots__ = ("_lowest_key", "_scale", "alpha", "count", "gamma", "max_s", "min_s")

    def __init__(
        self,
        alpha: float = DEFAULT_RELATIVE_ERROR,
        min_s: float = DEFAULT_MIN_S,
        max_s: float = DEFAULT_MAX_S,
    ) -> None:
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"relative error must be within (0, 1), got {alpha}")
        if not 0.0 < min_s < max_s:
            raise ValueError(f"need 0 < min_s < max_s, got {min_s}, {max_s}")
        self.alpha, self.min_s, self.max_s = alpha, min_s, max_s
        self.gamma = (1.0 + alpha) / (1.0 - alpha)
        # Computed once: ``index`` runs on every record.
        self._scale = 1.0 / math.log(self.gamma)
        self._lowest_key = math.ceil(math.log(min_s) * self._scale)
        #: How many buckets the range needs (the structure's width).
        self.count = math.ceil(math.log(max_s) * self._scale) - self._lowest_key + 1

    def index(self, duration_s: float) -> int:
        """The 0-based bucket of a positive duration, clamped into range."""
        key = math.ceil(math.log(duration_s) * self._scale) - self._lowest_key
        return 0 if key < 0 else min(key, self.count - 1)

    def value(self, index: int) -> float:
        """The value a bucket reads back as: within ``alpha`` of anything it holds."""
        gamma = self.gamma
        return 2.0 * gamma ** (index + self._lowest_key) / (gamma + 1.0)


class _Fenwick:
    """Counts per bucket with O(log n) add, prefix search and total."""

    def __init__(self, size: int) -> None:
        self._tree = [0] * (size + 1)
        self._top_bit = 1 << (size.bit_length() - 1) if size else 0
        self.total = 0

    def add(self, index: int, delta: int) -> None:
        self.total += delta
        tree = self._tree
        i = index + 1
        size = len(tree)
        while i < size:
            tree[i] += delta
            i += i & -i

    def find(self, rank: int) -> int:
        """The 0-based bucket holding the ``rank``-th smallest value (0-based)."""
        tree = self._tree
        pos = 0
        step = self._top_bit
        while step:
            nxt = pos + step
            if nxt < len(tree) and tree[nxt] <= rank:
                pos = nxt
                rank -= tree[nxt]
            step >>= 1
        return pos


@dataclass
class _SubWindow:
    epoch: int = -1
    completions: int = 0
    # Sparse: only the buckets this sub-window saw, so an idle one costs nothing.
    counts: dict[int, int] | None = None


@dataclass(frozen=True)
class LiveLatency:
    """What ``/status`` and the metrics show of the live view."""

    window_s: float
    relative_error: float
    count: int
    completions: int
    p50_s: float | None
    p75_s: float | None
    p90_s: float | None
    p99_s: float | None


class LatencyWindow:
    """Rollout durations over a sliding time window, in bounded memory (see module doc)."""

    def __init__(
        self,
        *,
        buckets: LogBuckets | None = None,
        sub_window_s: float = DEFAULT_SUB_WINDOW_S,
        sub_windows: int = DEFAULT_SUB_WINDOWS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if sub_window_s <= 0 or sub_windows < 1:
            raise ValueError("need sub_window_s > 0 and at least one sub-window")
        self.buckets = buckets or LogBuckets()
        self._sub_window_s = sub_window_s
        self._ring = [_SubWindow() for _ in range(sub_windows)]
        self._clock = clock
        self._live = _Fenwick(self.buckets.count)
        self._completions = 0
        self._epoch: int | None = None
        # Rollouts not started for lack of time, since the daemon started.
        self.drained = 0

    @property
    def window_s(self) -> float:
        """The longest span of history the view covers."""
        return self._sub_window_s * len(self._ring)

    @property
    def count(self) -> int:
        """Durations in the window (completions plus failures that counted)."""
        self._advance()
        return self._live.total

    @property
    def completions(self) -> int:
        """Completions in the window."""
        self._advance()
        return self._completions

    def record(self, duration_s: float) -> None:
        """Record a completed rollout; non-positive durations are ignored."""
        if duration_s <= 0:
            return
        self._add(duration_s, completion=True)

    def record_drained(self) -> None:
        self.drained += 1

    def record_failure(self, duration_s: float) -> None:
        """Record a failed attempt under the tracker's rule (§8), within the window.

        It counts only when a completion is in the window and it lasted at
        least the window's median: an instant failure says nothing about task
        length and must not drag the p75 down.
        """
        if duration_s <= 0 or self.completions == 0:
            return
        median = self.quantile(0.5)
        if median is not None and duration_s >= median:
            self._add(duration_s, completion=False)

    def quantile(self, q: float) -> float | None:
        """The q-quantile (tracker's interpolation), within ``alpha``; None if empty."""
        self._advance()
        return quantile_at(self._value_at, self._live.total, q)

    def drain_margin(self, configured_s: float | None) -> float | None:
        """The configured margin whenever set (0.0 included), else the window's p75 once known."""
        if configured_s is not None:
            return configured_s
        if self.count < MIN_DURATIONS_FOR_MARGIN:
            return None
        return self.quantile(DRAIN_MARGIN_QUANTILE)

    def snapshot(self) -> LiveLatency:
        """The live figures in one value, for ``/status`` and the metrics."""
        return LiveLatency(
            window_s=self.window_s,
            relative_error=self.buckets.alpha,
            count=self.count,
            completions=self._completions,
            p50_s=self.quantile(0.5),
            p75_s=self.quantile(0.75),
            p90_s=self.quantile(0.9),
            p99_s=self.quantile(0.99),
        )

    def _value_at(self, rank: int) -> float:
        return self.buckets.value(self._live.find(rank))

    def _add(self, duration_s: float, *, completion: bool) -> None:
        current = self._current()
        index = self.buckets.index(duration_s)
        assert current.counts is not None
        current.counts[index] = current.counts.get(index, 0) + 1
        self._live.add(index, 1)
        if completion:
            current.completions += 1
            self._completions += 1

    def _current(self) -> _SubWindow:
        epoch = self._advance()
        sub = self._ring[epoch % len(self._ring)]
        if sub.counts is None:
            sub.epoch, sub.counts = epoch, {}
        return sub

    def _advance(self) -> int:
        """Forget every sub-window that has left the ring; returns the current epoch."""
        epoch = math.floor(self._clock() / self._sub_window_s)
        if self._epoch is not None and epoch <= self._epoch:
            # A clock that steps back (never the monotonic one) keeps the newest epoch.
            return self._epoch
        self._epoch = epoch
        for sub in self._ring:
            if sub.counts is not None and sub.epoch <= epoch - len(self._ring):
                self._forget(sub)
        return epoch

    def _forget(self, sub: _SubWindow) -> None:
        assert sub.counts is not None
        for index, count in sub.counts.items():
            self._live.add(index, -count)
        self._completions -= sub.completions
        sub.epoch, sub.completions, sub.counts = -1, 0, None
