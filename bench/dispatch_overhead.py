"""What the dispatcher costs on top of the HTTP calls it makes.

Each round, against each agent in its own process -- the dispatcher's simulated
agent (``dispatcher sim-agent``, zero latency) and a plain aiohttp agent that
answers a realistic row at once (``_plain_agent.py``, not the project's own
code) -- one after the other:
  * the baseline: a bare aiohttp + uvloop client in its own process that keeps
    ``--concurrency`` ``POST /run`` in flight and appends each answer to a file;
  * the same bare client on the dispatcher's own HTTP/1.1 client
    (``delivery/http1.py``): the floor of what the dispatcher could reach;
  * ``dispatcher run`` end to end (materialize, dispatch, durable rows, a log
    event per rollout, metrics, the files of record), with no task history;
  * the same again, its task history holding every task (the default start
    order then ranks each rollout by its expected latency, as in a later epoch);
  * with ``--telemetry-off``, the same without the metrics server and info logs.
Two rates each: the dispatch window's (the dispatcher's ``dispatch_s``; the
baseline's first request to its last answer) and the whole process's (rows over
its wall time, start-up and the end of the run included). CPU is always the
whole process's (user + system, ``wait4``) per rollout, with the package
byte-compiled first, as an install leaves it (else each ``dispatcher run`` would
compile every module it imports: 0.16 s of CPU, ``PYTHONDONTWRITEBYTECODE`` set).
Each round prints its ratios to the baseline of the same round and agent; the
summary is the median of ``--repeat`` rounds (the machine is noisy: only ratios
measured side by side mean much). ``--memory`` adds peak RSS for a 1,000,000-row
task file against a 10,000-row one. NeMo Gym 0.7.0's own collector runs in each
round against the simulated agent too where its venv is ready
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
from _common import (
    compile_package,
    dispatcher_server,
    median,
    run_bodies,
    run_child,
    write_tasks,
)
from _gym_collector import gym_collector
from _plain_agent import plain_agent

BARE = "bare aiohttp+uvloop client"
AGENTS = {"sim": "dispatcher sim-agent", "plain": "plain aiohttp agent"}


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


def _figures(
    rows: int, dispatch_s: float, cpu_s: float, wall_s: float, **extra: float
) -> dict[str, float]:
    """``rate`` is the dispatch window's; ``whole_rate`` and ``cpu_s`` the whole process's."""
    return {
        "rate": rows / dispatch_s,
        "whole_rate": rows / wall_s,
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "cpu_ms": cpu_s / rows * 1000,
        **extra,
    }


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
    work: Path,
    tasks: Path,
    url: str,
    concurrency: int,
    telemetry: bool,
    tag: str,
    history: Path,
) -> dict[str, float]:
    """``dispatcher run`` with ``history`` as its task history (the default start
    order reads it: absent, every task is unseen)."""
    output = work / f"{tag}.jsonl"
    args = [
        sys.executable, "-m", "dispatcher", "run", "--input", str(tasks),
        "--output", str(output), "--agent", f"sim={url}", "--concurrency", str(concurrency),
        "--log-format", "json", "--fresh", "--task-history", str(history),
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


def parse_opts() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rollouts", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--agents", default="sim,plain", help="which agents, comma-separated: sim, plain"
    )
    parser.add_argument("--telemetry-off", action="store_true", help="also run without telemetry")
    parser.add_argument("--memory", action="store_true", help="peak RSS vs task-file size")
    parser.add_argument("--big-rows", type=int, default=1_000_000)
    parser.add_argument("--small-rows", type=int, default=10_000)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    parser.add_argument("--no-gym", action="store_true", help="leave NeMo Gym's collector out")
    opts = parser.parse_args()
    agents = [a for a in opts.agents.split(",") if a]
    if not agents or set(agents) - set(AGENTS):
        parser.error(f"--agents: one or more of {', '.join(AGENTS)}, got {opts.agents!r}")
    opts.agents = agents
    if opts.smoke:
        opts.rollouts, opts.repeat, opts.big_rows, opts.small_rows = 2_000, 1, 20_000, 2_000
    return opts


def main() -> int:
    if sys.argv[1:2] == ["--bare-child"]:
        return bare_child(*sys.argv[2:7])
    opts = parse_opts()
    agents: list[str] = opts.agents
    compile_package()
    print(
        f"dispatch overhead: {opts.rollouts} rollouts, concurrency {opts.concurrency},"
        f" zero-latency agents; ratios to the bare client of the same round and agent;"
        f" window: the dispatch window, whole: the whole process (start-up and end included)"
    )
    runs: dict[str, list[dict[str, float]]] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        dispatcher_server("sim-agent") as sim_url,
        plain_agent() as plain_url,
        gym_collector(sim_url, opts.no_gym or "sim" not in agents) as gym,
    ):
        urls = {"sim": sim_url, "plain": plain_url}
        work = Path(tmp)
        tasks = work / "tasks.jsonl"
        write_tasks(tasks, opts.rollouts)
        for i in range(opts.repeat):
            for agent in agents:
                this = one_round(work, tasks, urls[agent], opts, f"{agent}{i}")
                if gym is not None and agent == "sim":
                    gym.run_round(this, work, tasks, opts.concurrency, f"g{i}")
                report_round(f"round {i + 1}  {agent:5s}", this)
                if gym is not None and agent == "sim":
                    gym.report_round(i, this, opts.rollouts)
                for name, fig in this.items():
                    runs.setdefault(f"{agent}|{name}", []).append(fig)
        print(f"median of {opts.repeat} rounds:")
        report_median(runs, agents)
        if gym is not None:
            gym.report_median({k.split("|", 1)[1]: v for k, v in runs.items()}, opts.rollouts)
        if opts.memory:
            report_memory(work, opts.small_rows, opts.big_rows, sim_url)
    return 0


def report_memory(work: Path, small_rows: int, big_rows: int, url: str) -> None:
    small = drained_rss(work, small_rows, url)
    big = drained_rss(work, big_rows, url)
    print("memory vs task-file size (budget 0: all rows streamed and drained)")
    print(f"  {small_rows:>9,} rows  peak RSS {small:7.1f} MB")
    print(f"  {big_rows:>9,} rows  peak RSS {big:7.1f} MB   ratio {big / small:.2f}")


def one_round(
    work: Path, tasks: Path, url: str, opts: argparse.Namespace, tag: str
) -> dict[str, dict[str, float]]:
    """The clients of one round against one agent, one after the other."""
    p = opts.concurrency
    # The first run has no task history; the second reads the one the first left
    # (every task seen once: the start order's full work, as in a later epoch).
    history = work / f"history-{tag}.jsonl"
    history.unlink(missing_ok=True)
    this = {
        BARE: baseline(work, tasks, url, p, f"b{tag}"),
        "  the same on our HTTP client": baseline(work, tasks, url, p, f"o{tag}", kind="own"),
        "dispatcher run": daemon_run(work, tasks, url, p, True, f"on{tag}", history),
        "  again, tasks in its history": daemon_run(work, tasks, url, p, True, f"h{tag}", history),
    }
    if opts.telemetry_off:
        off = work / f"history-off-{tag}.jsonl"
        this["  telemetry off"] = daemon_run(work, tasks, url, p, False, f"off{tag}", off)
    return this


def _ratios(fig: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    return {
        "rate_ratio": fig["rate"] / base["rate"],
        "whole_rate_ratio": fig["whole_rate"] / base["whole_rate"],
        "cpu_ratio": fig["cpu_ms"] / base["cpu_ms"],
    }


def _line(prefix: str, name: str, fig: dict[str, float]) -> str:
    return (
        f"  {prefix}  {name:29s} window {fig['rate']:7.0f}/s ({fig['rate_ratio']:.2f})"
        f"  whole {fig['whole_rate']:7.0f}/s ({fig['whole_rate_ratio']:.2f})"
        f"  wall {fig['wall_s']:6.2f} s  CPU {fig['cpu_s']:6.2f} s"
        f" {fig['cpu_ms']:6.3f} ms/rollout ({fig['cpu_ratio']:.2f}x)"
    )


def report_round(prefix: str, this: dict[str, dict[str, float]]) -> None:
    """A round's figures, each with (its ratio to the bare client's); CPU is whole-process."""
    base = this[BARE]
    for name, fig in this.items():
        if "whole_rate" in fig:  # Gym's collector reports its own lines
            fig.update(_ratios(fig, base))
            print(_line(prefix, name, fig))


def report_median(runs: dict[str, list[dict[str, float]]], agents: list[str]) -> None:
    for agent in agents:
        for key, figs in runs.items():
            if not key.startswith(f"{agent}|") or "whole_rate" not in figs[0]:
                continue
            fig = {k: median([f[k] for f in figs]) for k in figs[0]}
            extra = ""
            if "peak_rss_mb" in fig:
                extra = f"  peak RSS {fig['peak_rss_mb']:.1f} MB"
                extra += f"  loop lag p99 {fig['lag_p99_ms']:.2f} ms"
            print(_line(f"{agent:5s}", key.split("|", 1)[1], fig) + extra)


if __name__ == "__main__":
    raise SystemExit(main())
