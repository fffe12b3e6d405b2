"""Event-loop lag of the daemon under many concurrent slow rollouts.

``dispatcher run`` at ``--concurrency 1000`` against a simulated agent (its
own process) that answers every rollout after a fixed 50 ms. The daemon's own
lag monitor samples the loop every 100 ms; its p99 and max come from the
run's summary (``X_manifest.json``), beside the rate achieved. Also prints the
same run at concurrency 64 as a baseline. Medians over ``--repeat`` rounds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dispatcher_server, median, run_child, write_tasks


def one_run(work: Path, tasks: Path, url: str, concurrency: int, tag: str) -> dict[str, float]:
    output = work / f"{tag}.jsonl"
    args = [
        sys.executable, "-m", "dispatcher", "run", "--input", str(tasks),
        "--output", str(output), "--agent", f"sim={url}", "--concurrency", str(concurrency),
        "--log-format", "json", "--metrics-listen", "127.0.0.1:0", "--fresh",
    ]  # fmt: skip
    result = run_child(args, work / f"{tag}.log")
    if result.returncode != 0:
        raise SystemExit(f"run failed ({result.returncode}); see {work / tag}.log")
    summary = orjson.loads((work / f"{tag}_manifest.json").read_bytes())["last_run"]["summary"]
    return {
        "lag_p99_ms": (summary["event_loop_lag_p99_s"] or 0.0) * 1000,
        "rate": summary["outcomes"]["success"] / summary["dispatch_s"],
        "p50_ms": summary["latency_s"]["p50"] * 1000,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rollouts", type=int, default=60_000)
    parser.add_argument("--latency-s", type=float, default=0.05)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    opts = parser.parse_args()
    if opts.smoke:
        opts.rollouts, opts.repeat = 3_000, 1
    agent = ("sim-agent", "--latency-s", str(opts.latency_s))
    with tempfile.TemporaryDirectory() as tmp, dispatcher_server(*agent) as url:
        work = Path(tmp)
        tasks = work / "tasks.jsonl"
        write_tasks(tasks, opts.rollouts)
        runs: dict[int, list[dict[str, float]]] = {64: [], 1000: []}
        for i in range(opts.repeat):
            for concurrency, results in runs.items():
                results.append(one_run(work, tasks, url, concurrency, f"c{concurrency}-{i}"))
    print(f"event-loop lag: {opts.rollouts} rollouts, agent latency {opts.latency_s * 1000:.0f} ms,"
          f" median of {opts.repeat}")  # fmt: skip
    for concurrency, results in runs.items():
        lag = median([r["lag_p99_ms"] for r in results])
        rate = median([r["rate"] for r in results])
        p50 = median([r["p50_ms"] for r in results])
        print(f"  concurrency {concurrency:5d}: lag p99 {lag:6.2f} ms   "
              f"{rate:7.0f} rollouts/s   rollout p50 {p50:6.1f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
