"""Step control (target_groups + overprovision) against a heavy-tailed agent.

A simulated agent whose latency is lognormal (median 250 ms, sigma 1: the
slowest 1% about ten times the median) and ``dispatcher serve`` with a pool
large enough (``--concurrency``) that the tail, not the pool, limits a step.
This script is the trainer: it reads each job's grouped stream and times
every group from the submit. Rounds alternate which job goes first.

- plain: ``--groups`` tasks × ``--repeats`` repeats, every task run: the
  step ends with its slowest group.
- target: ``--groups`` × ``--overprovision`` tasks, ``target_groups`` =
  ``--groups``: the step ends at the ``--groups``-th complete group
  (``{"end": "satisfied"}``), its tail finishing behind it.

Printed, as medians over ``--rounds``: the time to the first group and to
50%, 90% and 100% of ``--groups``; the target job's time to its last group
over the plain job's (goal: at most 0.7); and each job's tail share, the
time from 90% to 100% of the groups over the step's time.

Then, in the same sitting, per-agent quotas and the token target:

- mixed: a fast agent (lognormal, median ``--fast-median-s`` 0.1 s) and a
  slow one (median ``--slow-median-s`` 2 s), twice ``--mixed-groups`` N
  tasks of each, interleaved, ``--mixed-concurrency`` 64, every job with
  ``--overprovision``. Three jobs: the slow
  agent's tasks alone with ``target_groups`` N (its own N-group time, the
  baseline); a plain ``target_groups`` 2N over the mixed tasks (today's
  skew: whatever finishes first); ``target_groups_by_agent`` {fast: N,
  slow: N}. Printed: each one's kept mix and its time to its last group,
  as a ratio to the slow agent's own (goal for the quotas: <= 1.1, mix
  exactly N/N).
- tokens: ``target_tokens`` ``--target-tokens`` against the fast agent,
  each row reporting ``--output-tokens`` generated tokens: the tokens the
  groups of its stream (which ends at the target) hold over the target, in
  groups (goal: < 1 group over).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dispatcher_server

from dispatcher.client import AsyncClient

POINTS = (("first", 0.0), ("p50", 0.5), ("p90", 0.9), ("p100", 1.0))


def rows(job_id: str, tasks: int) -> list[dict[str, Any]]:
    return [
        {"agent_ref": {"name": "sim"}, "responses_create_params": {"input": f"{job_id} {i}"}}
        for i in range(tasks)
    ]


async def timed_step(client: AsyncClient, job_id: str, groups: int, **fields: Any) -> list[float]:
    """Submit a job and read its grouped stream: seconds from the submit to each group."""
    started = time.perf_counter()
    await client.submit(**fields, job_id=job_id)
    seen = [time.perf_counter() - started async for _ in client.results(job_id, group=True)]
    if len(seen) < groups:
        raise SystemExit(f"{job_id}: {len(seen)} groups, not {groups}")
    return seen[:groups]


def timeline(seen: list[float]) -> dict[str, float]:
    return {name: seen[max(1, math.ceil(q * len(seen))) - 1] for name, q in POINTS}


async def rounds(url: str, options: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    groups, repeats = options.groups, options.repeats
    provisioned = math.ceil(groups * options.overprovision)
    found: dict[str, list[dict[str, float]]] = {"plain": [], "target": []}
    async with AsyncClient(url) as client:
        for n in range(options.rounds):
            order = ("plain", "target") if n % 2 == 0 else ("target", "plain")
            for kind in order:
                job_id = f"{kind}-{n}"
                if kind == "plain":
                    seen = await timed_step(
                        client, job_id, groups, rows=rows(job_id, groups), num_repeats=repeats
                    )
                else:
                    seen = await timed_step(
                        client, job_id, groups, rows=rows(job_id, provisioned),
                        num_repeats=repeats, target_groups=groups,
                        overprovision=options.overprovision,
                    )  # fmt: skip
                found[kind].append(timeline(seen))
                # The target job's tail runs on: let it end before the next step starts.
                await client.wait(job_id, poll_s=0.1)
    return found


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {name: statistics.median(run[name] for run in runs) for name, _ in POINTS}


def tail_share(runs: list[dict[str, float]]) -> float:
    return statistics.median((run["p100"] - run["p90"]) / run["p100"] for run in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--groups", type=int, default=64, help="groups a step needs")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--overprovision", type=float, default=1.25)
    parser.add_argument("--concurrency", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--latency-dist", default="lognormal:0.25,1")
    parser.add_argument("--mixed-groups", type=int, default=32, help="quota of each agent")
    parser.add_argument("--mixed-concurrency", type=int, default=64)
    parser.add_argument("--fast-median-s", type=float, default=0.1)
    parser.add_argument("--slow-median-s", type=float, default=2.0)
    parser.add_argument("--mixed-sigma", type=float, default=0.5)
    parser.add_argument("--output-tokens", type=int, default=37, help="per row")
    parser.add_argument("--target-tokens", type=int, default=3000)
    parser.add_argument("--smoke", action="store_true", help="one small round")
    options = parser.parse_args()
    if options.smoke:
        options.groups, options.rounds = 16, 1
        options.mixed_groups, options.slow_median_s, options.target_tokens = 4, 0.5, 500
    agent_args = ["sim-agent", "--latency-dist", options.latency_dist, "--seed", "1"]
    with tempfile.TemporaryDirectory() as state, dispatcher_server(*agent_args) as agent:
        serve_args = [
            "serve", "--state-dir", state, "--agent", f"sim={agent}",
            "--concurrency", str(options.concurrency), "--log-level", "warning",
        ]  # fmt: skip
        with dispatcher_server(*serve_args) as url:
            found = asyncio.run(rounds(url, options))
    plain, target = medians(found["plain"]), medians(found["target"])
    print(
        f"step control: {options.groups} groups x {options.repeats} repeats, agent "
        f"{options.latency_dist}, concurrency {options.concurrency}, medians of "
        f"{options.rounds} rounds"
    )
    for kind, figures in (("plain", plain), ("target", target)):
        points = "  ".join(f"{name} {figures[name]:.2f}s" for name, _ in POINTS)
        print(f"  {kind:>6}: {points}  tail share {tail_share(found[kind]):.0%}")
    ratio = target["p100"] / plain["p100"]
    print(
        f"  time to the {options.groups}th group, target (overprovision "
        f"{options.overprovision:g}) / plain: {ratio:.2f} (goal <= 0.7)"
    )
    mixed_and_tokens(options)


def mixed_rows(groups: int) -> list[dict[str, Any]]:
    """``groups`` tasks of each agent, interleaved fast, slow, fast, ..."""
    return [
        {"agent_ref": {"name": agent}, "responses_create_params": {"input": f"{agent} {i}"}}
        for i in range(groups)
        for agent in ("fast", "slow")
    ]


async def mixed_jobs(url: str, options: argparse.Namespace) -> dict[str, tuple[float, Any]]:
    """Each job's time to its last kept group and its kept groups by agent."""
    n, repeats, over = options.mixed_groups, options.repeats, options.overprovision
    mixed = mixed_rows(2 * n)
    slow_only = [row for row in mixed if row["agent_ref"]["name"] == "slow"]
    jobs: dict[str, dict[str, Any]] = {
        "slow alone": {"rows": slow_only, "target_groups": n, "overprovision": over},
        "plain": {"rows": mixed, "target_groups": 2 * n, "overprovision": over},
        "quotas": {
            "rows": mixed,
            "target_groups_by_agent": {"fast": n, "slow": n},
            "overprovision": over,
        },
    }
    found: dict[str, tuple[float, Any]] = {}
    async with AsyncClient(url) as client:
        for name, fields in jobs.items():
            job_id = name.replace(" ", "-")
            started = time.perf_counter()
            await client.submit(**fields, job_id=job_id, num_repeats=repeats)
            kept: Counter[str] = Counter()
            async for group in client.results(job_id, group=True):
                kept[group["rows"][0]["agent_ref"]["name"]] += 1
            found[name] = (time.perf_counter() - started, kept)
            await client.wait(job_id, poll_s=0.1)
    return found


async def token_job(url: str, options: argparse.Namespace) -> tuple[int, int]:
    """The tokens of the groups a token target's stream delivers, and of one group."""
    rows = [row for row in mixed_rows(options.mixed_groups) if row["agent_ref"]["name"] == "fast"]
    async with AsyncClient(url) as client:
        await client.submit(rows=rows, job_id="tokens", num_repeats=options.repeats,
                            target_tokens=options.target_tokens)  # fmt: skip
        groups = [group async for group in client.results("tokens", group=True)]
        await client.wait("tokens", poll_s=0.1)
    tokens = [sum(row["response"]["usage"]["output_tokens"] for row in g["rows"]) for g in groups]
    return sum(tokens), tokens[0]


def mixed_and_tokens(options: argparse.Namespace) -> None:
    def agent(median_s: float) -> list[str]:
        return ["sim-agent", "--latency-dist", f"lognormal:{median_s},{options.mixed_sigma}",
                "--seed", "2", "--output-tokens", str(options.output_tokens)]  # fmt: skip

    with (
        tempfile.TemporaryDirectory() as state,
        dispatcher_server(*agent(options.fast_median_s)) as fast,
        dispatcher_server(*agent(options.slow_median_s)) as slow,
    ):
        serve_args = [
            "serve", "--state-dir", state, "--agent", f"fast={fast}", "--agent", f"slow={slow}",
            "--concurrency", str(options.mixed_concurrency), "--log-level", "warning",
        ]  # fmt: skip
        with dispatcher_server(*serve_args) as url:
            found = asyncio.run(mixed_jobs(url, options))
            kept_tokens, per_group = asyncio.run(token_job(url, options))
    n = options.mixed_groups
    print(
        f"per-agent quotas: fast lognormal:{options.fast_median_s},{options.mixed_sigma} and "
        f"slow lognormal:{options.slow_median_s},{options.mixed_sigma}, {2 * n} tasks of each x "
        f"{options.repeats} repeats, concurrency {options.mixed_concurrency}, overprovision "
        f"{options.overprovision:g}"
    )
    alone_s = found["slow alone"][0]
    for name, (seconds, kept) in found.items():
        mix = "/".join(f"{kept[a]}" for a in ("fast", "slow"))
        print(f"  {name:>10}: kept fast/slow {mix}  {seconds:.2f}s  x{seconds / alone_s:.2f}")
    print(f"  quotas' time / the slow agent's own {n}-group time: "
          f"{found['quotas'][0] / alone_s:.2f} (goal <= 1.1; mix exactly {n}/{n})")  # fmt: skip
    over = (kept_tokens - options.target_tokens) / per_group
    print(
        f"token target {options.target_tokens}: the stream's groups hold {kept_tokens} tokens, "
        f"{over:.2f} of a group ({per_group} tokens) over (goal < 1)"
    )


if __name__ == "__main__":
    main()
