"""What the dispatcher costs on top of the HTTP calls it makes.

In one run, against the same zero-latency simulated agent (its own process):
  * a bare aiohttp client loop doing the same POSTs at the same concurrency,
  * ``dispatcher run`` end to end (materialize, dispatch, durable rows),
  * the daemon with telemetry on (metrics server, info logs) and off,
  * peak RSS for a 1,000,000-row task file against a 10,000-row one.
Rates are from the dispatch phase (``run_started`` → ``run_summary``).
Figures are medians over ``--repeat`` rounds; the machine is noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dispatcher_server, median, run_child, write_tasks


async def bare_loop(url: str, count: int, concurrency: int) -> float:
    """Rollouts/s of a plain aiohttp client doing the same POSTs."""
    body = orjson.dumps(
        {
            "agent_ref": {"name": "sim"},
            "responses_create_params": {"input": [{"role": "user", "content": "Solve it."}]},
            "_ng_task_index": 0,
            "_ng_rollout_index": 0,
        }
    )
    next_index = iter(range(count))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            for _ in next_index:
                async with session.post(
                    f"{url}/run", data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    orjson.loads(await resp.read())

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return count / (time.perf_counter() - started)


def daemon_run(
    work: Path, tasks: Path, url: str, concurrency: int, telemetry: bool, tag: str
) -> dict[str, float]:
    output = work / f"{tag}.jsonl"
    args = [
        sys.executable, "-m", "dispatcher", "run", "--input", str(tasks),
        "--output", str(output), "--agent", f"sim={url}", "--concurrency", str(concurrency),
        "--log-format", "json", "--fresh",
        "--metrics-listen", "127.0.0.1:0" if telemetry else "off",
    ]  # fmt: skip
    if not telemetry:
        args += ["--log-level", "warning"]
    result = run_child(args, work / f"{tag}.log")
    if result.returncode != 0:
        raise SystemExit(f"dispatcher run failed ({result.returncode}): see {work / tag}.log")
    rows = sum(1 for _ in output.open("rb"))
    manifest = orjson.loads((work / f"{tag}_manifest.json").read_bytes())
    summary = manifest["last_run"]["summary"]
    dispatch_s = summary["dispatch_s"]
    return {
        "rate": rows / dispatch_s,
        "cpu_per_1000": result.cpu_s / rows * 1000,
        "peak_rss_mb": summary["peak_rss_mb"],
        "lag_p99_ms": (summary.get("event_loop_lag_p99_s") or 0.0) * 1000,
    }


def drained_rss(work: Path, rows: int, url: str) -> float:
    """Peak RSS of a run over a ``rows``-row task file (budget 0: everything streams, drains)."""
    tasks = work / f"tasks-{rows}.jsonl"
    write_tasks(tasks, rows)
    args = [
        sys.executable, "-m", "dispatcher", "run", "--input", str(tasks),
        "--output", str(work / f"mem-{rows}.jsonl"), "--agent", f"sim={url}",
        "--dispatch-budget-s", "0", "--metrics-listen", "off", "--log-level", "warning",
    ]  # fmt: skip
    result = run_child(args, work / f"mem-{rows}.log")
    if result.returncode != 75:
        raise SystemExit(f"memory run failed ({result.returncode}): see mem-{rows}.log")
    manifest = orjson.loads((work / f"mem-{rows}_manifest.json").read_bytes())
    return float(manifest["last_run"]["summary"]["peak_rss_mb"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rollouts", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--big-rows", type=int, default=1_000_000)
    parser.add_argument("--small-rows", type=int, default=10_000)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    opts = parser.parse_args()
    if opts.smoke:
        opts.rollouts, opts.repeat, opts.big_rows, opts.small_rows = 2_000, 1, 20_000, 2_000
    with tempfile.TemporaryDirectory() as tmp, dispatcher_server("sim-agent") as url:
        work = Path(tmp)
        tasks = work / "tasks.jsonl"
        write_tasks(tasks, opts.rollouts)
        bare, off, on = [], [], []
        for i in range(opts.repeat):
            bare.append(asyncio.run(bare_loop(url, opts.rollouts, opts.concurrency)))
            off.append(daemon_run(work, tasks, url, opts.concurrency, False, f"off{i}"))
            on.append(daemon_run(work, tasks, url, opts.concurrency, True, f"on{i}"))
        small = drained_rss(work, opts.small_rows, url)
        big = drained_rss(work, opts.big_rows, url)
    report(opts, bare, off, on, small, big)
    return 0


def report(
    opts: argparse.Namespace,
    bare: list[float],
    off: list[dict[str, float]],
    on: list[dict[str, float]],
    small: float,
    big: float,
) -> None:
    def med(runs: list[dict[str, float]], key: str) -> float:
        return median([r[key] for r in runs])

    bare_rate, on_rate, off_rate = median(bare), med(on, "rate"), med(off, "rate")
    print(f"dispatch overhead: {opts.rollouts} rollouts, concurrency {opts.concurrency}, "
          f"zero-latency agent, median of {opts.repeat}")  # fmt: skip
    print(f"  bare aiohttp loop        {bare_rate:10.0f} rollouts/s")
    print(f"  dispatcher (telemetry on) {on_rate:9.0f} rollouts/s  ratio {on_rate / bare_rate:.2f}")
    print(
        f"  dispatcher (telemetry off){off_rate:9.0f} rollouts/s  ratio {off_rate / bare_rate:.2f}"
    )
    print(f"  telemetry overhead        {(1 - on_rate / off_rate) * 100:9.1f} % of rate")
    print(f"  CPU per 1,000 rollouts    {med(on, 'cpu_per_1000'):9.3f} s (daemon, telemetry on)")
    print(f"  peak RSS                  {med(on, 'peak_rss_mb'):9.1f} MB (daemon, telemetry on)")
    print(f"  event-loop lag p99        {med(on, 'lag_p99_ms'):9.2f} ms")
    print("memory vs task-file size (budget 0: all rows streamed and drained)")
    print(f"  {opts.small_rows:>9,} rows  peak RSS {small:7.1f} MB")
    print(f"  {opts.big_rows:>9,} rows  peak RSS {big:7.1f} MB   ratio {big / small:.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
