"""CPU a ``python -m dispatcher COMMAND`` process spends before and around its work.

The test suite and users start hundreds of short ``dispatcher`` processes
(``run`` that stops at a config check or runs a few rollouts, ``status``,
``validate``); most of their CPU is start-up, mostly imports. The last case
is a whole ``run`` of one rollout against a ``sim-agent`` (in its own process,
started once). Each command is run ``--runs`` times, the commands
interleaved round by round so a change in the machine's load touches them
alike. The baseline, measured in the same rounds, is a bare interpreter
importing the libraries the dispatcher cannot start without::

    python -c "import aiohttp, pydantic, structlog, prometheus_client, uvloop"

The package is byte-compiled first, as ``pip install`` and ``make test`` leave
it: otherwise each child would compile every module it imports (with
``PYTHONDONTWRITEBYTECODE`` set, every time). Prints, per command, the median
wall time, the median CPU time (user + sys of the child, from ``wait4``) and the
CPU ratio to the baseline.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import compile_package, dispatcher_server, median, run_child

BASELINE_IMPORTS = "import aiohttp, pydantic, structlog, prometheus_client, uvloop"
DEAD_AGENT = "a=http://127.0.0.1:9"  # the discard port: refused at once


@dataclass
class Case:
    name: str
    args: list[str]
    returncode: int
    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)


def cases(work: Path, agent_url: str) -> list[Case]:
    tasks = work / "tasks.jsonl"
    tasks.write_text('{"agent_ref": {"name": "a"}, "responses_create_params": {"input": "hi"}}\n')
    dispatcher = [sys.executable, "-m", "dispatcher"]
    run_flags = ["--input", str(tasks), "--output", str(work / "out" / "x.jsonl")]
    whole_run = [
        "--input", str(tasks), "--output", str(work / "ok" / "x.jsonl"),
        "--agent", f"a={agent_url}", "--metrics-listen", "off", "--log-format", "json", "--fresh",
    ]  # fmt: skip
    return [
        Case("baseline (imports only)", [sys.executable, "-c", BASELINE_IMPORTS], 0),
        Case("dispatcher --version", [*dispatcher, "--version"], 0),
        Case("dispatcher --help", [*dispatcher, "--help"], 0),
        Case(
            "run (config error)",
            [*dispatcher, "run", *run_flags, "--agent", DEAD_AGENT, "--default-agent", "nope"],
            2,
        ),
        Case(
            "validate (1 row, dead agent)",
            [*dispatcher, "validate", *run_flags, "--agent", DEAD_AGENT],
            2,
        ),
        Case("status (missing run)", [*dispatcher, "status", str(work / "missing" / "x.jsonl")], 2),
        Case("run (1 rollout, sim agent)", [*dispatcher, "run", *whole_run], 0),
    ]


def measure(all_cases: list[Case], runs: int, work: Path) -> None:
    for _ in range(runs):
        for case in all_cases:
            child = run_child(case.args, work / "stderr.log")
            if child.returncode != case.returncode:
                raise SystemExit(
                    f"{case.name}: exit {child.returncode}, expected {case.returncode}:\n"
                    + child.stderr.decode(errors="replace")
                )
            case.walls.append(child.wall_s)
            case.cpus.append(child.cpu_s)


def report(all_cases: list[Case], runs: int) -> None:
    baseline_cpu = median(all_cases[0].cpus)
    print(f"{runs} runs each, medians; CPU = user + sys of the child process")
    print(f"{'command':<30} {'wall ms':>8} {'CPU ms':>8} {'CPU / baseline':>15}")
    for case in all_cases:
        cpu = median(case.cpus)
        print(
            f"{case.name:<30} {median(case.walls) * 1e3:>8.0f} {cpu * 1e3:>8.0f} "
            f"{cpu / baseline_cpu:>15.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of each command (default 20)")
    parser.add_argument("--smoke", action="store_true", help="3 runs each: checks the script works")
    opts = parser.parse_args()
    runs = 3 if opts.smoke else opts.runs
    compile_package()
    with (
        tempfile.TemporaryDirectory(prefix="cli-startup-") as tmp,
        dispatcher_server("sim-agent") as agent_url,
    ):
        work = Path(tmp)
        all_cases = cases(work, agent_url)
        measure(all_cases, runs, work)
    report(all_cases, runs)


if __name__ == "__main__":
    main()
