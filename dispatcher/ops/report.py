"""``dispatcher report OUTPUT``: how long rollouts took, when they started, what they scored.

Timing comes from ``_ng_dispatch`` (``started_at`` unix seconds,
``duration_s``, ``replica``), which the dispatcher stamps on every success
and failure row; a success row without it falls back to
``ng_perf.total_latency_ms``. Each row is one attempt, so a retried rollout
contributes each of its attempts.

- Durations: count, mean, p50/p90/p99 (linear interpolation), max; for
  successes, failed attempts and both.
- The per-rollout limit: an attempt *hit the limit* when it failed with
  ``timeout_exceeded``, or when ``--rollout-timeout-s S`` is known and it ran
  for at least 0.99 S.
- Starts: attempts in start order, cut into ten equal-count groups (deciles),
  each with its start window relative to the first start, outcome counts and
  median duration. Late deciles that time out or fail more show work started
  too close to the end.
- Reward: mean of numeric ``reward`` over success rows, per agent.
- pass@k, per agent: the unbiased estimator 1 - C(n-c, k) / C(n, k) per task,
  averaged over the tasks with n >= k, where n counts the task's rollouts with
  a final outcome (success, terminal failure, attempts used up; rollouts left
  to run are not counted) and c the successes with ``reward > 0``. k runs over
  powers of two up to the largest n.
"""

from __future__ import annotations

import argparse
import math
from array import array
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from dispatcher.commands import command_help
from dispatcher.files import delivery_history as delivery
from dispatcher.files.contracts import DISPATCH_KEY as DISPATCH
from dispatcher.files.resume import OutputPaths, RunState, iter_rows
from dispatcher.latency.quantile import quantile
from dispatcher.ops.runfiles import agent_name, read_manifest, render_delivery, require_run
from dispatcher.ops.status import (
    Standing,
    add_attempt_cap_flags,
    given_attempt_cap,
    max_attempts_for,
    standing,
)
from dispatcher.ops.table import format_table, utc_time
from dispatcher.outcome import Outcome
from dispatcher.settings.args import positive_float
from dispatcher.tasks.keys import row_key, task_of

LIMIT_FRACTION = 0.99
START_GROUPS = 10

_SUCCESS, _FAILURE = 0, 1
_FINAL = frozenset({Standing.SUCCEEDED, Standing.TERMINAL, Standing.ATTEMPTS_USED_UP})
_NAN = math.nan


@dataclass
class Attempts:
    """One entry per row; NaN where the row carried no timing. Compact for millions of rows."""

    starts: array[float] = field(default_factory=lambda: array("d"))
    durations: array[float] = field(default_factory=lambda: array("d"))
    kinds: bytearray = field(default_factory=bytearray)
    timeouts: bytearray = field(default_factory=bytearray)

    def add(self, row: dict[str, Any], kind: int, timed_out: bool) -> None:
        started, duration = row_timing(row)
        self.starts.append(_NAN if started is None else started)
        self.durations.append(_NAN if duration is None else duration)
        self.kinds.append(kind)
        self.timeouts.append(timed_out)


@dataclass
class RewardTally:
    successes: int = 0
    rewarded: int = 0
    total: float = 0.0
    positive: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "successes": self.successes,
            "with_reward": self.rewarded,
            "mean": self.total / self.rewarded if self.rewarded else None,
            "positive_share": self.positive / self.rewarded if self.rewarded else None,
        }


@dataclass
class ReportData:
    """What one streaming pass over the three files collects."""

    attempts: Attempts = field(default_factory=Attempts)
    rewards: dict[str, RewardTally] = field(default_factory=lambda: defaultdict(RewardTally))
    passed: set[int] = field(default_factory=set)
    # (agent, task) -> [rollouts with a final outcome, of them passed]
    tasks: dict[tuple[str, int], list[int]] = field(default_factory=lambda: defaultdict(_pair))


def _pair() -> list[int]:
    return [0, 0]


def row_timing(row: dict[str, Any]) -> tuple[float | None, float | None]:
    """``(started_at, duration_s)`` of a row, each None when the row does not say."""
    started = duration = None
    stamp = row.get(DISPATCH)
    if isinstance(stamp, dict):
        started = _number(stamp.get("started_at"))
        duration = _number(stamp.get("duration_s"))
    if duration is None:
        perf = row.get("ng_perf")
        latency_ms = _number(perf.get("total_latency_ms")) if isinstance(perf, dict) else None
        duration = latency_ms / 1000.0 if latency_ms is not None else None
    return started, duration


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def collect(paths: OutputPaths, max_attempts: int) -> ReportData:
    """One streaming read of successes, failures, then materialized rows."""
    data = ReportData()
    state = RunState(max_attempts=max_attempts)
    for _, row in iter_rows(paths.output):
        key = row_key(row)
        if row is None or key is None or key in state.successes:
            continue
        state.successes.add(key)
        data.attempts.add(row, _SUCCESS, timed_out=False)
        _note_reward(data, key, row)
    for _, row in iter_rows(paths.failures):
        key = row_key(row)
        if row is None or key is None:
            continue
        failure_class = state.add_failure(key, row)
        if failure_class is None:
            continue  # an omitted rollout's row: no attempt (contracts §15)
        data.attempts.add(row, _FAILURE, failure_class == Outcome.TIMEOUT_EXCEEDED)
    _collect_tasks(paths, state, data)
    return data


def _note_reward(data: ReportData, key: int, row: dict[str, Any]) -> None:
    tally = data.rewards[agent_name(row)]
    tally.successes += 1
    reward = row.get("reward")
    value = float(reward) if isinstance(reward, int | float) else None
    if value is None or not math.isfinite(value):
        return
    tally.rewarded += 1
    tally.total += value
    if value > 0:
        tally.positive += 1
        data.passed.add(key)


def _collect_tasks(paths: OutputPaths, state: RunState, data: ReportData) -> None:
    seen: set[int] = set()
    for _, row in iter_rows(paths.materialized):
        key = row_key(row)
        if row is None or key is None or key in seen:
            continue
        seen.add(key)
        if standing(state, key) not in _FINAL:
            continue
        counts = data.tasks[(agent_name(row), task_of(key))]
        counts[0] += 1
        counts[1] += key in data.passed


# -- figures ------------------------------------------------------------------------------


def duration_stats(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "mean": math.fsum(ordered) / len(ordered) if ordered else None,
        "p50": quantile(ordered, 0.5),
        "p90": quantile(ordered, 0.9),
        "p99": quantile(ordered, 0.99),
        "max": ordered[-1] if ordered else None,
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    # The product form avoids the huge binomials of C(n-c, k) / C(n, k).
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_table(tasks: dict[tuple[str, int], list[int]]) -> dict[str, dict[str, Any]]:
    by_agent: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for (agent, _), (n, c) in tasks.items():
        if n:
            by_agent[agent].append((n, c))
    table: dict[str, dict[str, Any]] = {}
    for agent, samples in sorted(by_agent.items()):
        largest = max(n for n, _ in samples)
        ks: dict[str, Any] = {}
        k = 1
        while k <= largest:
            values = [pass_at_k(n, c, k) for n, c in samples if n >= k]
            ks[str(k)] = {"value": math.fsum(values) / len(values), "tasks": len(values)}
            k *= 2
        table[agent] = {"tasks": len(samples), "max_repeats": largest, "k": ks}
    return table


def limit_figures(attempts: Attempts, timeout_s: float | None) -> dict[str, Any]:
    near = 0
    hit = 0
    threshold = timeout_s * LIMIT_FRACTION if timeout_s is not None else math.inf
    for duration, timed_out in zip(attempts.durations, attempts.timeouts, strict=True):
        ran_to_limit = duration >= threshold
        near += ran_to_limit and not timed_out
        hit += ran_to_limit or bool(timed_out)
    return {
        "rollout_timeout_s": timeout_s,
        "timeout_exceeded": sum(attempts.timeouts),
        "ran_to_limit": near,
        "hit_limit": hit,
    }


def start_deciles(attempts: Attempts, timeout_s: float | None) -> dict[str, Any]:
    starts = attempts.starts
    order = sorted(
        (i for i in range(len(starts)) if not math.isnan(starts[i])), key=starts.__getitem__
    )
    if not order:
        return {"first": None, "last": None, "groups": []}
    first = starts[order[0]]
    threshold = timeout_s * LIMIT_FRACTION if timeout_s is not None else math.inf
    groups = []
    count = min(START_GROUPS, len(order))
    for g in range(count):
        members = order[g * len(order) // count : (g + 1) * len(order) // count]
        groups.append(_start_group(attempts, members, first, threshold))
    return {"first": first, "last": starts[order[-1]], "groups": groups}


def _start_group(
    attempts: Attempts, members: list[int], first: float, threshold: float
) -> dict[str, Any]:
    durations = sorted(
        attempts.durations[i] for i in members if not math.isnan(attempts.durations[i])
    )
    successes = sum(1 for i in members if attempts.kinds[i] == _SUCCESS)
    hit = sum(1 for i in members if attempts.timeouts[i] or attempts.durations[i] >= threshold)
    return {
        "from_s": attempts.starts[members[0]] - first,
        "to_s": attempts.starts[members[-1]] - first,
        "attempts": len(members),
        "successes": successes,
        "failures": len(members) - successes,
        "hit_limit": hit,
        "p50_duration_s": quantile(durations, 0.5),
    }


def build_report(output: Path, timeout_s: float | None, max_attempts: int | None) -> dict[str, Any]:
    """The report as one JSON-ready dict (read-only, streaming)."""
    paths = require_run(output)
    manifest = read_manifest(paths.manifest)
    if timeout_s is None and manifest is not None and manifest.rollout_timeout_s is not None:
        timeout_s = float(manifest.rollout_timeout_s)
    data = collect(paths, max_attempts_for(max_attempts, manifest))
    attempts = data.attempts
    by_kind: dict[int, list[float]] = {_SUCCESS: [], _FAILURE: []}
    for kind, duration in zip(attempts.kinds, attempts.durations, strict=True):
        if not math.isnan(duration):
            by_kind[kind].append(duration)
    return {
        "output": str(output),
        "attempts": {
            "total": len(attempts.kinds),
            "successes": sum(1 for k in attempts.kinds if k == _SUCCESS),
            "failures": sum(1 for k in attempts.kinds if k == _FAILURE),
            "without_duration": sum(1 for d in attempts.durations if math.isnan(d)),
        },
        "durations_s": {
            "success": duration_stats(by_kind[_SUCCESS]),
            "failure": duration_stats(by_kind[_FAILURE]),
            "all": duration_stats(by_kind[_SUCCESS] + by_kind[_FAILURE]),
        },
        "limit": limit_figures(attempts, timeout_s),
        "starts": start_deciles(attempts, timeout_s),
        "rewards": {a: t.to_json() for a, t in sorted(data.rewards.items())},
        "pass_at_k": pass_at_k_table(data.tasks),
        "delivery": delivery.summarize(manifest.delivery_history if manifest is not None else None),
    }


# -- output -------------------------------------------------------------------------------


def render_report(report: dict[str, Any]) -> str:
    sections = [
        _render_attempts(report),
        _render_durations(report["durations_s"]),
        _render_limit(report["limit"]),
        _render_starts(report["starts"]),
        _render_rewards(report["rewards"]),
        _render_pass_at_k(report["pass_at_k"]),
        render_delivery(report["delivery"]).lstrip("\n"),
    ]
    return "\n\n".join(s for s in sections if s) + "\n"


def _render_attempts(report: dict[str, Any]) -> str:
    a = report["attempts"]
    line = (
        f"run        {report['output']}\n"
        f"attempts   {a['total']} ({a['successes']} succeeded, {a['failures']} failed)"
    )
    if a["without_duration"]:
        line += f"; {a['without_duration']} without timing (no {DISPATCH} or ng_perf)"
    return line


def _render_durations(stats: dict[str, dict[str, Any]]) -> str:
    headers = ("duration (s)", "n", "mean", "p50", "p90", "p99", "max")
    rows = [
        (name, s["n"], s["mean"], s["p50"], s["p90"], s["p99"], s["max"])
        for name, s in (
            ("succeeded", stats["success"]),
            ("failed", stats["failure"]),
            ("all", stats["all"]),
        )
    ]
    return format_table(headers, rows, indent=0)


def _render_limit(limit: dict[str, Any]) -> str:
    if limit["rollout_timeout_s"] is None:
        return (
            f"per-rollout limit: {limit['timeout_exceeded']} attempts failed with "
            "timeout_exceeded (give --rollout-timeout-s to count those that ran to it too)"
        )
    return (
        f"per-rollout limit {limit['rollout_timeout_s']:g} s: {limit['hit_limit']} attempts hit "
        f"it ({limit['timeout_exceeded']} timeout_exceeded, {limit['ran_to_limit']} more ran to "
        f">= {LIMIT_FRACTION:.0%} of it)"
    )


def _render_starts(starts: dict[str, Any]) -> str:
    if not starts["groups"]:
        return f"starts: no row carries {DISPATCH}.started_at"
    headers = ("start decile", "from s", "to s", "attempts", "ok", "failed", "hit limit", "p50 s")
    rows = [
        (
            f"{i + 1}",
            g["from_s"],
            g["to_s"],
            g["attempts"],
            g["successes"],
            g["failures"],
            g["hit_limit"],
            g["p50_duration_s"],
        )
        for i, g in enumerate(starts["groups"])
    ]
    head = (
        f"starts, in equal-count groups by start order (seconds after {utc_time(starts['first'])})"
    )
    return head + "\n" + format_table(headers, rows)


def _render_rewards(rewards: dict[str, dict[str, Any]]) -> str:
    if not rewards:
        return "reward: no success rows"
    headers = ("reward per agent", "successes", "with reward", "mean", "> 0")
    rows = [
        (
            agent,
            r["successes"],
            r["with_reward"],
            r["mean"],
            None if r["positive_share"] is None else f"{100 * r['positive_share']:.1f}%",
        )
        for agent, r in rewards.items()
    ]
    return format_table(headers, rows, indent=0)


def _render_pass_at_k(table: dict[str, dict[str, Any]]) -> str:
    if not table:
        return ""
    ks = sorted({int(k) for entry in table.values() for k in entry["k"]})
    headers = ("pass@k", "tasks", *(f"k={k}" for k in ks))
    rows = [
        (agent, entry["tasks"], *(_k_value(entry, k) for k in ks)) for agent, entry in table.items()
    ]
    note = (
        "pass@k: unbiased estimator per task over its rollouts with a final outcome, "
        "success = reward > 0; mean over tasks with at least k of them"
    )
    return note + "\n" + format_table(headers, rows)


def _k_value(entry: dict[str, Any], k: int) -> str | None:
    value = entry["k"].get(str(k))
    return None if value is None else f"{value['value']:.3f}"


# -- CLI ----------------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "report",
        help=command_help("report"),
        description=(
            "Read a run's rows (without changing them) and report rollout duration "
            "percentiles, attempts that hit the per-rollout limit, how outcomes vary with "
            "start time, mean reward per agent and pass@k over repeats."
        ),
    )
    parser.add_argument("output", type=Path, metavar="OUTPUT", help="the run's --output X.jsonl")
    parser.add_argument(
        "--rollout-timeout-s",
        type=positive_float,
        default=None,
        help="the run's per-rollout limit (default: the manifest's rollout_timeout_s, if any)",
    )
    add_attempt_cap_flags(parser, "for which rollouts count as final in pass@k")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run_report)


def run_report(args: argparse.Namespace) -> int:
    report = build_report(args.output, args.rollout_timeout_s, given_attempt_cap(args))
    if args.json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    else:
        print(render_report(report), end="")
    return 0
