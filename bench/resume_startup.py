"""Resume start-up on a large output: seconds until dispatch begins, and peak memory.

Builds a run of ``--tasks`` tasks x ``--repeats`` (default 250,000 x 4 =
1,000,000 rollouts) whose ``X.jsonl`` already holds every rollout but the last
``--pending`` (a run killed near its end), plus a failures sidecar with some
retried attempts. Then times ``dispatcher run`` resuming it:

  * ``run_started``: process start until the ``run_started`` event (lock,
    materialize, identity check, torn-tail repair, state read back);
  * ``first dispatch``: until the first rollout is sent (its ``rollout_finished``
    timestamp minus its duration), which adds scanning to the first pending row;
  * peak RSS of the dispatcher process (``VmHWM``, from its ``run_summary``).

Between rounds the output files are cut back to their starting size, so each
round resumes the same state. Figures are medians over ``--repeat`` rounds.
Goal (issue 3): under 10 s and under 300 MB.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ChildRun, dispatcher_server, median, run_child, write_tasks

GOAL_S, GOAL_MB = 10.0, 300.0


def run_command(work: Path, url: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "dispatcher", "run",
        "--input", str(work / "tasks.jsonl"), "--output", str(work / "out.jsonl"),
        "--agent", f"sim={url}", "--metrics-listen", "off", "--log-format", "json",
        "--concurrency", "64", *extra,
    ]  # fmt: skip


def build_run(work: Path, url: str, opts: argparse.Namespace) -> dict[str, Any]:
    """Materialize with a run that starts nothing, then write the done rows directly."""
    write_tasks(work / "tasks.jsonl", opts.tasks)
    first = run_child(
        run_command(work, url, "--num-repeats", str(opts.repeats), "--dispatch-budget-s", "0"),
        work / "build.log",
    )
    if first.returncode != 75:
        raise SystemExit(f"building the run failed ({first.returncode}): see {work}/build.log")
    rollouts = opts.tasks * opts.repeats
    pending = set(range(rollouts - opts.pending, rollouts))
    retried = set(random.Random(0).sample(range(rollouts), opts.failures))
    with (
        (work / "out_materialized_inputs.jsonl").open("rb") as rows,
        (work / "out.jsonl").open("wb") as out,
        (work / "out_failures.jsonl").open("wb") as failures,
    ):
        for n, line in enumerate(rows):
            row = orjson.loads(line)
            if n in retried:
                failures.write(orjson.dumps(failure_row(row)) + b"\n")
            if n not in pending:
                out.write(orjson.dumps(success_row(row, n in retried)) + b"\n")
    return {
        "rollouts": rollouts,
        "output_mb": (work / "out.jsonl").stat().st_size / 1e6,
        "sizes": {p: (work / p).stat().st_size for p in ("out.jsonl", "out_failures.jsonl")},
        "manifest": (work / "out_manifest.json").read_bytes(),
    }


def success_row(row: dict[str, Any], retried: bool) -> dict[str, Any]:
    rollout_id = f"{row['_ng_task_index']}-{row['_ng_rollout_index']}"
    done = {
        **row,
        "response": {"id": f"resp-{rollout_id}", "output_text": "The answer is 42."},
        "reward": 1.0,
        "_ng_dispatch": {"rollout_id": rollout_id, "replica": "http://127.0.0.1:8000"},
    }
    if retried:
        done["_ng_attempt_index"] = 1
        done["_ng_dispatch"]["rollout_id"] += "-a1"
    return done


def failure_row(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "_ng_task_index": row["_ng_task_index"],
        "_ng_rollout_index": row["_ng_rollout_index"],
        "agent_ref": row["agent_ref"],
        "_ng_failure_class": "agent_request_failed",
        "_ng_failure_type": "ClientResponseError",
        "_ng_failure_message": "agent answered HTTP 503",
        "_ng_failure_http_status": 503,
        "_ng_failure_response_body": "overloaded",
        "_ng_failure_terminal": False,
    }


def restore(work: Path, built: dict[str, Any]) -> None:
    """Cut the appended rows off again: the next round resumes the same state."""
    for name, size in built["sizes"].items():
        os.truncate(work / name, size)
    (work / "out_manifest.json").write_bytes(built["manifest"])


def _timestamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def resume_round(work: Path, url: str, opts: argparse.Namespace, i: int) -> dict[str, float]:
    started = time.time()
    result: ChildRun = run_child(
        run_command(work, url, "--num-repeats", str(opts.repeats)), work / f"resume{i}.log"
    )
    if result.returncode != 0:
        raise SystemExit(f"resume failed ({result.returncode}): see {work}/resume{i}.log")
    (run_started,) = result.events("run_started")
    finished = result.events("rollout_finished")
    if len(finished) != opts.pending or run_started["already_final"] != built_final(opts):
        raise SystemExit(f"resume ran {len(finished)} rollouts, expected {opts.pending}")
    first = min(_timestamp(e) - e["duration_s"] for e in finished)
    (summary,) = result.events("run_summary")
    return {
        "run_started_s": _timestamp(run_started) - started,
        "first_dispatch_s": first - started,
        "wall_s": result.wall_s,
        "peak_rss_mb": summary["peak_rss_mb"],
    }


def built_final(opts: argparse.Namespace) -> int:
    return int(opts.tasks * opts.repeats - opts.pending)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=250_000)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--pending", type=int, default=1_000)
    parser.add_argument("--failures", type=int, default=5_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    opts = parser.parse_args()
    if opts.smoke:
        opts.tasks, opts.pending, opts.failures, opts.repeat = 5_000, 100, 100, 1
    with tempfile.TemporaryDirectory() as tmp, dispatcher_server("sim-agent") as url:
        work = Path(tmp)
        t0 = time.perf_counter()
        built = build_run(work, url, opts)
        build_s = time.perf_counter() - t0
        rounds = []
        for i in range(opts.repeat):
            restore(work, built)
            rounds.append(resume_round(work, url, opts, i))
    report(opts, built, build_s, rounds)
    return 0


def report(
    opts: argparse.Namespace, built: dict[str, Any], build_s: float, rounds: list[dict[str, float]]
) -> None:
    def med(key: str) -> float:
        return median([r[key] for r in rounds])

    started, first, rss = med("run_started_s"), med("first_dispatch_s"), med("peak_rss_mb")
    print(
        f"resume start-up: {built['rollouts']:,} rollouts ({opts.tasks:,} tasks x {opts.repeats}), "
        f"{built['rollouts'] - opts.pending:,} done in a {built['output_mb']:.0f} MB X.jsonl, "
        f"{opts.failures:,} failed attempts, {opts.pending:,} pending; "
        f"median of {opts.repeat} (built in {build_s:.0f} s)"
    )
    print(f"  start -> run_started       {started:7.2f} s")
    print(f"  start -> first dispatch    {first:7.2f} s   (goal < {GOAL_S:.0f} s)")
    print(f"  whole resume run           {med('wall_s'):7.2f} s")
    print(f"  peak RSS                   {rss:7.1f} MB  (goal < {GOAL_MB:.0f} MB)")
    verdict = "met" if first < GOAL_S and rss < GOAL_MB else "MISSED"
    print(f"  goal {verdict}")


if __name__ == "__main__":
    raise SystemExit(main())
