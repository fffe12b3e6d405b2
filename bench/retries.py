"""Retry amplification and dead replicas (contracts §11).

1. An agent that is down for the whole delivery deadline (its only replica
   answers 503 to everything, from its own process): requests the daemon
   sent, against what the backoff schedule allows (each started rollout
   tries at most ``max_tries_within(deadline)`` times at the mean jittered
   delay). Measured with the circuit breaker off (the schedule alone) and on
   (the default: an open breaker lets one probe through per backoff).
2. Two replicas, one dead from the start: the run completes in one hop; the
   share of all attempts that went to the dead replica after its breaker
   opened (half-open probes), and the rate against a run with only the live
   replica.
Medians over ``--repeat`` rounds.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dispatcher_server, median, run_child, write_tasks

from dispatcher.delivery.retry import BackoffPolicy


def run(
    work: Path, tag: str, tasks: Path, agents: str, *extra: str, env: str = ""
) -> dict[str, Any]:
    output = work / f"{tag}.jsonl"
    args = [
        sys.executable, "-m", "dispatcher", "run", "--input", str(tasks), "--output", str(output),
        "--agent", f"sim={agents}", "--log-format", "json", "--metrics-listen", "off",
        "--fsync", "never", "--fresh", *extra,
    ]  # fmt: skip
    if env:
        args = ["env", env, *args]
    result = run_child(args, work / f"{tag}.log")
    manifest = orjson.loads((work / f"{tag}_manifest.json").read_bytes())
    return {"code": result.returncode, "wall_s": result.wall_s, **manifest["last_run"]["summary"]}


def requests_seen(url: str) -> int:
    with urllib.request.urlopen(f"{url}/stats") as answer:
        return int(orjson.loads(answer.read())["requests"])


def amplification(work: Path, opts: argparse.Namespace, breaker: bool, i: int) -> dict[str, float]:
    tasks = work / "down.jsonl"
    write_tasks(tasks, opts.rollouts)
    env = "" if breaker else "DISPATCHER_BREAKER_FAILURES=1000000"
    with dispatcher_server("sim-agent", "--fail-503", "1.0") as url:
        summary = run(
            work, f"down-{breaker}-{i}", tasks, url, "--concurrency", str(opts.rollouts),
            "--delivery-deadline-s", str(opts.deadline_s), env=env,
        )  # fmt: skip
        sent = requests_seen(url)
    started = summary["outcomes"].get("agent_request_failed", 0)
    allowed = started * BackoffPolicy().max_tries_within(opts.deadline_s)
    return {"sent": sent, "allowed": allowed, "ratio": sent / allowed, "code": summary["code"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def dead_replica(work: Path, opts: argparse.Namespace, i: int) -> dict[str, float]:
    tasks = work / "live.jsonl"
    write_tasks(tasks, opts.live_rollouts)
    dead = f"http://127.0.0.1:{free_port()}"
    latency = ("sim-agent", "--latency-s", "0.02", "--latency", "lognormal")
    with dispatcher_server(*latency) as live:
        base = run(work, f"live-{i}", tasks, live, "--concurrency", "64")
        both = run(work, f"dead-{i}", tasks, f"{dead},{live}", "--concurrency", "64")
    replicas = both["replicas"]["sim"]
    total = sum(r["sent"] for r in replicas.values())
    return {
        "code": both["code"],
        "probe_share": replicas[dead]["probes"] / total,
        "to_dead": replicas[dead]["sent"],
        "total": total,
        "rate_ratio": (base["wall_s"] / both["wall_s"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rollouts", type=int, default=50)
    parser.add_argument("--deadline-s", type=float, default=20.0)
    parser.add_argument("--live-rollouts", type=int, default=5_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    opts = parser.parse_args()
    if opts.smoke:
        opts.rollouts, opts.deadline_s, opts.live_rollouts, opts.repeat = 20, 3.0, 500, 1
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        off = [amplification(work, opts, False, i) for i in range(opts.repeat)]
        on = [amplification(work, opts, True, i) for i in range(opts.repeat)]
        dead = [dead_replica(work, opts, i) for i in range(opts.repeat)]
    print(f"agent down for the whole delivery deadline ({opts.deadline_s:g} s), "
          f"{opts.rollouts} rollouts in flight, median of {opts.repeat}")  # fmt: skip
    for name, rounds in (("breaker off", off), ("breaker on ", on)):
        print(f"  {name}: {median([r['sent'] for r in rounds]):.0f} requests sent, schedule allows "
              f"{median([r['allowed'] for r in rounds]):.0f}: ratio "
              f"{median([r['ratio'] for r in rounds]):.2f} (goal <= 1.5); "
              f"exit codes {sorted({r['code'] for r in rounds})}")  # fmt: skip
    print(f"one of two replicas dead from the start, {opts.live_rollouts} rollouts, "
          f"concurrency 64, median of {opts.repeat}")  # fmt: skip
    print(f"  attempts to the dead replica: {median([d['to_dead'] for d in dead]):.0f} of "
          f"{median([d['total'] for d in dead]):.0f}; after its breaker opened: "
          f"{100 * median([d['probe_share'] for d in dead]):.2f}% (goal < 5%); "
          f"exit codes {sorted({d['code'] for d in dead})}")  # fmt: skip
    print(f"  rate vs the live replica alone: {median([d['rate_ratio'] for d in dead]):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
