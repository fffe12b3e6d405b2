"""What finished jobs cost a daemon that runs for days: its RSS across rounds of jobs.

Everything runs in its own process: a simulated agent (no latency),
``dispatcher serve``, and this script as the trainer. Each round submits
``--jobs`` jobs of ``--rows`` rows at once and reads each one's grouped
results stream (``group=true&wait=true``) to its end line; the daemon's
resident memory (VmRSS, from /proc) is read once every stream of the round
has ended, so each job of the round is final, and again after ``--idle-s`` (a
trainer's weight update between steps; the daemon hands freed heap memory back
to the system within a second or so of a job's end).

A daemon that keeps nothing of a final job's rows stays flat after the first
round (which pays for the allocator's pools, the imports' first use and the
like). Printed: a table of RSS by round, and the bytes the daemon grew by per
row finished after round 1 (the goal is at most 60).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ServeProcess, consume, dispatcher_server
from service import submit

GOAL_BYTES_PER_ROW = 60


def start_daemon(work: Path, agent: str, concurrency: int) -> ServeProcess:
    """``dispatcher serve`` on the simulated agent, its log in ``work/serve.log``."""
    return ServeProcess(
        work, "--agent", f"sim={agent}", "--concurrency", str(concurrency), "--log-format", "json"
    )


async def one_job(http: aiohttp.ClientSession, url: str, job_id: str, rows: int) -> int:
    """Submit a job of ``rows`` rows and read its grouped stream to the end: its rows."""
    tasks = [{"agent_ref": {"name": "sim"}, "prompt": f"{job_id} task {i}"} for i in range(rows)]
    body: dict[str, Any] = {"job_id": job_id, "rows": tasks}
    await submit(http, url, body)
    groups, got = await consume(http, url, job_id)
    if got != rows:
        raise SystemExit(f"{job_id}: {got} rows of {rows} ({groups} groups)")
    return got


async def rounds(
    daemon: ServeProcess, count: int, jobs: int, rows: int, idle_s: float
) -> list[tuple[int, float, float]]:
    """Each round's jobs at once, read to their end: (rows finished so far, RSS MB at the
    end, RSS MB after ``idle_s``)."""
    samples: list[tuple[int, float, float]] = []
    finished = 0
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for n in range(1, count + 1):
            names = [f"round{n}-job{j}" for j in range(jobs)]
            got = await asyncio.gather(*(one_job(http, daemon.url, name, rows) for name in names))
            finished += sum(got)
            at_end = daemon.rss_mb()
            await asyncio.sleep(idle_s)
            samples.append((finished, at_end, daemon.rss_mb()))
    return samples


def table(samples: list[tuple[int, float, float]]) -> str:
    """RSS by round (at the round's end and after the idle), and the growth per row
    finished since round 1 (after the idle)."""
    first_rows, _, first_mb = samples[0]
    lines = [
        "round  rows finished  RSS MB at end  RSS MB idle  since round 1 MB  "
        "B per row since round 1"
    ]
    for n, (finished, at_end, mb) in enumerate(samples, start=1):
        grown = mb - first_mb
        per_row = grown * 1024 * 1024 / (finished - first_rows) if n > 1 else None
        shown = "" if per_row is None else f"{per_row:.1f}"
        lines.append(
            f"{n:>5}  {finished:>13,}  {at_end:>13.1f}  {mb:>11.1f}  {grown:>16.1f}  {shown:>23}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=10, help="jobs per round, at once")
    parser.add_argument("--rows", type=int, default=5_000, help="rows per job")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument(
        "--idle-s", type=float, default=2.0, help="the pause after each round (default 2)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.rows, args.idle_s = 4, 100, 0.0
    with (
        tempfile.TemporaryDirectory() as folder,
        dispatcher_server("sim-agent", "--latency-s", "0") as agent,
    ):
        daemon = start_daemon(Path(folder), agent, args.concurrency)
        try:
            samples = asyncio.run(rounds(daemon, args.rounds, args.jobs, args.rows, args.idle_s))
        finally:
            code = daemon.stop()
    print(
        f"settled jobs: {args.rounds} rounds of {args.jobs} jobs x {args.rows:,} rows at once, "
        f"each read to its end (--concurrency {args.concurrency}), then {args.idle_s:g} s idle"
    )
    print(table(samples))
    if len(samples) > 1:
        (first_rows, _, first_mb), (last_rows, _, last_mb) = samples[0], samples[-1]
        per_row = (last_mb - first_mb) * 1024 * 1024 / (last_rows - first_rows)
        verdict = "within" if per_row <= GOAL_BYTES_PER_ROW else "over"
        print(f"  after round 1: {per_row:.1f} B per finished row ({verdict} the goal of "
              f"{GOAL_BYTES_PER_ROW})")  # fmt: skip
    print(f"dispatcher serve exit code after SIGTERM: {code}")


if __name__ == "__main__":
    main()
