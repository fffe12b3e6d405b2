"""Adaptive concurrency (``--concurrency auto``) against agents with a knee.

The simulated agent (its own process) has a capacity C: past C rollouts in
flight its latency grows with the cube of the overload, and past 1.25·C it
answers 429 with ``Retry-After``. For each scenario:

1. a sweep of fixed concurrencies finds the best fixed throughput (rows per
   second over each run's last part, a budget-bounded run each);
2. ``auto`` runs as long, from its default start; printed: the time until
   its throughput (5 s rolling) first reaches 95 % of the best fixed, its
   throughput from then on, and the share of requests answered 429 then.
The second agent's capacity doubles mid-run; printed: how long ``auto``
takes to reach 95 % of the best fixed throughput at the new capacity.
Last, the hard caps: ``auto`` with ``--agent-concurrency``,
``--replica-concurrency`` and ``--max-starts-per-s`` well below what the
agents could take; the agents report the most they ever saw in flight and
the most requests within any one second.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dispatcher_server, run_child, write_tasks

LATENCY_S = 0.2
WINDOW_S = 5


def per_second(work: Path, tag: str) -> tuple[list[int], list[float]]:
    """Rows finished in each second of the run, and the 429 retries' seconds."""
    rows = work / f"{tag}.jsonl"
    ends = []
    with rows.open("rb") as f:
        for line in f:
            dispatch = orjson.loads(line)["_ng_dispatch"]
            ends.append(dispatch["started_at"] + dispatch["duration_s"])
    retries = []
    for line in (work / f"{tag}.log").read_bytes().splitlines():
        if b'"rollout_retry"' in line and b'"http_429"' in line:
            stamp = orjson.loads(line)["timestamp"]
            retries.append(datetime.fromisoformat(stamp).timestamp())
    start = min(ends, default=0.0)
    counts = Counter(int(t - start) for t in ends)
    series = [counts.get(s, 0) for s in range(max(counts, default=-1) + 1)]
    return series, [t - start for t in retries]


def run(work: Path, tag: str, tasks: Path, agents: str, seconds: float, *extra: str) -> None:
    args = [
        sys.executable, "-m", "dispatcher", "run", "--input", str(tasks),
        "--output", str(work / f"{tag}.jsonl"), "--agent", f"sim={agents}",
        "--log-format", "json", "--metrics-listen", "off", "--fsync", "never", "--fresh",
        "--dispatch-budget-s", str(seconds), "--drain-margin-s", "0",
        "--shutdown-grace-s", "0", *extra,
    ]  # fmt: skip
    result = run_child(args, work / f"{tag}.log")
    if result.returncode not in (0, 75):
        raise SystemExit(f"{tag}: exit {result.returncode}; see {work / tag}.log")


def steady_rate(series: Sequence[int], tail_s: int) -> float:
    tail = series[-tail_s - 1 : -1] or series
    return sum(tail) / max(1, len(tail))


def rolling(series: Sequence[int]) -> Iterator[tuple[int, float]]:
    for end in range(WINDOW_S, len(series) + 1):
        yield end, sum(series[end - WINDOW_S : end]) / WINDOW_S


def first_reaching(series: Sequence[int], goal: float, after_s: int = 0) -> int | None:
    for end, rate in rolling(series):
        if end - WINDOW_S >= after_s and rate >= goal:
            return end
    return None


def sweep(work: Path, tasks: Path, url: str, levels: Sequence[int], seconds: float) -> float:
    best = 0.0
    for level in levels:
        tag = f"fixed-{url.rsplit(':', 1)[1]}-{level}"
        run(work, tag, tasks, url, seconds, "--concurrency", str(level))
        rate = steady_rate(per_second(work, tag)[0], int(seconds / 2))
        print(f"    fixed {level:4d}: {rate:6.1f} rows/s")
        best = max(best, rate)
    return best


def knee_agent(stack: ExitStack, capacity: int, *extra: str) -> str:
    args = ("sim-agent", "--capacity", str(capacity), "--latency-s", str(LATENCY_S), *extra)
    return stack.enter_context(dispatcher_server(*args))


def auto_figures(work: Path, tag: str, best: float, after_s: int = 0) -> dict[str, Any]:
    series, retries = per_second(work, tag)
    reached = first_reaching(series, 0.95 * best, after_s)
    start = reached if reached is not None else len(series)
    steady = series[start:-1]
    rows = sum(steady)
    refused = sum(1 for t in retries if start <= t < len(series) - 1)
    return {
        "reached_s": None if reached is None else reached - after_s,
        "rate": rows / max(1, len(steady)),
        "share_429": refused / max(1, rows + refused),
    }


def stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/stats") as answer:
        return dict(orjson.loads(answer.read()))


def scenario_knee(work: Path, tasks: Path, opts: argparse.Namespace) -> None:
    c = opts.capacity
    print(f"knee at C={c} rollouts in flight, {LATENCY_S * 1000:.0f} ms below it")
    with ExitStack() as stack:
        url = knee_agent(stack, c)
        levels = [c // 2, 3 * c // 4, c, 5 * c // 4, 3 * c // 2]
        best = sweep(work, tasks, url, levels, opts.sweep_s)
        run(work, "auto", tasks, url, opts.auto_s, "--concurrency", "auto")
    f = auto_figures(work, "auto", best)
    print(f"  best fixed {best:.1f} rows/s; auto reached 95 % of it after {f['reached_s']} s "
          f"(goal <= 60), then held {f['rate']:.1f} rows/s = {f['rate'] / best:.1%} of it; "
          f"429s then: {f['share_429']:.2%} of requests (goal < 1 %)")  # fmt: skip


def scenario_change(work: Path, tasks: Path, opts: argparse.Namespace) -> None:
    c, after = opts.capacity, opts.change_after_s
    print(f"capacity {c} -> {2 * c} after {after:g} s")
    with ExitStack() as stack:
        big = knee_agent(stack, 2 * c)
        best = sweep(work, tasks, big, [3 * c // 2, 2 * c, 5 * c // 2], opts.sweep_s)
        url = knee_agent(
            stack, c, "--capacity-then", str(2 * c), "--capacity-change-after-s", str(after)
        )
        run(work, "change", tasks, url, after + opts.auto_s, "--concurrency", "auto")
    f = auto_figures(work, "change", best, after_s=int(after))
    print(f"  best fixed at the new capacity {best:.1f} rows/s; auto re-converged to 95 % of it "
          f"{f['reached_s']} s after the change (goal <= 60); held {f['rate'] / best:.1%}; "
          f"429s then: {f['share_429']:.2%}")  # fmt: skip


def scenario_caps(work: Path, tasks: Path, opts: argparse.Namespace) -> None:
    c = opts.capacity
    agent_cap, replica_cap, starts = c // 2, c // 3, 3 * c
    with ExitStack() as stack:
        one = knee_agent(stack, c)
        caps = ("--agent-concurrency", f"sim={agent_cap}", "--max-starts-per-s", str(starts))
        run(work, "caps-agent", tasks, one, opts.sweep_s, "--concurrency", "auto", *caps)
        alone = stats(one)
        two, three = knee_agent(stack, c), knee_agent(stack, c)
        run(work, "caps-replica", tasks, f"{two},{three}", opts.sweep_s, "--concurrency", "auto",
            "--replica-concurrency", str(replica_cap))  # fmt: skip
        peaks = [stats(two)["max_in_flight"], stats(three)["max_in_flight"]]
    print(f"caps, as the agents saw them: agent cap {agent_cap}: at most "
          f"{alone['max_in_flight']} in flight; start cap {starts}/s: at most "
          f"{alone['max_per_s']} requests within a second; replica cap {replica_cap}: at most "
          f"{max(peaks)} in flight on either replica")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--capacity", type=int, default=64)
    parser.add_argument("--sweep-s", type=float, default=15.0)
    parser.add_argument("--auto-s", type=float, default=75.0)
    parser.add_argument("--change-after-s", type=float, default=40.0)
    parser.add_argument("--smoke", action="store_true")
    opts = parser.parse_args()
    if opts.smoke:
        opts.capacity, opts.sweep_s, opts.auto_s, opts.change_after_s = 16, 3.0, 8.0, 4.0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tasks = work / "tasks.jsonl"
        # Enough never to run out: a run stops at its budget. Every run materializes
        # the whole file, so the smoke's short runs get a smaller one.
        write_tasks(tasks, 20_000 if opts.smoke else 200_000)
        scenario_knee(work, tasks, opts)
        scenario_change(work, tasks, opts)
        scenario_caps(work, tasks, opts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
