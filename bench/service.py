"""Service mode under load: thousands in flight, groups streamed as they complete,
and a daemon that stays the same size across a thousand jobs.

Everything runs in its own process: two simulated agents (``slow`` with the
given latency, ``fast`` with none), ``dispatcher serve``, and this script as
the trainer. Printed:

0. Baseline: a bare aiohttp client (its own process, no dispatcher) that
   keeps ``--concurrency`` requests in flight against the slow agent for the
   same number of rollouts. Its rollouts/s, the most it had in flight and its
   own loop lag (the same 100 ms sampler as the daemon's) are what this
   machine allows any asyncio client, before rows, files or streams.
1. Load: one job of ``--tasks`` × ``--repeats`` rollouts at ``--concurrency``
   against the slow agent while a trainer streams its complete groups
   (``group=true&wait=true``). Figures: the most rollouts in flight the
   daemon reported, its event-loop lag (p99, max) and the delay from a
   group's last row being durable to its delivery on the stream (p50, p99,
   from the daemon's own measurement, ``/status``).
2. Many jobs: ``--small-jobs`` small jobs against the fast agent, submitted
   one after another, each streamed to its end before the next. The daemon's
   resident memory (VmRSS) after the first tenth and at the end, and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import LoopLag, ServeProcess, consume, dispatcher_server, rss_mb

# The jobs API takes JSON bodies only: what a browser sends unasked is refused.
JSON_TYPE = {"Content-Type": "application/json"}


async def bare_client(url: str, rollouts: int, concurrency: int) -> dict[str, float]:
    """The baseline: ``rollouts`` POST /run at ``concurrency``, answers read and dropped."""
    # The task and rollout index make it a run request (without them an agent answers 422).
    body = orjson.dumps(
        {"responses_create_params": {"input": "hi"}, "_ng_task_index": 0, "_ng_rollout_index": 0}
    )
    left = rollouts
    in_flight = peak = 0
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def worker() -> None:
            nonlocal left, in_flight, peak
            while left > 0:
                left -= 1
                in_flight += 1
                peak = max(peak, in_flight)
                async with http.post(f"{url}/run", data=body) as r:
                    data = await r.read()
                if r.status != 200:
                    raise SystemExit(f"the agent answered {r.status}: {data[:200]!r}")
                in_flight -= 1

        async with LoopLag() as lag:
            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            seconds = time.perf_counter() - started
    return {
        "rate": rollouts / seconds,
        "peak": peak,
        "lag_p99_s": lag.quantile(0.99),
        "lag_max_s": lag.max,
    }


def baseline_phase(url: str, rollouts: int, concurrency: int) -> None:
    child = [sys.executable, __file__, "--baseline-child", url, str(rollouts), str(concurrency)]
    out = subprocess.run(child, capture_output=True, check=True).stdout
    fig = orjson.loads(out)
    print(f"baseline: bare aiohttp client, {rollouts} rollouts at concurrency {concurrency}")
    print(f"  {fig['rate']:.0f} rollouts/s, most in flight {fig['peak']}")
    print(f"  event-loop lag: p99 {_ms(fig['lag_p99_s'])}, max {_ms(fig['lag_max_s'])}")


def start_daemon(work: Path, slow: str, fast: str, concurrency: int) -> ServeProcess:
    return ServeProcess(
        work, "--agent", f"slow={slow}", "--agent", f"fast={fast}",
        "--concurrency", str(concurrency), "--log-format", "json", "--progress-interval-s", "5",
    )  # fmt: skip


async def status(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/status") as r:
        data: dict[str, Any] = await r.json()
        return data


async def submit(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    async with http.post(f"{url}/v1/jobs", data=orjson.dumps(body), headers=JSON_TYPE) as r:
        if r.status != 201:
            raise SystemExit(f"submit: {r.status} {await r.text()}")


async def load_phase(daemon: ServeProcess, tasks: int, repeats: int) -> None:
    url = daemon.url
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        rows = [{"agent_ref": {"name": "slow"}, "prompt": f"task {i}"} for i in range(tasks)]
        started = time.monotonic()
        await submit(http, url, {"job_id": "load", "rows": rows, "num_repeats": repeats})
        consumer = asyncio.create_task(consume(http, url, "load"))
        peak = 0
        while not consumer.done():
            snapshot = await status(http, url)
            peak = max(peak, snapshot["progress"].get("in_flight", 0))
            await asyncio.wait({consumer}, timeout=0.25)
        groups, got = consumer.result()
        elapsed = time.monotonic() - started
        final = await status(http, url)
    delay = final["results_delay_s"]
    print(
        f"load: {tasks} tasks x {repeats} repeats, {got} rows in {groups} groups, {elapsed:.1f} s"
    )
    print(f"  most in flight (daemon /status, 4 samples/s): {peak}")
    print(
        "  event-loop lag: p99 "
        f"{_ms(final['event_loop_lag_p99_s'])}, max {_ms(final['event_loop_lag_max_s'])}"
    )
    print(
        "  group durable -> delivered on the stream: "
        f"p50 {_ms(delay['p50'])}, p99 {_ms(delay['p99'])}, max {_ms(delay['max'])}"
    )
    print(f"  daemon peak RSS: {final['peak_rss_mb']} MB")


async def jobs_phase(daemon: ServeProcess, count: int) -> None:
    url = daemon.url
    samples: list[tuple[int, float]] = []
    async with aiohttp.ClientSession() as http:
        started = time.monotonic()
        for n in range(1, count + 1):
            rows = [
                {"agent_ref": {"name": "fast"}, "prompt": f"job {n} task {i}"} for i in range(4)
            ]
            await submit(http, url, {"job_id": f"small-{n}", "rows": rows, "num_repeats": 2})
            groups, got = await consume(http, url, f"small-{n}")
            if (groups, got) != (4, 8):
                raise SystemExit(f"small-{n}: {groups} groups, {got} rows")
            if n % max(1, count // 10) == 0:
                samples.append((n, rss_mb(daemon.proc.pid)))
        elapsed = time.monotonic() - started
    first, last = samples[0], samples[-1]
    print(f"jobs: {count} jobs of 8 rollouts, one after another, {elapsed:.1f} s")
    print("  daemon RSS (MB) after N jobs: " + ", ".join(f"{n}: {mb:.1f}" for n, mb in samples))
    print(f"  RSS at {last[0]} / RSS at {first[0]}: {last[1] / first[1]:.3f}")


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=10_000)
    parser.add_argument("--latency-s", type=float, default=1.0)
    parser.add_argument("--tasks", type=int, default=5_000)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--small-jobs", type=int, default=1_000)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    parser.add_argument("--baseline-child", nargs=3, metavar=("URL", "ROLLOUTS", "C"))
    args = parser.parse_args()
    if args.baseline_child:
        url, rollouts, concurrency = args.baseline_child
        fig = asyncio.run(bare_client(url, int(rollouts), int(concurrency)))
        sys.stdout.buffer.write(orjson.dumps(fig))
        return
    if args.smoke:
        args.concurrency, args.tasks, args.repeats, args.small_jobs = 200, 100, 4, 20
        args.latency_s = 0.2
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        with (
            dispatcher_server("sim-agent", "--latency-s", str(args.latency_s)) as slow,
            dispatcher_server("sim-agent", "--latency-s", "0") as fast,
        ):
            baseline_phase(slow, args.tasks * args.repeats, args.concurrency)
            daemon = start_daemon(work, slow, fast, args.concurrency)
            try:
                asyncio.run(load_phase(daemon, args.tasks, args.repeats))
                asyncio.run(jobs_phase(daemon, args.small_jobs))
            finally:
                code = daemon.stop()
            print(f"dispatcher serve exit code after SIGTERM: {code}")


if __name__ == "__main__":
    main()
