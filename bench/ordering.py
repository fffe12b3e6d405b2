"""The start order: a job's makespan, longest expected first against input order.

``--tasks`` tasks × ``--repeats`` repeats against a simulated agent: each
task's mean latency is lognormal across tasks (median ``--median-s``, sigma
``--task-sigma``; the row's ``sim_latency_s``), its repeats lognormal around
it (sigma ``--repeat-sigma``). ``dispatcher run`` with ``--concurrency``
runs the same tasks twice (two epochs, two outputs in one directory): the
second epoch has the first's task history. Each round runs both epochs in
input order (the baseline, no history) and in the start order (a fresh
history), alternating which goes first.

Printed, as medians over ``--rounds``: each epoch's makespan (the run's
dispatch time, and the whole process beside it) over input order's (goals:
epoch 1 at most 0.9, epoch 2 at most 0.8), and the start order's estimate
error (median |ln(actual / expected)|) in epoch 2.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dispatcher_server, run_child


def write_tasks(path: Path, tasks: int, median_s: float, sigma: float, seed: int) -> None:
    rng = random.Random(seed)
    with path.open("wb") as f:
        for i in range(tasks):
            latency_s = median_s * rng.lognormvariate(0.0, sigma)
            row = {
                "agent_ref": {"name": "sim"},
                "responses_create_params": {"input": f"task {i}"},
                "sim_latency_s": round(latency_s, 6),
            }
            f.write(orjson.dumps(row) + b"\n")


def one_epoch(
    folder: Path, tasks: Path, epoch: int, url: str, order: str, options: argparse.Namespace
) -> dict[str, Any]:
    output = folder / f"epoch{epoch}.jsonl"
    args = [
        sys.executable, "-m", "dispatcher", "run", "--input", str(tasks),
        "--output", str(output), "--agent", f"sim={url}",
        "--num-repeats", str(options.repeats), "--concurrency", str(options.concurrency),
        "--metrics-listen", "off", "--log-format", "json", "--fsync", "never",
        "--start-order", order,
    ]  # fmt: skip
    child = run_child(args, folder / f"epoch{epoch}.log")
    if child.returncode != 0:
        raise SystemExit(
            f"{order} epoch {epoch}: exit {child.returncode}\n{child.stderr[-2000:]!r}"
        )
    summary = child.events("run_summary")[-1]
    error = (summary.get("start_order") or {}).get("estimate_error_median")
    return {"dispatch_s": summary["dispatch_s"], "wall_s": child.wall_s, "error": error}


def both_epochs(
    root: Path, tasks: Path, url: str, order: str, options: argparse.Namespace
) -> list[dict[str, Any]]:
    folder = Path(tempfile.mkdtemp(dir=root, prefix=f"{order}-"))
    return [one_epoch(folder, tasks, epoch, url, order, options) for epoch in (1, 2)]


def parse_options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--median-s", type=float, default=0.5)
    parser.add_argument("--task-sigma", type=float, default=1.0)
    parser.add_argument("--repeat-sigma", type=float, default=0.2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="one small round")
    options = parser.parse_args()
    if options.smoke:
        options.tasks, options.repeats, options.concurrency, options.rounds = 32, 4, 32, 1
        options.median_s = 0.02
    return options


Runs = dict[str, list[dict[str, Any]]]  # each order's two epochs


@dataclass
class Figures:
    """Each round's makespans in the start order over input order's, and epoch 2's error."""

    ratios: dict[str, list[float]] = field(
        default_factory=lambda: {"e1": [], "e2": [], "e1_wall": [], "e2_wall": []}
    )
    errors: list[float] = field(default_factory=list)

    def add(self, runs: Runs) -> None:
        for epoch in (1, 2):
            base, ordered = runs["input"][epoch - 1], runs["longest"][epoch - 1]
            self.ratios[f"e{epoch}"].append(ordered["dispatch_s"] / base["dispatch_s"])
            self.ratios[f"e{epoch}_wall"].append(ordered["wall_s"] / base["wall_s"])
        if runs["longest"][1]["error"] is not None:
            self.errors.append(runs["longest"][1]["error"])

    def print_medians(self, options: argparse.Namespace) -> None:
        med = {k: statistics.median(v) for k, v in self.ratios.items()}
        print(
            f"{options.tasks} tasks x {options.repeats} repeats, "
            f"concurrency {options.concurrency}, median {options.median_s} s, "
            f"sigma {options.task_sigma} between tasks and "
            f"{options.repeat_sigma} between repeats; medians over {options.rounds} rounds"
        )
        for epoch, goal in ((1, 0.9), (2, 0.8)):
            print(
                f"epoch {epoch} makespan, longest first / input order: {med[f'e{epoch}']:.3f} "
                f"(whole process {med[f'e{epoch}_wall']:.3f}; goal <= {goal})"
            )
        if self.errors:
            print(
                "epoch 2 estimate error, median |ln(actual/expected)|: "
                f"{statistics.median(self.errors):.3f}"
            )


def print_round(round_: int, runs: Runs) -> None:
    print(
        f"round {round_ + 1}: dispatch s input {runs['input'][0]['dispatch_s']:.2f}"
        f"/{runs['input'][1]['dispatch_s']:.2f}, longest "
        f"{runs['longest'][0]['dispatch_s']:.2f}/{runs['longest'][1]['dispatch_s']:.2f}"
    )


def main() -> None:
    options = parse_options()
    figures = Figures()
    with (
        tempfile.TemporaryDirectory() as tmp,
        dispatcher_server(
            "sim-agent", "--latency", "lognormal", "--latency-sigma", str(options.repeat_sigma)
        ) as url,
    ):
        root = Path(tmp)
        tasks = root / "tasks.jsonl"
        write_tasks(tasks, options.tasks, options.median_s, options.task_sigma, options.seed)
        for round_ in range(options.rounds):
            orders = ["input", "longest"] if round_ % 2 == 0 else ["longest", "input"]
            runs = {order: both_epochs(root, tasks, url, order, options) for order in orders}
            figures.add(runs)
            print_round(round_, runs)
    figures.print_medians(options)


if __name__ == "__main__":
    main()
