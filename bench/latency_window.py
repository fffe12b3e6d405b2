"""The daemon-wide live latency view against the exact per-job tracker.

In one run, on the same pre-drawn lognormal durations:
  * ``DispatchLatencyTracker`` (exact, grows with every record),
  * ``LatencyWindow`` (1 % relative error, 10 × 60 s window, bounded).
For each: the time to record ``--records`` durations, the time of one
``quantile(0.75)`` (the drain margin's read) at that size, and the bytes the
structure holds afterwards (tracemalloc, in a separate pass so tracing does
not slow the timed one). Timed passes use the real monotonic clock; the
memory pass spreads the records over the whole window with a fake clock, so
every sub-window is full (the window's worst case). Medians of ``--repeat``.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median

from dispatcher.latency.tracker import DispatchLatencyTracker
from dispatcher.latency.window import LatencyWindow

QUANTILE_READS = 2_000


class Live(Protocol):
    def record(self, duration_s: float) -> None: ...
    def quantile(self, q: float) -> float | None: ...


def timed(build: Callable[[], Live], values: list[float]) -> tuple[float, float]:
    """Seconds to record every value; microseconds per quantile read at that size."""
    live = build()
    gc.collect()
    started = time.perf_counter()
    for s in values:
        live.record(s)
    record_s = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(QUANTILE_READS):
        live.quantile(0.75)
    return record_s, (time.perf_counter() - started) / QUANTILE_READS * 1e6


def held_bytes(build: Callable[[], Live], values: list[float], advance: Callable[[], None]) -> int:
    """Bytes allocated and still held by the structure after every record."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    live = build()
    for s in values:
        advance()
        live.record(s)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del live
    return held


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    opts = parser.parse_args()
    if opts.smoke:
        opts.records, opts.repeat = 100_000, 1
    rng = random.Random(1)
    values = [rng.lognormvariate(3.0, 1.0) for _ in range(opts.records)]
    now = [0.0]
    step_s = 600.0 / opts.records

    def advance() -> None:
        now[0] += step_s

    builders: dict[str, tuple[Callable[[], Live], Callable[[], Live]]] = {
        "DispatchLatencyTracker": (DispatchLatencyTracker, DispatchLatencyTracker),
        "LatencyWindow": (LatencyWindow, lambda: LatencyWindow(clock=lambda: now[0])),
    }
    print(f"live latency view: {opts.records:,} records, median of {opts.repeat}")
    for name, (for_time, for_memory) in builders.items():
        runs = [timed(for_time, values) for _ in range(opts.repeat)]
        now[0] = 0.0
        held = [held_bytes(for_memory, values, advance) for _ in range(opts.repeat)]
        record_s = median([r[0] for r in runs])
        quantile_us = median([r[1] for r in runs])
        print(
            f"  {name:<24} record {record_s:6.2f} s   quantile(0.75) {quantile_us:7.2f} µs"
            f"   held {median(held) / 1e6:7.2f} MB"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
