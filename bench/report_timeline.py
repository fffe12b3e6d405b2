"""``dispatcher report`` on a big run: seconds and peak memory, text and ``--html``.

Writes a run of ``--rows`` attempts (default 1,000,000) spread over
``--span-h`` hours, on ``--agents`` agents of ``--replicas`` replicas each,
``--failure-share`` of them failed (three classes), each success row carrying
an answer of about ``--row-bytes`` bytes, as a real run's files look. Then
times, each in its own process:

  * ``report X.jsonl``: the text report, with its timeline;
  * ``report X.jsonl --html F``: the same and the page (matplotlib);
  * the baseline: one ``orjson.loads`` of every line of the two files, the
    least any report that parses its rows whole would cost.

Figures are medians over ``--repeat`` rounds: wall and CPU seconds, peak RSS
(``wait4``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import run_child

T0 = 1_800_000_000.0
CLASSES = ("agent_run_error", "timeout_exceeded", "protocol_violation")
FULL_PARSE = """
import sys, orjson
for name in sys.argv[1:]:
    with open(name, "rb") as f:
        for line in f:
            orjson.loads(line)
"""


def write_run(work: Path, opts: argparse.Namespace) -> Path:
    rng = random.Random(0)
    output = work / "x.jsonl"
    answer = "x" * opts.row_bytes
    span_s = opts.span_h * 3600
    with (
        output.open("wb") as ok,
        (work / "x_failures.jsonl").open("wb") as failed,
        (work / "x_materialized_inputs.jsonl").open("wb") as inputs,
    ):
        for i in range(opts.rows):
            row, stamp = attempt(i, rng, opts, span_s)
            inputs.write(
                orjson.dumps({"responses_create_params": {"input": f"q{i}"}, **row}) + b"\n"
            )
            if rng.random() < opts.failure_share:
                cls = CLASSES[rng.randrange(len(CLASSES))]
                failure = {**row, "_ng_failure_class": cls, "_ng_failure_terminal": True}
                failed.write(orjson.dumps({**failure, "_ng_dispatch": stamp}) + b"\n")
            else:
                answered = {"response": {"output_text": answer}, "reward": 1.0, **row}
                ok.write(orjson.dumps({**answered, "_ng_dispatch": stamp}) + b"\n")
    return output


def attempt(
    i: int, rng: random.Random, opts: argparse.Namespace, span_s: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Attempt ``i``'s row (its agent, task, rollout) and its ``_ng_dispatch`` stamp
    (a replica of the agent, its start in the span, its duration)."""
    agent = f"agent{i % opts.agents}"
    replica = f"http://10.0.{i % opts.agents}.{rng.randrange(opts.replicas)}:8000"
    started = T0 + span_s * i / opts.rows
    # Latency rises and throughput falls in the middle hour: something to see.
    slow = 3.0 if abs(i / opts.rows - 0.5) < 0.05 else 1.0
    stamp = {
        "replica": replica,
        "started_at": started,
        "duration_s": slow * rng.lognormvariate(2, 0.6),
    }
    row = {"agent_ref": {"name": agent}, "_ng_task_index": i, "_ng_rollout_index": 0}
    return row, stamp


def timed(args: list[str], stderr_path: Path) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and peak RSS (MB) of one child process (the CPU time
    says more than the wall time on a shared machine)."""
    child = run_child(args, stderr_path)
    if child.returncode != 0:
        raise SystemExit(f"{args[3:]} failed: {child.stderr.decode()[-2000:]}")
    return child.wall_s, child.cpu_s, child.peak_rss_mb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--span-h", type=float, default=6.0)
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--failure-share", type=float, default=0.03)
    parser.add_argument("--row-bytes", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="10,000 rows, one round")
    opts = parser.parse_args()
    if opts.smoke:
        opts.rows, opts.repeat = 10_000, 1
    with tempfile.TemporaryDirectory(prefix="report-bench-") as tmp:
        work = Path(tmp)
        output = write_run(work, opts)
        size_mb = sum(p.stat().st_size for p in work.iterdir()) / 1e6
        print(f"{opts.rows:,} attempts over {opts.span_h:g} h, files {size_mb:.0f} MB")
        report = [sys.executable, "-m", "dispatcher", "report", str(output)]
        variants = {
            "report (text, with its timeline)": report,
            "report --html": [*report, "--html", str(work / "report.html")],
            "baseline: orjson.loads of every line": [
                sys.executable, "-c", FULL_PARSE, str(output), str(work / "x_failures.jsonl"),
            ],
        }  # fmt: skip
        for name, args in variants.items():
            runs = [timed(args, work / "stderr.log") for _ in range(opts.repeat)]
            wall, cpu, rss = (statistics.median(r[k] for r in runs) for k in range(3))
            print(f"  {name:38s} {wall:7.2f} s, CPU {cpu:6.2f} s, peak RSS {rss:5.0f} MB")
        page = (work / "report.html").stat().st_size / 1e3
        print(f"  the page: {page:.0f} KB")


if __name__ == "__main__":
    main()
