"""``dispatcher report OUTPUT``: how long rollouts took, when they started, what they scored.

OUTPUT is a run's ``X.jsonl`` or a ``dispatcher serve`` job's folder (its
``rollouts.jsonl``). The rows are read once, only the keys a report needs
(``ops.attempts``). Timing comes from ``_ng_dispatch`` (``started_at`` unix seconds,
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
- Timeline (``ops.timeline``): per minute of finish time (coarser past an
  hour, at most 60 lines), attempts finished, succeeded and failed by class,
  duration p50/p95 and the mean in flight. ``--html FILE`` draws the same over
  time for the whole run, per agent and per replica (``ops.report_html``).
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
from collections import defaultdict
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson

from dispatcher.commands import command_help
from dispatcher.errors import ConfigError
from dispatcher.files import delivery_history as delivery
from dispatcher.files.contracts import DISPATCH_KEY as DISPATCH
from dispatcher.latency.quantile import quantile
from dispatcher.ops.attempts import FAILURE, SUCCESS, Attempts, RunRead, collect
from dispatcher.ops.runfiles import is_state_dir, read_manifest, render_delivery, require_run
from dispatcher.ops.status import add_attempt_cap_flags, given_attempt_cap, max_attempts_for
from dispatcher.ops.table import format_table, utc_time
from dispatcher.ops.timeline import (
    MAX_TEXT_BINS,
    TEXT_BIN_S,
    build_timeline,
    render_timeline,
    timeline_json,
)
from dispatcher.settings.args import positive_float

LIMIT_FRACTION = 0.99
START_GROUPS = 10
# A `dispatcher serve` job's output, in its folder (serve/registry.py).
JOB_OUTPUT = "rollouts.jsonl"


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
    successes = sum(1 for i in members if attempts.kinds[i] == SUCCESS)
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


def read_run(output: Path, max_attempts: int | None) -> RunRead:
    paths = require_run(output)
    manifest = read_manifest(paths.manifest)
    return RunRead(output, manifest, collect(paths, max_attempts_for(max_attempts, manifest)))


def build_report(
    output: Path, timeout_s: float | None, max_attempts: int | None, bin_s: float = TEXT_BIN_S
) -> dict[str, Any]:
    """The report as one JSON-ready dict (read-only, streaming)."""
    return report_of(read_run(output, max_attempts), timeout_s, bin_s)


def report_of(run: RunRead, timeout_s: float | None, bin_s: float) -> dict[str, Any]:
    manifest, attempts = run.manifest, run.data.attempts
    if timeout_s is None and manifest is not None and manifest.rollout_timeout_s is not None:
        timeout_s = float(manifest.rollout_timeout_s)
    by_kind: dict[int, list[float]] = {SUCCESS: [], FAILURE: []}
    for kind, duration in zip(attempts.kinds, attempts.durations, strict=True):
        if not math.isnan(duration):
            by_kind[kind].append(duration)
    return {
        "output": str(run.output),
        "attempts": {
            "total": len(attempts.kinds),
            "successes": sum(1 for k in attempts.kinds if k == SUCCESS),
            "failures": sum(1 for k in attempts.kinds if k == FAILURE),
            "without_duration": sum(1 for d in attempts.durations if math.isnan(d)),
        },
        "durations_s": {
            "success": duration_stats(by_kind[SUCCESS]),
            "failure": duration_stats(by_kind[FAILURE]),
            "all": duration_stats(by_kind[SUCCESS] + by_kind[FAILURE]),
        },
        "limit": limit_figures(attempts, timeout_s),
        "starts": start_deciles(attempts, timeout_s),
        "timeline": timeline_json(build_timeline(attempts, bin_s, MAX_TEXT_BINS)),
        "rewards": {a: t.to_json() for a, t in sorted(run.data.rewards.items())},
        "pass_at_k": pass_at_k_table(run.data.tasks),
        "delivery": delivery.summarize(run.hops),
    }


# -- output -------------------------------------------------------------------------------


def render_report(report: dict[str, Any]) -> str:
    sections = [
        _render_attempts(report),
        _render_durations(report["durations_s"]),
        _render_limit(report["limit"]),
        _render_starts(report["starts"]),
        render_timeline(report["timeline"]),
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
            "start time, a per-minute timeline of finishes, failures, latency and rollouts in "
            "flight, mean reward per agent and pass@k over repeats; --html draws the timeline."
        ),
    )
    parser.add_argument(
        "output",
        type=Path,
        metavar="OUTPUT",
        help="the run's --output X.jsonl, or a `dispatcher serve` job's folder STATE_DIR/jobs/ID",
    )
    parser.add_argument(
        "--rollout-timeout-s",
        type=positive_float,
        default=None,
        help="the run's per-rollout limit (default: the manifest's rollout_timeout_s, if any)",
    )
    add_attempt_cap_flags(parser, "for which rollouts count as final in pass@k")
    parser.add_argument(
        "--bin-s",
        type=positive_float,
        default=None,
        help=(
            f"width of the timeline's bins (default: {TEXT_BIN_S:g} s in the text, finer in "
            f"the pictures); wider when the run would need more than {MAX_TEXT_BINS} lines"
        ),
    )
    parser.add_argument(
        "--html",
        type=Path,
        default=None,
        metavar="FILE",
        help=(
            "also write one self-contained page (no network) with pictures of throughput, "
            "latency, in flight and failures over time, per agent and replica "
            "(needs: pip install 'rollout-dispatcher[report]')"
        ),
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run_report)


def run_report(args: argparse.Namespace) -> int:
    # Checked before the files are read: a missing extra should not cost a pass over them.
    html = _html_writer() if args.html is not None else None
    run = read_run(run_output(args.output), given_attempt_cap(args))
    report = report_of(run, args.rollout_timeout_s, args.bin_s or TEXT_BIN_S)
    if html is not None:
        html.write_page(args.html, run, render_report(report), args.bin_s)
    if args.json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    else:
        print(render_report(report), end="")
    return 0


def run_output(path: Path) -> Path:
    """OUTPUT as given, or the output file of a `dispatcher serve` job's folder."""
    if is_state_dir(path):
        raise ConfigError(
            f"{path} is a `dispatcher serve` state directory: report one of its jobs, "
            f"{path}/jobs/ID (`dispatcher status {path}` lists them)"
        )
    if path.is_dir():
        return path / JOB_OUTPUT
    return path


def _html_writer() -> ModuleType:
    # Imported for --html only: it brings matplotlib, which the text report never needs.
    from dispatcher.ops import report_html

    report_html.require_matplotlib()
    return report_html
