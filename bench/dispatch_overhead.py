"""What the dispatcher costs on top of the HTTP calls it makes.

Each round, against the same zero-latency simulated agent (its own process):
  * the baseline: a bare aiohttp + uvloop client in its own process that keeps
    ``--concurrency`` ``POST /run`` in flight and appends each answer to a file;
  * the same bare client on the dispatcher's own HTTP/1.1 client
    (``delivery/http1.py``): the floor of what the dispatcher could reach;
  * ``dispatcher run`` end to end (materialize, dispatch, durable rows, a log
    event per rollout, metrics, the files of record);
  * with ``--telemetry-off``, the same without the metrics server and info logs.
Rates are from each one's dispatch window (the dispatcher's ``dispatch_s``; the
baseline's first request to its last answer); CPU is the whole process's (user +
system, start-up included) per rollout. Each round prints its ratios to the
baseline of the same round; the summary is the median of ``--repeat`` rounds
(the machine is noisy: only ratios measured side by side mean much).
``--memory`` adds peak RSS for a 1,000,000-row task file against a 10,000-row one.
NeMo Gym 0.7.0's own collector runs in each round too where its venv is ready
(``_gym_collector.py``; ``--no-gym`` leaves it out).
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
from _common import dispatcher_server, median, run_bodies, run_child, write_tasks
from _gym_collector import gym_collector


async def bare_client(url: str, lines: list[bytes], out: Path, concurrency: int) -> float:
    """The baseline's dispatch window: every task POSTed, each answer appended to ``out``."""
    bodies = iter(lines)
    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector) as session:
        with out.open("ab") as f:

            async def worker() -> None:
                for body in bodies:
                    async with session.post(f"{url}/run", data=body, headers=headers) as resp:
                        data = await resp.read()
                    if resp.status != 200:
                        raise SystemExit(f"the agent answered {resp.status}: {data[:200]!r}")
                    f.write(data + b"\n")

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return time.perf_counter() - started


async def own_client(url: str, lines: list[bytes], out: Path, concurrency: int) -> float:
    """``bare_client`` on the dispatcher's own HTTP/1.1 client (``delivery/http1.py``):
    what the HTTP calls alone cost the dispatcher, the rest of its work left out."""
    from dispatcher.delivery.http1_pool import Http1Pool
    from dispatcher.delivery.target import Target

    bodies = iter(lines)
    pool = Http1Pool(connect_timeout_s=None)
    target = Target.of(f"{url}/run")
    with out.open("ab") as f:

        async def worker() -> None:
            for body in bodies:
                conn = await pool.post(target, body, 1 << 26)
                data = await conn.body(None)
                pool.release(conn, target)
                if conn.status != 200:
                    raise SystemExit(f"the agent answered {conn.status}: {data[:200]!r}")
                f.write(data + b"\n")

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    await pool.close()
    return seconds


def bare_child(kind: str, url: str, tasks: str, out: str, concurrency: str) -> int:
    import uvloop

    client = own_client if kind == "own" else bare_client
    lines = run_bodies(Path(tasks))
    seconds = uvloop.run(client(url, lines, Path(out), int(concurrency)))
    Path(out).with_suffix(".json").write_bytes(orjson.dumps({"dispatch_s": seconds}))
    return 0


def _figures(rows: int, dispatch_s: float, cpu_s: float, **extra: float) -> dict[str, float]:
    return {"rate": rows / dispatch_s, "cpu_ms": cpu_s / rows * 1000, **extra}


def baseline(
    work: Path, tasks: Path, url: str, concurrency: int, tag: str, kind: str = "aiohttp"
) -> dict[str, float]:
    out = work / f"{tag}.jsonl"
    args = [sys.executable, __file__, "--bare-child", kind, url, str(tasks), str(out)]
    args.append(str(concurrency))
    result = run_child(args, work / f"{tag}.log")
    if result.returncode != 0:
        raise SystemExit(f"bare client failed ({result.returncode}): {result.stderr[-2000:]!r}")
    rows = sum(1 for _ in out.open("rb"))
    out.unlink()
    seconds = orjson.loads(out.with_suffix(".json").read_bytes())["dispatch_s"]
    return _figures(rows, seconds, result.cpu_s, wall_s=result.wall_s)


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
    output.unlink()
    summary = orjson.loads((work / f"{tag}_manifest.json").read_bytes())["last_run"]["summary"]
    return _figures(
        rows,
        summary["dispatch_s"],
        result.cpu_s,
        wall_s=result.wall_s,
        peak_rss_mb=summary["peak_rss_mb"],
        lag_p99_ms=(summary.get("event_loop_lag_p99_s") or 0.0) * 1000,
    )


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
    if sys.argv[1:2] == ["--bare-child"]:
        return bare_child(*sys.argv[2:7])
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rollouts", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--telemetry-off", action="store_true", help="also run without telemetry")
    parser.add_argument("--memory", action="store_true", help="peak RSS vs task-file size")
    parser.add_argument("--big-rows", type=int, default=1_000_000)
    parser.add_argument("--small-rows", type=int, default=10_000)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    parser.add_argument("--no-gym", action="store_true", help="leave NeMo Gym's collector out")
    opts = parser.parse_args()
    if opts.smoke:
        opts.rollouts, opts.repeat, opts.big_rows, opts.small_rows = 2_000, 1, 20_000, 2_000
    print(
        f"dispatch overhead: {opts.rollouts} rollouts, concurrency {opts.concurrency},"
        f" zero-latency agent; ratios to the bare client of the same round"
    )
    runs: dict[str, list[dict[str, float]]] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        dispatcher_server("sim-agent") as url,
        gym_collector(url, opts.no_gym) as gym,
    ):
        work = Path(tmp)
        tasks = work / "tasks.jsonl"
        write_tasks(tasks, opts.rollouts)
        for i in range(opts.repeat):
            this = {
                "bare aiohttp+uvloop client": baseline(work, tasks, url, opts.concurrency, f"b{i}"),
                "  the same on our HTTP client": baseline(
                    work, tasks, url, opts.concurrency, f"o{i}", kind="own"
                ),
                "dispatcher run": daemon_run(work, tasks, url, opts.concurrency, True, f"on{i}"),
            }
            if opts.telemetry_off:
                this["  telemetry off"] = daemon_run(
                    work, tasks, url, opts.concurrency, False, f"off{i}"
                )
            if gym is not None:
                gym.run_round(this, work, tasks, opts.concurrency, f"g{i}")
            report_round(i, this)
            if gym is not None:
                gym.report_round(i, this, opts.rollouts)
            for name, fig in this.items():
                runs.setdefault(name, []).append(fig)
        print(f"median of {opts.repeat} rounds:")
        report_median(runs)
        if gym is not None:
            gym.report_median(runs, opts.rollouts)
        if opts.memory:
            small = drained_rss(work, opts.small_rows, url)
            big = drained_rss(work, opts.big_rows, url)
            print("memory vs task-file size (budget 0: all rows streamed and drained)")
            print(f"  {opts.small_rows:>9,} rows  peak RSS {small:7.1f} MB")
            print(f"  {opts.big_rows:>9,} rows  peak RSS {big:7.1f} MB   ratio {big / small:.2f}")
    return 0


def _ratios(fig: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    return {"rate_ratio": fig["rate"] / base["rate"], "cpu_ratio": fig["cpu_ms"] / base["cpu_ms"]}


def report_round(i: int, this: dict[str, dict[str, float]]) -> None:
    base = this["bare aiohttp+uvloop client"]
    for name, fig in this.items():
        fig.update(_ratios(fig, base))
        print(
            f"  round {i + 1}  {name:27s} {fig['rate']:7.0f} rollouts/s  CPU"
            f" {fig['cpu_ms']:6.3f} ms/rollout  rate ratio {fig['rate_ratio']:.2f}"
            f"  CPU ratio {fig['cpu_ratio']:.2f}"
        )


def report_median(runs: dict[str, list[dict[str, float]]]) -> None:
    for name, figs in runs.items():
        fig = {key: median([f[key] for f in figs]) for key in figs[0]}
        extra = ""
        if "peak_rss_mb" in fig:
            extra = f"  peak RSS {fig['peak_rss_mb']:.1f} MB"
            extra += f"  loop lag p99 {fig['lag_p99_ms']:.2f} ms"
        print(
            f"  {name:27s} {fig['rate']:7.0f} rollouts/s  CPU {fig['cpu_ms']:6.3f} ms/rollout"
            f"  rate ratio {fig['rate_ratio']:.2f}  CPU ratio {fig['cpu_ratio']:.2f}{extra}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
