"""A run over time: attempts binned by when they finished, for ``report`` and its pictures.

Each bin counts the attempts that finished in it (succeeded, failed by class),
their duration p50/p95, and the mean number in flight over the bin. The mean
is exact and costs one pass: the time integral of "in flight" up to ``e`` is
``sum(e - start) - sum(e - finish)`` over the starts and finishes before
``e``, so per-bin counts and sums of starts and finishes are enough; no
attempt is ever walked across the bins it spans.

Bins are aligned to the wall clock (a minute bin starts at :00) and widen in
round steps so a long run keeps a bounded number of them: the text table at
most ``MAX_TEXT_BINS`` lines, the pictures at most ``MAX_PICTURE_BINS`` points.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from dispatcher.latency.quantile import quantile
from dispatcher.ops.attempts import FAILURE, Attempts
from dispatcher.ops.table import format_table, utc_time

TEXT_BIN_S = 60.0
MAX_TEXT_BINS = 60
MAX_PICTURE_BINS = 150
# Round widths, in seconds; past a day, whole days.
_ROUND_WIDTHS_S: tuple[int, ...] = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800)
_ROUND_WIDTHS_S += (3600, 7200, 10800, 21600, 43200, 86400)
# The text table's failure columns: the most frequent classes, the rest summed.
_CLASS_COLUMNS = 5


@dataclass(frozen=True)
class Bins:
    """``count`` bins of ``width_s`` from ``t0`` (unix seconds, aligned to the width); the
    first is run from ``first`` (the first start), the last up to ``end`` (the last finish)."""

    t0: float
    width_s: float
    count: int
    first: float
    end: float

    def edge(self, i: int) -> float:
        """Where the run's part of bin ``i`` starts, relative to ``t0`` (``edge(count)``: the
        end): a mean over the bin is over the time the run was running."""
        return max(self.first - self.t0, min(i * self.width_s, self.end - self.t0))


def _widths(min_width_s: float) -> Iterator[float]:
    yield min_width_s
    yield from (float(w) for w in _ROUND_WIDTHS_S if w > min_width_s)
    days = 2
    while True:
        yield max(days * 86400.0, min_width_s)
        days *= 2


def choose_bins(first: float, end: float, min_width_s: float, max_bins: int) -> Bins:
    """The narrowest width from ``min_width_s`` up with at most ``max_bins`` aligned bins."""
    for width in _widths(min_width_s):
        t0 = math.floor(first / width) * width
        count = int((end - t0) // width) + 1
        if count <= max_bins:
            return Bins(t0, width, count, first, end)
    raise AssertionError("unreachable: the widths grow without bound")


@dataclass(frozen=True)
class Series:
    """One group's figures per bin (the whole run, an agent or a replica)."""

    finished: list[int]
    failed: dict[str, list[int]]  # by failure class
    p50_s: list[float | None]
    p95_s: list[float | None]
    in_flight: list[float]  # the mean over the bin

    @property
    def succeeded(self) -> list[int]:
        return [n - sum(c[i] for c in self.failed.values()) for i, n in enumerate(self.finished)]


class _Tally:
    """What a series is built from, filled attempt by attempt."""

    def __init__(self, count: int) -> None:
        self.finished = [0] * count
        self.failed: dict[int, list[int]] = {}
        self.durations = [array("d") for _ in range(count)]
        # Per bin: starts and finishes in it, and their sums (seconds after t0).
        self.starts = [0] * count
        self.start_sum = [0.0] * count
        self.ends = [0] * count
        self.end_sum = [0.0] * count

    def add(self, start_bin: int, start: float, end_bin: int, end: float, outcome: int) -> None:
        self.starts[start_bin] += 1
        self.start_sum[start_bin] += start
        self.ends[end_bin] += 1
        self.end_sum[end_bin] += end
        self.finished[end_bin] += 1
        self.durations[end_bin].append(end - start)
        if outcome:
            counts = self.failed.get(outcome)
            if counts is None:
                counts = self.failed[outcome] = [0] * len(self.finished)
            counts[end_bin] += 1

    @classmethod
    def merged(cls, count: int, parts: Iterable[_Tally]) -> _Tally:
        """The sum of tallies over the same bins (the whole run from its agents)."""
        total = cls(count)
        for part in parts:
            for name in ("finished", "starts", "start_sum", "ends", "end_sum"):
                mine, theirs = getattr(total, name), getattr(part, name)
                mine[:] = [a + b for a, b in zip(mine, theirs, strict=True)]
            for durations, more in zip(total.durations, part.durations, strict=True):
                durations.extend(more)
            for outcome, counts in part.failed.items():
                into = total.failed.setdefault(outcome, [0] * count)
                into[:] = [a + b for a, b in zip(into, counts, strict=True)]
        return total

    def series(self, bins: Bins, outcome_names: list[str]) -> Series:
        p50: list[float | None] = []
        p95: list[float | None] = []
        for durations in self.durations:
            ordered = sorted(durations)
            p50.append(quantile(ordered, 0.5))
            p95.append(quantile(ordered, 0.95))
        failed = {outcome_names[k]: v for k, v in sorted(self.failed.items())}
        return Series(self.finished, failed, p50, p95, self._in_flight(bins))

    def _in_flight(self, bins: Bins) -> list[float]:
        means = []
        started = ended = 0
        start_sum = end_sum = before = 0.0
        for i in range(bins.count):
            started += self.starts[i]
            start_sum += self.start_sum[i]
            ended += self.ends[i]
            end_sum += self.end_sum[i]
            lo, hi = bins.edge(i), bins.edge(i + 1)
            # Starts and finishes in bin i are before its upper edge.
            integral = (started * hi - start_sum) - (ended * hi - end_sum)
            means.append((integral - before) / (hi - lo) if hi > lo else 0.0)
            before = integral
        return means


@dataclass(frozen=True)
class Timeline:
    """Attempts over time; ``bins`` is None when no attempt carries its start and duration."""

    bins: Bins | None
    whole: Series | None
    agents: dict[str, Series]
    replicas: dict[str, Series]
    untimed: int


def build_timeline(
    attempts: Attempts, min_width_s: float, max_bins: int, per_group: bool = False
) -> Timeline:
    """Bin ``attempts`` by finish time; with ``per_group``, per agent and per replica too."""
    timed = [
        i
        for i in range(len(attempts.kinds))
        if not (math.isnan(attempts.starts[i]) or math.isnan(attempts.durations[i]))
    ]
    untimed = len(attempts.kinds) - len(timed)
    if not timed:
        return Timeline(None, None, {}, {}, untimed)
    first = min(attempts.starts[i] for i in timed)
    end = max(attempts.starts[i] + attempts.durations[i] for i in timed)
    bins = choose_bins(first, end, min_width_s, max_bins)
    whole, agents, replicas = _tally(attempts, timed, bins, per_group)
    names = attempts.outcome_names.names
    agent_names, replica_names = attempts.agent_names.names, attempts.replica_names.names
    return Timeline(
        bins,
        whole.series(bins, names),
        {agent_names[k]: t.series(bins, names) for k, t in sorted(agents.items())},
        {replica_names[k]: t.series(bins, names) for k, t in replicas.items()},
        untimed,
    )


def _tally(
    attempts: Attempts, timed: list[int], bins: Bins, per_group: bool
) -> tuple[_Tally, dict[int, _Tally], dict[int, _Tally]]:
    """One pass: per agent and per replica (the whole run is their sum), or the whole run."""
    if not per_group:
        whole = _tally_by(attempts, timed, bins, None)[0]
        return whole, {}, {}
    agents = _tally_by(attempts, timed, bins, attempts.agents)
    replicas = _tally_by(attempts, timed, bins, attempts.replicas)
    return _Tally.merged(bins.count, agents.values()), agents, replicas


def _tally_by(
    attempts: Attempts, timed: list[int], bins: Bins, groups: array[int] | None
) -> dict[int, _Tally]:
    # The hot loop of a big run: locals, no calls but the tally's own.
    t0, width, last = bins.t0, bins.width_s, bins.count - 1
    starts, durations, kinds, outcomes = (
        attempts.starts,
        attempts.durations,
        attempts.kinds,
        attempts.outcomes,
    )
    tallies: dict[int, _Tally] = {}
    for i in timed:
        # Seconds after t0 keep the sums of millions of starts exact enough.
        start = starts[i] - t0
        end = start + durations[i]
        start_bin, end_bin = int(start // width), int(end // width)
        start_bin = start_bin if start_bin < last else last
        end_bin = end_bin if end_bin < last else last
        key = groups[i] if groups is not None else 0
        tally = tallies.get(key)
        if tally is None:
            tally = tallies[key] = _Tally(bins.count)
        tally.add(start_bin, start, end_bin, end, outcomes[i] if kinds[i] == FAILURE else 0)
    return tallies or {0: _Tally(bins.count)}


# -- the text report's table ----------------------------------------------------------------


def timeline_json(timeline: Timeline) -> dict[str, Any]:
    """The whole run's bins as ``report --json`` gives them."""
    bins, whole = timeline.bins, timeline.whole
    if bins is None or whole is None:
        return {"bin_s": None, "untimed": timeline.untimed, "bins": []}
    succeeded = whole.succeeded
    rows = [
        {
            "start": bins.t0 + i * bins.width_s,
            "finished": whole.finished[i],
            "succeeded": succeeded[i],
            "failed": {cls: n[i] for cls, n in whole.failed.items() if n[i]},
            "p50_s": whole.p50_s[i],
            "p95_s": whole.p95_s[i],
            "in_flight": whole.in_flight[i],
        }
        for i in range(bins.count)
    ]
    return {"bin_s": bins.width_s, "untimed": timeline.untimed, "bins": rows}


def render_timeline(timeline: dict[str, Any]) -> str:
    """The per-minute table (coarser for long runs) of ``timeline_json``."""
    if not timeline["bins"]:
        return ""
    totals: dict[str, int] = {}
    for row in timeline["bins"]:
        for cls, n in row["failed"].items():
            totals[cls] = totals.get(cls, 0) + n
    ranked = sorted(totals, key=lambda c: (-totals[c], c))
    shown, rest = ranked[:_CLASS_COLUMNS], set(ranked[_CLASS_COLUMNS:])
    headers = ["start (UTC)", "finished", "ok", *shown, *(["other failed"] if rest else [])]
    headers += ["p50 s", "p95 s", "in flight"]
    bins = timeline["bins"]
    # The time of day, or the date too when the table crosses midnight (UTC).
    one_day = utc_time(bins[0]["start"])[:10] == utc_time(bins[-1]["start"])[:10]
    day = slice(11, 19) if one_day else slice(0, 19)
    rows = [_timeline_row(row, shown, rest, day) for row in bins]
    width = timeline["bin_s"]
    head = (
        f"timeline from {utc_time(timeline['bins'][0]['start'])}, per {_width_words(width)} "
        "of finish time (in flight: the mean over the bin)"
    )
    return head + "\n" + format_table(headers, rows)


def _timeline_row(
    row: dict[str, Any], shown: list[str], rest: set[str], part: slice
) -> list[object]:
    failed = row["failed"]
    cells: list[object] = [utc_time(row["start"])[part], row["finished"], row["succeeded"]]
    cells += [failed.get(cls, 0) for cls in shown]
    if rest:
        cells.append(sum(n for cls, n in failed.items() if cls in rest))
    cells += [row["p50_s"], row["p95_s"], f"{row['in_flight']:.1f}"]
    return cells


def _width_words(width_s: float) -> str:
    if width_s == 60:
        return "minute"
    if width_s % 3600 == 0:
        return f"{width_s / 3600:g} h"
    if width_s % 60 == 0:
        return f"{width_s / 60:g} min"
    return f"{width_s:g} s"
