"""Event-loop lag: how late the loop wakes a task that asked to sleep.

Anything that blocks the loop (a big JSON dump, an fsync, a directory scan)
delays every rollout's I/O by the same amount; this is the one figure that
shows it. The sampler sleeps `interval_s` in a loop and records the overshoot.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from dispatcher.aio import cancel_and_wait
from dispatcher.latency.quantile import quantile
from dispatcher.telemetry.metrics import Metrics


class LoopLagMonitor:
    """Samples the running loop's lag into `Metrics.loop_lag` and a recent window."""

    def __init__(self, metrics: Metrics, interval_s: float = 0.1, *, window: int = 3000) -> None:
        if not interval_s > 0:
            raise ValueError(f"lag sampling interval must be positive, got {interval_s!r}")
        self._histogram = metrics.loop_lag
        self._interval_s = interval_s
        # The last `window` samples (5 minutes at 0.1 s): p99 sorts them on
        # request, which only status reads and summaries do.
        self._recent: deque[float] = deque(maxlen=window)
        self._max_s: float | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Sample in a task of its own until ``stop`` (for owners without a task group)."""
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="loop-lag-monitor")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    @property
    def samples(self) -> int:
        """Samples in the recent window."""
        return len(self._recent)

    def p99_s(self) -> float | None:
        """99th percentile of the recent samples (``latency.quantile``); None before the first."""
        return quantile(sorted(self._recent), 0.99)

    def max_s(self) -> float | None:
        """Largest lag seen since the monitor started."""
        return self._max_s

    def observe(self, lag_s: float) -> None:
        self._histogram.observe(lag_s)
        self._recent.append(lag_s)
        if self._max_s is None or lag_s > self._max_s:
            self._max_s = lag_s

    async def run(self) -> None:
        """Sample until cancelled: the body of the owner's task."""
        interval_s = self._interval_s
        while True:
            # perf_counter, not loop.time(): uvloop's clock ticks in whole
            # milliseconds, which would round every sample to 0 or 1 ms.
            asked_at = time.perf_counter()
            await asyncio.sleep(interval_s)
            # The loop may fire a timer up to its clock resolution early.
            self.observe(max(0.0, time.perf_counter() - asked_at - interval_s))
