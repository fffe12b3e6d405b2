"""Many small jobs, as a trainer that calls the service once per prompt group submits
them: what 100,000 settled jobs cost the daemon.

Everything runs in its own process: a simulated agent, ``dispatcher serve`` and
this script as the trainer. The agent answers at once by default: the daemon is
the bottleneck, busy every moment, which is what its costs are measured under.
A real agent takes seconds (``--agent-latency lognormal:0.5,1``): the daemon is
then not the bottleneck, as in a training run, and the submit latency is what a
trainer sees there. ``--clients`` client
sessions each keep ``--per-client`` prompt groups going at once: a job of one
prompt × ``--repeats`` repeats is submitted (its submit latency timed), then its
grouped results stream read to its end line, then the next. Printed:

- the daemon's resident memory (VmRSS) once ``--first`` jobs are done and once
  all ``--jobs`` are, and their ratio (goal ≤ 1.2): settled jobs cost nothing;
- the state directory's entries: ``jobs/``, ``archive/`` and every file under
  it, against ``--retain-settled-jobs`` (one archive per that many settled jobs);
- submit latency p50 / p99 over every job (goal p99 ≤ 20 ms), as the trainer
  times it and as the daemon does (``/status``: from its handler's start to its
  answer), and the trainer's own event-loop lag: what of a submit's time is
  the daemon's, and what the trainer's loop, busy reading streams, adds;
- the delay from a group's last row being durable to the group on its stream
  (the daemon's own, ``/status``): its line's write and fsync, and the stream;
- a restart on the same state directory (SIGTERM, then the same command): the
  seconds from the new process's start to the first row of a new job read
  back (goal ≤ 5 s), an upper bound on the time to its first dispatch;
- the first job, long since archived, still answering its status and results;
- the RSS curve's slope over its second half (KB a job) and the RSS it leads to
  at job 100,000.

``--stop-after-s`` bounds the run: no job is submitted after it, and the figures
are for the jobs done; ``--restart-on N`` times the restart on N settled jobs
whatever ran (archived copies of the first job make up the difference).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import LoopLag, ServeProcess, compile_package, consume, dispatcher_server

from dispatcher.latency.quantile import quantile
from dispatcher.serve.archive import Archive, Folded
from dispatcher.serve.registry import Registry

JSON_TYPE = {"Content-Type": "application/json"}
GOAL_RSS_RATIO = 1.2
GOAL_SUBMIT_P99_S = 0.020
GOAL_RESTART_S = 5.0
GOAL_JOBS = 100_000


def start_daemon(work: Path, agent: str, args: argparse.Namespace) -> ServeProcess:
    return ServeProcess(
        work, "--agent", f"sim={agent}", "--concurrency", str(args.concurrency),
        "--retain-settled-jobs", str(args.retain), "--log-format", "json",
        "--log-level", "warning", "--fsync", args.fsync, *args.serve_arg,
    )  # fmt: skip


def body(job_id: str, repeats: int) -> bytes:
    row = {"agent_ref": {"name": "sim"}, "responses_create_params": {"input": job_id}}
    return orjson.dumps({"job_id": job_id, "rows": [row], "num_repeats": repeats})


class Trainer:
    """The clients: sessions that submit prompt groups and read each one to its end."""

    def __init__(self, url: str, args: argparse.Namespace, rss: Any) -> None:
        self.url = url
        self.args = args
        # The daemon's resident memory now (MB), for the progress lines.
        self.rss = rss
        self.started = time.perf_counter()
        self.numbers = itertools.count()
        self.done = 0
        self.submit_s: list[float] = []
        # The numbers of the jobs whose submit took longer than the goal.
        self.slow: list[int] = []
        # The submit times of the first clients x per-client jobs (sent at once).
        self.first_burst: list[float] = []
        self.lag = LoopLag()
        self.at_first: asyncio.Event = asyncio.Event()
        # (jobs done, the daemon's RSS in MB) at every ``--every`` jobs: the curve.
        self.curve: list[tuple[int, float]] = []
        # Where the submits since the last progress line start in ``submit_s``.
        self.window_start = 0
        # No job is submitted after this instant (``--stop-after-s``).
        self.stop_at = self.started + (args.stop_after_s or float("inf"))

    async def run(self, on_first: Any) -> float:
        """Every job, at ``clients`` × ``per_client`` at once; seconds it took."""
        started = time.perf_counter()
        watcher = asyncio.create_task(self._first(on_first))
        async with self.lag:
            await asyncio.gather(*(self._client() for _ in range(self.args.clients)))
        await watcher
        return time.perf_counter() - started

    async def _first(self, on_first: Any) -> None:
        await self.at_first.wait()
        on_first()

    async def _client(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            await asyncio.gather(*(self._groups(http) for _ in range(self.args.per_client)))

    async def _groups(self, http: aiohttp.ClientSession) -> None:
        while time.perf_counter() < self.stop_at and (n := next(self.numbers)) < self.args.jobs:
            job_id = f"group-{n}"
            started = time.perf_counter()
            async with http.post(f"{self.url}/v1/jobs", data=body(job_id, self.args.repeats),
                                 headers=JSON_TYPE) as r:  # fmt: skip
                if r.status != 201:
                    raise SystemExit(f"submit {job_id}: {r.status} {await r.text()}")
            self.submit_s.append(time.perf_counter() - started)
            if self.submit_s[-1] > GOAL_SUBMIT_P99_S:
                self.slow.append(n)
            if n < self.args.clients * self.args.per_client:
                self.first_burst.append(self.submit_s[-1])
            rows = (await consume(http, self.url, job_id))[1]
            if rows != self.args.repeats:
                raise SystemExit(f"{job_id}: {rows} rows of {self.args.repeats}")
            self.done += 1
            if self.done == self.args.first:
                self.at_first.set()
            if self.done % self.args.every == 0:
                self._progress()
        if self.done < self.args.first:
            self.at_first.set()

    def _progress(self) -> None:
        """A progress line: the rate and RSS so far, and the submits since the last line
        (their p99 and how many missed the goal) beside the machine's load."""
        rate = self.done / (time.perf_counter() - self.started)
        self.curve.append((self.done, self.rss()))
        window = sorted(self.submit_s[self.window_start :])
        self.window_start = len(self.submit_s)
        p99 = (quantile(window, 0.99) or 0.0) * 1000
        over = sum(s > GOAL_SUBMIT_P99_S for s in window)
        print(f"  ... {self.done:,} jobs done, {rate:,.0f} jobs/s, daemon RSS "
              f"{self.curve[-1][1]:.1f} MB; since the last line: submit p99 {p99:.1f} ms, "
              f"{over:,} of {len(window):,} over 20 ms, load {os.getloadavg()[0]:.1f}",
              flush=True)  # fmt: skip


async def folds_done(url: str, archived: int, timeout_s: float = 300) -> None:
    """Until the daemon's ``/status`` counts ``archived`` jobs archived."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            async with http.get(f"{url}/status") as r:
                if (await r.json())["jobs_archived"] >= archived:
                    return
            await asyncio.sleep(0.1)
    raise SystemExit(f"fewer than {archived} jobs archived after {timeout_s:g} s")


async def daemon_view(url: str) -> list[str]:
    """The daemon's ``/status``: its event-loop lag (how late a task that slept woke:
    the longest loop steps, which every submit waits behind), its own submit
    times (its handler's start to its answer) and its grouped streams' delay."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/status") as r:
        status = await r.json()
    p99, top = status.get("event_loop_lag_p99_s"), status.get("event_loop_lag_max_s")
    lines = ["daemon event-loop lag: not measured"]
    if p99 is not None and top is not None:
        lines = [f"daemon event-loop lag: p99 {p99 * 1000:.1f} ms, max {top * 1000:.1f} ms"]
    submit = status.get("submit_s") or {}
    if submit.get("p99") is not None:
        lines.append(
            f"submit latency, the daemon's own (handler to answer, last 10,000): p50 "
            f"{submit['p50'] * 1000:.1f} ms, p99 {submit['p99'] * 1000:.1f} ms"
        )
    delay = status.get("results_delay_s") or {}
    if delay.get("p99") is not None:
        lines.append(
            f"group durable (its last row) -> on its stream, the daemon's (last 10,000): p50 "
            f"{delay['p50'] * 1000:.1f} ms, p99 {delay['p99'] * 1000:.1f} ms"
        )
    return lines


def entries(state: Path) -> dict[str, int]:
    """Entries of ``jobs/`` and ``archive/``, and every file under the state directory."""
    files = sum(len(names) for _, _, names in os.walk(state))
    return {
        "jobs/": len(os.listdir(state / "jobs")),
        "archive/": len(os.listdir(state / "archive")),
        "files": files,
    }


async def restart_to_first_row(
    work: Path, agent: str, args: argparse.Namespace
) -> tuple[ServeProcess, float]:
    """A new daemon on the state directory; seconds from its start to a new job's first
    row read back (the submit retried while it reads its registry: 503)."""
    started = time.perf_counter()
    daemon = await asyncio.to_thread(start_daemon, work, agent, args)
    async with aiohttp.ClientSession() as http:
        while True:
            data = body("after-restart", 1)
            async with http.post(f"{daemon.url}/v1/jobs", data=data, headers=JSON_TYPE) as r:
                if r.status == 201:
                    break
                if r.status != 503:
                    raise SystemExit(f"submit after restart: {r.status} {await r.text()}")
            await asyncio.sleep(0.01)
        params = {"group": "true", "wait": "true"}
        async with http.get(f"{daemon.url}/v1/jobs/after-restart/results", params=params) as r:
            await r.content.readline()
    return daemon, time.perf_counter() - started


async def archived_answers(url: str, job_id: str, repeats: int) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/v1/jobs/{job_id}") as r:
            status = await r.json()
        rows = (await consume(http, url, job_id))[1]
    where = status.get("archive", "its own folder")
    ok = status["state"] == "done" and rows == repeats
    verdict = "ok" if ok else "WRONG"
    return f"{job_id}: state {status['state']}, {rows} rows streamed, from {where} ({verdict})"


async def measure(work: Path, agent: str, args: argparse.Namespace) -> None:
    daemon = await asyncio.to_thread(start_daemon, work, agent, args)
    trainer = Trainer(daemon.url, args, daemon.rss_mb)
    rss: dict[str, float] = {}
    cpu_before = daemon.cpu_s()

    def on_first() -> None:
        # Printed as it is taken: a run cut later still shows its baseline.
        rss["first"] = daemon.rss_mb()
        print(f"  ... after job {args.first:,}: daemon RSS {rss['first']:.1f} MB", flush=True)

    seconds = await trainer.run(on_first)
    if trainer.done < args.jobs:
        print(f"--stop-after-s {args.stop_after_s:g}: {trainer.done:,} jobs of {args.jobs:,} "
              "done; the figures below are for them")  # fmt: skip
        args.jobs = trainer.done
    if args.restart_on:
        args.add_archived = max(0, args.restart_on - args.jobs)
    cpu_ms = (daemon.cpu_s() - cpu_before) / args.jobs * 1000
    view = await daemon_view(daemon.url)
    # A fold runs once a window is full: the last one may still be writing.
    await folds_done(daemon.url, args.jobs // args.retain * args.retain)
    rss["last"] = daemon.rss_mb()
    counts = entries(work / "state")
    ordered = sorted(trainer.submit_s)
    p50, p99 = quantile(ordered, 0.5) or 0.0, quantile(ordered, 0.99) or 0.0
    answer_before = await archived_answers(daemon.url, "group-0", args.repeats)
    code = await asyncio.to_thread(daemon.stop)
    restart_s, restart_rss, answer_after = await time_the_restart(work, agent, args)
    report(args, seconds, rss, counts, (p50, p99), restart_s, restart_rss, code)
    print(f"daemon CPU (user + system, every thread) per job: {cpu_ms:.1f} ms")
    print("\n".join(view))
    lag = trainer.lag
    print(f"the trainer's own event-loop lag: p99 {lag.quantile(0.99) * 1000:.1f} ms, max "
          f"{lag.max * 1000:.1f} ms")  # fmt: skip
    print(slope(trainer.curve, rss["first"], args))
    burst = args.clients * args.per_client
    first = sum(1 for n in trainer.slow if n < burst)
    print(f"submits over {GOAL_SUBMIT_P99_S * 1000:.0f} ms: {len(trainer.slow):,} of "
          f"{args.jobs:,}; {first} of them among the first {burst} (sent at once), whose "
          f"last answer took {max(trainer.first_burst) * 1000:.1f} ms")  # fmt: skip
    print(f"an archived job: {answer_before}")
    print(f"  after the restart: {answer_after}")


async def time_the_restart(
    work: Path, agent: str, args: argparse.Namespace
) -> tuple[float, float, str]:
    """Archived copies added (``--add-archived``), then a restart on the state directory:
    its seconds to a new job's first row, its RSS then, and the first job read from it."""
    if args.add_archived:
        took = await asyncio.to_thread(add_archived, work / "state", args.add_archived, args.retain)
        print(
            f"added {args.add_archived:,} archived jobs (index rows of copies of group-0, "
            f"their archives hard links) in {took:.1f} s"
        )
    daemon, restart_s = await restart_to_first_row(work, agent, args)
    answer_after = await archived_answers(daemon.url, "group-0", args.repeats)
    restart_rss = daemon.rss_mb()
    await asyncio.to_thread(daemon.stop)
    return restart_s, restart_rss, answer_after


def add_archived(state: Path, count: int, window: int) -> float:
    """``count`` more archived jobs (the daemon stopped), ``window`` to an archive: each
    archive a hard link of the first one, each job indexed as ``group-0`` is (its
    files at the same offsets), under a new id. What a restart reads of them is the
    index alone, as it would be after ``count`` real jobs."""
    started = time.perf_counter()
    archive = Archive(Registry(state))
    model = archive.find("group-0")
    assert model is not None
    where = {name: list(at) for name, at in model.members.items()}
    number = max(int(p.stem) for p in archive.root.glob("*.tar"))
    for first in range(0, count, window):
        number += 1
        os.link(model.tar, archive.tar_path(number))
        ids = range(first, min(count, first + window))
        folded = [Folded(f"copy-{n}", 10_000_000 + n, model.digest, model.state, None, None)
                  for n in ids]  # fmt: skip
        archive._index(number, folded, [where] * len(folded))
    archive.close()
    return time.perf_counter() - started


def slope(curve: list[tuple[int, float]], first_mb: float, args: argparse.Namespace) -> str:
    """The RSS curve's growth per job over its second half, and where it leads."""
    half = [(n, mb) for n, mb in curve if n >= curve[-1][0] / 2] if curve else []
    if len(half) < 2 or half[-1][0] == half[0][0]:
        return "RSS slope: too few points (--every)"
    (n0, mb0), (n1, mb1) = half[0], half[-1]
    per_job_kb = (mb1 - mb0) * 1024 / (n1 - n0)
    at_goal = mb1 + (GOAL_JOBS - n1) * per_job_kb / 1024
    return (
        f"RSS slope over jobs {n0:,}-{n1:,}: {per_job_kb:+.3f} KB a job; at that rate, "
        f"{at_goal:.1f} MB after job {GOAL_JOBS:,} (ratio {at_goal / first_mb:.2f} to job "
        f"{args.first:,})"
    )


def report(args: argparse.Namespace, seconds: float, rss: dict[str, float],
           counts: dict[str, int], submit: tuple[float, float], restart_s: float,
           restart_rss: float, code: int) -> None:  # fmt: skip
    rows = args.jobs * args.repeats
    print(
        f"many jobs: {args.jobs:,} jobs of 1 prompt x {args.repeats} repeats ({rows:,} rows), "
        f"{args.clients} clients x {args.per_client} groups at once, --concurrency "
        f"{args.concurrency}, --retain-settled-jobs {args.retain}, --fsync {args.fsync}, "
        f"agent latency {args.agent_latency}"
    )
    print(f"  {seconds:.1f} s: {args.jobs / seconds:,.0f} jobs/s, {rows / seconds:,.0f} rows/s")
    ratio = rss["last"] / rss["first"]
    print(
        f"daemon RSS after job {args.first:,}: {rss['first']:.1f} MB; after job "
        f"{args.jobs:,}: {rss['last']:.1f} MB; ratio {ratio:.2f} (goal <= {GOAL_RSS_RATIO})"
    )
    print(
        f"state directory: {counts['jobs/']} entries in jobs/, {counts['archive/']} in "
        f"archive/ ({args.jobs // args.retain} archives of {args.retain} jobs + the index), "
        f"{counts['files']:,} files in all; without archives: {args.jobs:,} folders"
    )
    p50, p99 = submit
    print(
        f"submit latency: p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms "
        f"(goal p99 <= {GOAL_SUBMIT_P99_S * 1000:.0f} ms)"
    )
    print(
        f"restart on {args.jobs + args.add_archived:,} settled jobs to a new job's first row: "
        f"{restart_s:.2f} s "
        f"(goal <= {GOAL_RESTART_S:g} s); RSS then {restart_rss:.1f} MB"
    )
    print(f"dispatcher serve exit code after SIGTERM: {code}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--first", type=int, default=1_000, help="RSS baseline after this job")
    parser.add_argument("--repeats", type=int, default=8, help="rows per job")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--per-client", type=int, default=16, help="groups at once per client")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument(
        "--agent-latency",
        default="fixed:0",
        metavar="fixed:S|lognormal:MEDIAN_S,SIGMA",
        help="the simulated agent's latency (default fixed:0: the daemon is the bottleneck)",
    )
    parser.add_argument("--retain", type=int, default=1_000, help="--retain-settled-jobs")
    parser.add_argument("--fsync", default="batch", help="the daemon's --fsync (default batch)")
    parser.add_argument(
        "--add-archived",
        type=int,
        default=0,
        help="archived jobs added (copies) before the restart is timed",
    )
    parser.add_argument(
        "--stop-after-s",
        type=float,
        default=None,
        help="submit no job after this many seconds; the figures are for the jobs done",
    )
    parser.add_argument(
        "--restart-on",
        type=int,
        default=0,
        help="settled jobs the restart is timed on: archived copies make up the difference",
    )
    parser.add_argument("--every", type=int, default=10_000, help="a progress line every N jobs")
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="one more flag for dispatcher serve (repeatable): --serve-arg=--start-order=input",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.jobs, args.first, args.retain, args.clients, args.per_client = 300, 100, 50, 2, 4
        args.add_archived, args.every = 200, 100
    return args


def main() -> None:
    args = parse_args()
    # The restart is timed from a process's start: a tree not byte-compiled would
    # add the compiling of every module it imports.
    compile_package()
    with (
        tempfile.TemporaryDirectory() as folder,
        dispatcher_server("sim-agent", "--latency-dist", args.agent_latency) as agent,
    ):
        asyncio.run(measure(Path(folder), agent, args))


if __name__ == "__main__":
    main()
