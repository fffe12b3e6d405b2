"""The drop-in ``RolloutCollectionHelper`` against NeMo Gym 0.7.0's own, same loop, same agent.

A trainer's call (NeMo RL's shape): ``for f in helper.run_examples(examples,
max_resident_tasks=W): await f``, EXAMPLES examples, timed from the call to the
last result (the window), CALLS times in a row ("next call": the median of
the later calls, what every later call of a training run costs; the first
call's window is "window"), each trainer in a process of its own
(whole-process wall and CPU from ``wait4``, start-up included). Gym's helper
runs in the Gym venv of ``tests/gym/gym_env.py``, finding the agent through a
head-server stub (``_gym_collector.head_stub``); the drop-in runs on
``dispatcher serve`` (started beforehand, with ``--fsync never`` (Gym keeps
nothing), its CPU counted apart) and with a daemon of its own (no URL: its
process started at the helper's construction, its service in the first
call's window, its state in a temporary directory, so ``--fsync never``):
"own daemon" calls right after the construction, so the child's imports are
in its first window; "own, warm" first waits for them (``wait_imported``), as a trainer
whose set-up outlasts them (NeMo RL loads its model in between). The agent
is one ``dispatcher sim-agent``; each example names its own latency
(``sim_latency_s``), drawn once from the seeded ``--latency`` distribution,
so every trainer waits on the same rollouts; the trainers' order rotates
from round to round.

    .venv/bin/python bench/gym_helper.py --examples 200 --window 16 --rounds 3 --calls 2

Prints each round's figures and the medians; the ratio is the drop-in's window
over Gym's (goal: at most 1.05).
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ServeProcess, dispatcher_server, median
from _gym_collector import ROOT, head_stub

# One script for both helpers: only the import differs (and the head server).
TRAINER = """
import asyncio, json, sys, time
{import_line}

LATENCIES = {latencies}

def examples():
    return [
        # As Gym's preprocess_examples leaves them: with their identity keys.
        {{"agent_ref": {{"name": "sim"}}, "responses_create_params": {{"input": f"q{{i}}"}},
          "_ng_task_index": i, "_ng_rollout_index": 0, "sim_latency_s": latency}}
        for i, latency in enumerate(LATENCIES)
    ]

async def main():
    helper = RolloutCollectionHelper({helper_args})
    {setup}
    windows = []
    for _ in range({calls}):
        started = time.perf_counter()
        done = 0
        for future in helper.run_examples(examples(), {head}max_resident_tasks={window}):
            row, result = await future
            done += 1
        windows.append(time.perf_counter() - started)
    if hasattr(helper, "close"):
        helper.close()
    later = sorted(windows[1:])
    print(json.dumps({{"window_s": windows[0], "next_s": later[len(later) // 2], "done": done}}))

asyncio.run(main())
"""


NAMES = ("gym", "dropin", "own daemon", "own, warm")


def ideal_s(drawn: list[float], window: int) -> float:
    """The window with no overhead at all: each example starts as a slot frees."""
    slots = [0.0] * window
    for latency in drawn:
        heapq.heappush(slots, heapq.heappop(slots) + latency)
    return max(slots)


def latencies(spec: str, count: int) -> list[float]:
    """``count`` latencies drawn from ``fixed:S`` or ``lognormal:MEDIAN_S,SIGMA``, seeded."""
    kind, _, values = spec.partition(":")
    numbers = [float(v) for v in values.split(",")]
    if kind == "fixed" and len(numbers) == 1:
        return [numbers[0]] * count
    if kind == "lognormal" and len(numbers) == 2:
        rng = random.Random(1)
        return [round(rng.lognormvariate(math.log(numbers[0]), numbers[1]), 6)
                for _ in range(count)]  # fmt: skip
    raise SystemExit(f"--latency {spec!r}: expected fixed:S or lognormal:MEDIAN_S,SIGMA")


def trainer(python: Path, script: str, env: dict[str, str], cwd: Path) -> dict[str, float]:
    """Run one trainer: its window (it reports), wall and CPU (wait4) of its process tree."""
    log = cwd / "trainer.log"
    stderr = log.open("wb")
    started = time.perf_counter()
    proc = subprocess.Popen(
        [str(python), "-c", script], stdout=subprocess.PIPE, stderr=stderr,
        env=env, cwd=cwd,
    )  # fmt: skip
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    stderr.close()
    if os.waitstatus_to_exitcode(status) != 0 or not out.strip():
        tail = log.read_text(errors="replace")[-1500:]
        raise SystemExit(f"a trainer failed: exit {os.waitstatus_to_exitcode(status)}\n{tail}")
    report = orjson.loads(out.strip().splitlines()[-1])
    cpu = usage.ru_utime + usage.ru_stime
    return {"window_s": report["window_s"], "next_s": report["next_s"], "wall_s": wall,
            "cpu_s": cpu, "done": report["done"]}  # fmt: skip


def main() -> int:
    args = parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.gym import gym_env

    venv = gym_env.ready_venv()
    if venv is None:
        print("NeMo Gym venv not ready (python3 tests/gym/gym_env.py): nothing to compare")
        return 0
    drawn = latencies(args.latency, args.examples)
    fill = {"latencies": repr(drawn), "window": args.window, "calls": args.calls}
    print(f"ideal window {ideal_s(drawn, args.window):.3f} s (the agent's latencies alone, "
          f"{args.window} slots, each refilled at once)")  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in NAMES}
    # Each example names its latency (sim_latency_s): the agent's own is a floor of 0.
    agent_flags = ("sim-agent", "--latency-dist", "fixed:0", "--seed", "1")
    with (
        tempfile.TemporaryDirectory() as tmp,
        dispatcher_server(*agent_flags) as agent,
        head_stub(agent) as head,
    ):
        scripts = head_scripts(*head.address, fill)
        for i in range(args.rounds):
            this = one_round(i, Path(tmp), agent, venv, scripts, fill)
            for name, one in this.items():
                runs[name].append(one)
    medians = {name: {k: median([r[k] for r in rs]) for k in rs[0]} for name, rs in runs.items()}
    report(f"median of {args.rounds}", medians)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency", default="lognormal:0.05,0.5")
    parser.add_argument("--calls", type=int, default=2, help="calls a trainer makes (>= 2)")
    args = parser.parse_args()
    if args.calls < 2:
        parser.error("--calls: at least 2 (the first call, then later ones)")
    return args


def head_scripts(host: str, port: int, fill: dict[str, Any]) -> dict[str, str]:
    """The trainers that find their agents through Gym's head server: Gym's helper,
    the drop-in with a daemon of its own, and the same once its imports are done."""
    head_arg = f"head_server_config=BaseServerConfig(host={host!r}, port={port}), "
    own = {
        "import_line": "from dispatcher.client.gym import RolloutCollectionHelper\n"
        "from types import SimpleNamespace as BaseServerConfig",
        "helper_args": "", "head": head_arg, **fill,
    }  # fmt: skip
    gym = TRAINER.format(
        import_line="from nemo_gym.rollout_collection import RolloutCollectionHelper\n"
        "from nemo_gym.config_types import BaseServerConfig",
        helper_args="", head=head_arg, setup="", **fill,
    )  # fmt: skip
    return {
        "gym": gym,
        "own daemon": TRAINER.format(setup="", **own),
        # A trainer whose set-up outlasts the daemon's imports (NeMo RL's: its
        # model loads between the helper's construction and its first call).
        "own, warm": TRAINER.format(setup="helper.daemon.wait_imported(120)", **own),
    }


def one_round(
    i: int, work: Path, agent: str, venv: Path, scripts: dict[str, str], fill: dict[str, Any]
) -> dict[str, dict[str, float]]:
    """Every trainer once, in an order that turns with ``i``, beside a fresh daemon."""
    env = {k: v for k, v in os.environ.items() if k != "DISPATCHER_URL"}
    env["PYTHONPATH"] = str(ROOT)
    (work / f"serve-{i}").mkdir()
    serve = ServeProcess(work / f"serve-{i}", "--agent", f"sim={agent}",
                         "--fsync", "never")  # fmt: skip
    url_script = TRAINER.format(
        import_line="from dispatcher.client.gym import RolloutCollectionHelper",
        helper_args=repr(serve.url),
        head="",
        setup="",
        **fill,
    )
    # No DISPATCHER_STATE: a temporary directory, as a trainer leaves it.
    own_env = {k: v for k, v in env.items() if k != "DISPATCHER_STATE"}
    python = Path(sys.executable)
    trainers = {
        "gym": (venv / "bin" / "python", scripts["gym"], env),
        "dropin": (python, url_script, env),
        "own daemon": (python, scripts["own daemon"], own_env),
        "own, warm": (python, scripts["own, warm"], own_env),
    }
    names = list(trainers)
    order = names[i % len(names) :] + names[: i % len(names)]
    figures = {name: trainer(*trainers[name], work) for name in order}
    serve.stop()
    this = {name: figures[name] for name in names}
    report(f"round {i + 1} (in the order {', '.join(order)})", this)
    return this


def report(title: str, figures: dict[str, dict[str, float]]) -> None:
    gym = figures["gym"]
    print(title)
    for name, fig in figures.items():
        print(
            f"  {name:10} window {fig['window_s']:6.2f} s ({fig['window_s'] / gym['window_s']:.3f}x"
            f" Gym), next call {fig['next_s']:6.2f} s ({fig['next_s'] / gym['next_s']:.3f}x Gym)"
            f"  whole process {fig['wall_s']:6.2f} s, CPU {fig['cpu_s']:5.2f} s"
            f"  ({int(fig['done'])} results a call)"
        )


if __name__ == "__main__":
    raise SystemExit(main())
