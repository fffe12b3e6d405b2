"""``ops.timeline``: attempts binned by finish time, the mean in flight exact, bins bounded."""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any

import pytest

from dispatcher.files.resume import OutputPaths
from dispatcher.latency.quantile import quantile
from dispatcher.ops.attempts import Attempts
from dispatcher.ops.report import build_report, render_report
from dispatcher.ops.timeline import MAX_TEXT_BINS, build_timeline, choose_bins
from tests.ops.test_report import T0, fail, ident, ok, write_jsonl


def attempt(start: float, duration: float, outcome: str = "success", **where: str) -> Attempts:
    return add(Attempts(), start, duration, outcome, **where)


def add(
    attempts: Attempts,
    start: float,
    duration: float,
    outcome: str = "success",
    agent: str = "a",
    replica: str = "http://r1",
) -> Attempts:
    row: dict[str, Any] = {
        "agent_ref": {"name": agent},
        "_ng_dispatch": {"started_at": T0 + start, "duration_s": duration, "replica": replica},
    }
    attempts.add(row, outcome)
    return attempts


def brute_in_flight(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """The mean number of spans covering [lo, hi), summed overlap by overlap."""
    covered = sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in spans)
    return covered / (hi - lo)


def test_mean_in_flight_is_exact_in_a_small_case() -> None:
    attempts = add(attempt(0, 10), 5, 20)  # [0, 10) and [5, 25), bins of 10 s from T0
    timeline = build_timeline(attempts, 10.0, 100)
    assert timeline.bins is not None and timeline.whole is not None
    assert (timeline.bins.t0, timeline.bins.count) == (T0, 3)
    # [0,10): 1 + 0.5; [10,20): 1; [20,25): 1 (the last bin ends at the last finish).
    assert timeline.whole.in_flight == pytest.approx([1.5, 1.0, 1.0])
    assert timeline.whole.finished == [0, 1, 1]


def test_mean_in_flight_matches_a_brute_force_sum_on_random_attempts() -> None:
    rng = random.Random(7)
    attempts = Attempts()
    spans = []
    for _ in range(400):
        start, duration = rng.uniform(3, 600), rng.expovariate(1 / 40)
        add(attempts, start, duration)
        spans.append((T0 + start, T0 + start + duration))
    timeline = build_timeline(attempts, 30.0, 100)
    bins, whole = timeline.bins, timeline.whole
    assert bins is not None and whole is not None
    # The pictures' whole run is the sum of its agents' tallies: the same figures.
    assert build_timeline(attempts, 30.0, 100, per_group=True).whole == whole
    for i, mean in enumerate(whole.in_flight):
        lo, hi = bins.t0 + bins.edge(i), bins.t0 + bins.edge(i + 1)
        assert mean == pytest.approx(brute_in_flight(spans, lo, hi), rel=1e-6, abs=1e-6)
    # A bin's percentiles are those of the attempts that finished in it.
    ends = sorted((e, e - s) for s, e in spans)
    first_bin = sorted(d for e, d in ends if e < bins.t0 + bins.width_s)
    assert whole.p50_s[0] == pytest.approx(statistics.median(first_bin))
    assert whole.p95_s[0] == pytest.approx(quantile(first_bin, 0.95))


def test_failures_by_class_per_agent_and_replica() -> None:
    attempts = attempt(0, 1)
    add(attempts, 0, 2, "timeout_exceeded", agent="b", replica="http://r2")
    add(attempts, 61, 1, "agent_run_error", agent="b", replica="http://r2")
    add(attempts, 62, 1)
    timeline = build_timeline(attempts, 60.0, 100, per_group=True)
    whole = timeline.whole
    assert whole is not None
    assert whole.finished == [2, 2]
    assert whole.succeeded == [1, 1]
    assert whole.failed == {"timeout_exceeded": [1, 0], "agent_run_error": [0, 1]}
    assert set(timeline.agents) == {"a", "b"}
    assert timeline.agents["b"].failed == whole.failed
    assert timeline.replicas["http://r1"].finished == [1, 1]


def test_bins_widen_in_round_steps_to_stay_bounded() -> None:
    hour = 1_699_999_200.0  # a whole hour: bins start on the minute
    two_hours = choose_bins(hour, hour + 7199, 60.0, MAX_TEXT_BINS)
    assert (two_hours.t0, two_hours.width_s, two_hours.count) == (hour, 120.0, 60)
    # Two hours from T0 (13:20 past the hour) cross 61 bins of 2 minutes: 5-minute ones.
    unaligned = choose_bins(T0, T0 + 7200, 60.0, MAX_TEXT_BINS)
    assert (unaligned.width_s, unaligned.count) == (300.0, 25)
    assert unaligned.t0 % 300 == 0
    thirty_days = choose_bins(T0, T0 + 30 * 86400, 60.0, MAX_TEXT_BINS)
    assert thirty_days.count <= MAX_TEXT_BINS and thirty_days.width_s % 86400 == 0
    short = choose_bins(T0 + 0.5, T0 + 3.2, 1.0, 100)
    assert (short.width_s, short.count) == (1.0, 4)


def test_untimed_attempts_are_counted_not_binned() -> None:
    attempts = attempt(0, 1)
    attempts.add({"agent_ref": {"name": "a"}}, "success")
    timeline = build_timeline(attempts, 60.0, 100)
    assert timeline.untimed == 1
    assert timeline.whole is not None and sum(timeline.whole.finished) == 1
    nothing = build_timeline(Attempts(), 60.0, 100)
    assert nothing.bins is None and nothing.whole is None


def test_report_has_a_per_minute_timeline_capped_in_length(tmp_path: Path) -> None:
    paths = OutputPaths.for_output(tmp_path / "long.jsonl")
    # Four hours: one success a minute and a failure every 10 minutes.
    minutes = 240
    write_jsonl(paths.materialized, [ident(t, 0, "math") for t in range(minutes)])
    write_jsonl(paths.output, [ok(t, 0, "math", 1, 60 * t + 1, 5.0) for t in range(minutes)])
    failures = [fail(t, 0, "math", "agent_run_error", 60 * t + 2, 1.0) for t in range(0, 240, 10)]
    write_jsonl(paths.failures, failures)
    report = build_report(paths.output, None, None)
    timeline = report["timeline"]
    assert timeline["bin_s"] == 300.0  # 240 minutes in 60 lines at most: 5-minute bins
    assert len(timeline["bins"]) == 49  # T0 is 13:20 past the hour: 48 bins and a bit
    assert sum(b["finished"] for b in timeline["bins"]) == minutes + len(failures)
    assert sum(b["failed"].get("agent_run_error", 0) for b in timeline["bins"]) == len(failures)
    text = render_report(report)
    assert "per 5 min of finish time" in text
    assert "agent_run_error" in text.split("timeline from")[1]
    lines = text.split("timeline from")[1].split("\n\n")[0].splitlines()
    assert len(lines) == 2 + 49  # its heading, the columns' and one line a bin
    # 22:10 to 02:10 UTC: past midnight, a bin's start says its date too.
    assert lines[2].split()[:2] == ["2023-11-14", "22:10:00"]
    minute = build_report(paths.output, None, None, bin_s=60.0)["timeline"]["bin_s"]
    assert minute == 300.0  # --bin-s 60 still keeps the table to 60 lines
