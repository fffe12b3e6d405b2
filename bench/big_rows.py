"""Rows of megabytes: memory, event-loop lag and throughput against the machine's limit.

For each case (row size, concurrency), in one run against the same simulated
agent (its own process, ``sim-agent --row-bytes N``: the task echoed back
plus a list of ``{token_id, logprob}`` objects):
  * a baseline: a bare aiohttp client (its own process) that streams each
    answer's bytes to a file, no parsing, at the same concurrency;
  * the same baseline validating each answer (msgspec, values skipped)
    before writing it: the floor for any reader that refuses corrupt rows;
  * ``dispatcher run`` end to end (materialize, dispatch, durable rows).
Figures: rows/s and MB/s of the dispatch phase, the dispatcher's rate as a
share of the baseline's, peak RSS of each process, and the daemon's own
event-loop lag (p99 and max, sampled every 100 ms).

A run of 120 rows of 20 MB has some 80 lag samples: its p99 is its largest.
So the lag is also given over all the samples of a variant's runs, beside
the machine's own: an idle process, sampling the same way during each
dispatcher run, is woken late only by the machine's other work (the agent,
the kernel's writes, the hypervisor). Stalls the daemon shares with it are
not the daemon's.

Then a rollout with 50 captured calls of 200 KB each: the largest loop
stall while its capture is merged on the loop and in the worker.

``--offload-compare`` also times the big-answer work (split, merge, serialize)
in pools of one and two threads against pools of one and two processes,
with the largest stall a 1 ms ticker on the loop saw meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import math
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _big_rows_compare import capture_compare, offload_compare, write_compare
from _common import LoopLag, dispatcher_server, median, run_bodies, run_child, write_tasks

MB = 1_000_000
# (row bytes, concurrency, rollouts); the two cases.
CASES = ((2 * MB, 64, 1_000), (20 * MB, 16, 120))
SMOKE_CASES = ((2 * MB, 64, 64), (20 * MB, 16, 16))


async def stream_to_file(
    url: str, lines: list[bytes], out: Path, concurrency: int, validate: bool = False
) -> dict[str, float]:
    """The baseline: POST every task, append each answer's bytes and a newline to ``out``.

    With ``validate``, each answer is first checked to be one JSON object, by
    the fastest validating parser we have (msgspec, values skipped): the
    least any reader that refuses a corrupt row must spend.
    """
    import msgspec

    check = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
    bodies = iter(lines)
    written = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        with out.open("wb") as f:

            async def worker() -> None:
                nonlocal written
                for body in bodies:
                    async with session.post(
                        f"{url}/run", data=body, headers={"Content-Type": "application/json"}
                    ) as resp:
                        # Whole answers only: a row is never interleaved with another.
                        data = await resp.read()
                    if resp.status != 200:
                        raise SystemExit(f"the agent answered {resp.status}: {data[:200]!r}")
                    if validate:
                        check(data)
                    f.write(data + b"\n")
                    written += len(data) + 1

            async with LoopLag() as lag:
                started = time.perf_counter()
                await asyncio.gather(*(worker() for _ in range(concurrency)))
                seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "bytes": written,
        "peak_rss_mb": _peak_rss_mb(),
        "lag_p99_ms": lag.quantile(0.99) * 1000,
        "lag_max_ms": lag.max * 1000,
    }


def _peak_rss_mb() -> float:
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def baseline(
    work: Path, tasks: Path, url: str, concurrency: int, tag: str, validate: bool = False
) -> dict[str, float]:
    out = work / f"{tag}-baseline.jsonl"
    args = [sys.executable, __file__, "--baseline-child", url, str(tasks), str(out),
            str(concurrency), "validate" if validate else "bytes"]  # fmt: skip
    result = run_child(args, work / f"{tag}-baseline.log")
    if result.returncode != 0:
        raise SystemExit(f"baseline failed ({result.returncode}): {result.stderr[-2000:]!r}")
    figures: dict[str, float] = orjson.loads((work / f"{tag}-baseline.json").read_bytes())
    rows = sum(1 for _ in out.open("rb"))
    out.unlink()
    return {**figures, "rows": rows, "cpu_s": result.cpu_s}


def daemon(
    work: Path, tasks: Path, url: str, concurrency: int, tag: str, fsync: str,
    aggregate: bool = False, worker: str = "process",
) -> dict[str, Any]:  # fmt: skip
    output = work / f"{tag}.jsonl"
    samples = work / f"{tag}-lag.json"
    # Without ``aggregate``, the end-of-run aggregate metrics step (which parses
    # every row of the output and posts them to the agent) is left out: it is
    # not the dispatch path this bench measures, and it is shown on its own.
    child = ["--daemon-child", "aggregate" if aggregate else "no-aggregate", worker, str(samples)]
    args = [
        sys.executable, __file__, *child, "run", "--input", str(tasks),
        "--output", str(output), "--agent", f"sim={url}", "--concurrency", str(concurrency),
        "--log-format", "json", "--log-level", "warning", "--fresh",
        "--metrics-listen", "127.0.0.1:0", "--fsync", fsync,
    ]  # fmt: skip
    with idle_process_lag(work / f"{tag}-idle-lag.json") as idle:
        result = run_child(args, work / f"{tag}.log")
    if result.returncode != 0:
        log_tail = (work / f"{tag}.log").read_text()[-3000:]
        raise SystemExit(f"dispatcher run failed ({result.returncode}); its log ends:\n{log_tail}")
    size = output.stat().st_size
    rows = sum(1 for _ in output.open("rb"))
    output.unlink()
    summary = orjson.loads((work / f"{tag}_manifest.json").read_bytes())["last_run"]["summary"]
    return {
        "seconds": summary["dispatch_s"],
        "bytes": size,
        "rows": rows,
        "peak_rss_mb": summary["peak_rss_mb"],
        "lag_p99_ms": (summary["event_loop_lag_p99_s"] or 0.0) * 1000,
        "lag_max_ms": (summary["event_loop_lag_max_s"] or 0.0) * 1000,
        "cpu_s": result.cpu_s,
        "lag_samples": orjson.loads(samples.read_bytes()),
        "idle_lag_samples": idle(),
    }


@contextlib.contextmanager
def idle_process_lag(out: Path) -> Iterator[Callable[[], list[list[float]]]]:
    """An idle process samples its loop lag (every 100 ms, as the daemon does)
    while the block runs; yields a function that returns its samples
    (``[when, lag]``, ``when`` on the monotonic clock all processes share)."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--idle-child", str(out)], stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    proc.stdout.readline()  # sampling from here on
    try:
        yield lambda: orjson.loads(out.read_bytes())
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)


async def idle_child() -> list[tuple[float, float]]:
    """This idle process's loop lag samples, taken until SIGINT."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
    async with LoopLag() as lag:
        print("sampling", flush=True)
        await stop.wait()
    return list(zip(lag.ended, lag.lags, strict=True))


# ``--variants`` names (the two baselines always run).
VARIANT_KEYS = ("bytes", "validate", "never", "thread", "batch", "aggregate")


def run_case(
    work: Path,
    row_bytes: int,
    concurrency: int,
    rollouts: int,
    repeat: int,
    wanted: set[str] | None = None,
) -> None:
    tag = f"r{row_bytes // MB}mb-c{concurrency}"
    tasks = work / f"{tag}-tasks.jsonl"
    write_tasks(tasks, rollouts)
    runs: dict[str, list[dict[str, float]]] = {}
    lags: dict[str, list[tuple[list[list[float]], list[list[float]]]]] = {}
    with dispatcher_server("sim-agent", "--row-bytes", str(row_bytes)) as url:
        for n in range(repeat):
            this = one_round(work, tasks, url, concurrency, tag, n == 0, wanted)
            keep_round(this, runs, lags)
    print(
        f"{row_bytes / MB:g} MB rows, concurrency {concurrency}, {rollouts} rollouts, median of"
        f" {repeat} interleaved runs (ratio: to the baseline of the same round)"
    )
    for name, figs in runs.items():
        print(f"  {name:25s} {_figures(figs)}")
    for name, pairs in lags.items():
        print(f"  {name.strip()}, loop lag over all its runs' samples:")
        for line in lag_lines(pairs):
            print(f"    {line}")


def one_round(
    work: Path,
    tasks: Path,
    url: str,
    concurrency: int,
    tag: str,
    first: bool,
    wanted: set[str] | None,
) -> dict[str, dict[str, Any]]:
    """Each variant wanted run once, by name; the aggregate one in the first round only."""
    # Interleaved, so the machine's other work weighs on each the same.
    variants: dict[str, Callable[[], dict[str, Any]]] = {
        "baseline (bytes to file)": lambda: baseline(work, tasks, url, concurrency, tag),
        # What any reader that refuses a corrupt row must at least spend.
        "  + validating each row": lambda: baseline(
            work, tasks, url, concurrency, tag, validate=True
        ),
        # The baseline does not fsync: compare like with like first.
        "dispatcher --fsync never": lambda: daemon(work, tasks, url, concurrency, tag, "never"),
        "  the same, thread worker": lambda: daemon(
            work, tasks, url, concurrency, tag, "never", worker="thread"
        ),
        "dispatcher (fsync batch)": lambda: daemon(work, tasks, url, concurrency, tag, "batch"),
    }
    this = {
        name: run()
        for i, (name, run) in enumerate(variants.items())
        if i < 2 or (wanted is None or VARIANT_KEYS[i] in wanted)
    }
    if first and (wanted is None or "aggregate" in wanted):
        this["  + end-of-run aggregate"] = daemon(
            work, tasks, url, concurrency, tag, "batch", aggregate=True
        )
    return this


def keep_round(
    this: dict[str, dict[str, Any]],
    runs: dict[str, list[dict[str, float]]],
    lags: dict[str, list[tuple[list[list[float]], list[list[float]]]]],
) -> None:
    """One round's figures, each rate also as a ratio to the round's baseline."""
    base = this["baseline (bytes to file)"]
    base_rate = base["rows"] / base["seconds"]
    for name, fig in this.items():
        if "lag_samples" in fig:
            lags.setdefault(name, []).append((fig.pop("lag_samples"), fig.pop("idle_lag_samples")))
        rate = fig["rows"] / fig["seconds"]
        runs.setdefault(name, []).append({**fig, "rate": rate, "ratio": rate / base_rate})


STALL_S = 0.020  # the loop lag goal: a p99 under 20 ms (docs/benchmarks.md)


def lag_lines(pairs: list[tuple[list[list[float]], list[list[float]]]]) -> list[str]:
    """The daemon's lag samples of all runs together, and the idle process's beside them."""
    daemon_lags = [lag for run, _ in pairs for _, lag in run]
    idle_lags = [lag for _, idle in pairs for _, lag in idle]
    # A daemon stall the idle process shared: one of its samples over half the
    # bound ended within the daemon's sample (the 100 ms before it ended).
    shared = sum(
        1
        for run, idle in pairs
        for when, lag in run
        if lag > STALL_S
        and any(when - 0.1 - lag <= at <= when and late > STALL_S / 2 for at, late in idle)
    )
    over = sum(lag > STALL_S for lag in daemon_lags)
    return [
        f"dispatcher:     {_lag_summary(daemon_lags)}",
        f"idle process:   {_lag_summary(idle_lags)}  (the machine's own)",
        f"of the dispatcher's {over} samples over {STALL_S * 1000:g} ms, {shared} fell when"
        f" the idle process was also over {STALL_S * 500:g} ms late",
    ]


def _lag_summary(lags: list[float]) -> str:
    ordered = sorted(lags)
    p99 = ordered[math.ceil(0.99 * len(ordered)) - 1] if ordered else 0.0
    over = sum(lag > STALL_S for lag in ordered)
    return (
        f"{len(ordered):4d} samples, p99 {p99 * 1000:5.1f} ms,"
        f" max {max(ordered, default=0) * 1000:5.1f} ms, {over} over {STALL_S * 1000:g} ms"
    )


def _figures(figs: list[dict[str, float]]) -> str:
    fig = {key: median([f[key] for f in figs]) for key in figs[0]}
    return (
        f"{fig['rate']:6.1f} rows/s {fig['bytes'] / fig['seconds'] / MB:6.1f} MB/s"
        f" ({fig['ratio']:4.2f})  peak RSS {fig['peak_rss_mb']:6.1f} MB"
        f"  loop lag p99 {fig['lag_p99_ms']:6.1f} ms, max {fig['lag_max_ms']:6.1f} ms"
        f"  CPU {fig['cpu_s']:5.1f} s  ratios {[round(f['ratio'], 2) for f in figs]}"
        f"  lag p99s {[round(f['lag_p99_ms'], 1) for f in figs]}"
    )


def daemon_child(argv: list[str]) -> int:
    """``dispatcher ARGV``, without the end-of-run aggregate step unless asked for."""
    from dispatcher import cli
    from dispatcher.rows import offload
    from dispatcher.run import job
    from dispatcher.telemetry.lag import LoopLagMonitor

    mode, worker, samples_path, *rest = argv
    offload.WORKER_KIND = worker
    # Every lag sample the daemon's own monitor takes, with when it ended.
    samples: list[tuple[float, float]] = []
    observe = LoopLagMonitor.observe

    def recorded(self: LoopLagMonitor, lag_s: float) -> None:
        samples.append((time.perf_counter(), lag_s))
        observe(self, lag_s)

    LoopLagMonitor.observe = recorded  # type: ignore[method-assign]
    atexit.register(lambda: Path(samples_path).write_bytes(orjson.dumps(samples)))
    if mode == "no-aggregate":

        async def skipped(self: job.Job) -> dict[str, str]:
            return {}  # no agent's aggregation status: the status file says "pending"

        job.Job._write_aggregate_metrics = skipped  # type: ignore[method-assign]
    return cli.main(rest)


def main() -> int:
    if sys.argv[1:2] == ["--daemon-child"]:
        return daemon_child(sys.argv[2:])
    if sys.argv[1:2] == ["--idle-child"]:
        Path(sys.argv[2]).write_bytes(orjson.dumps(asyncio.run(idle_child())))
        return 0
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="small counts, for CI")
    parser.add_argument("--offload-compare", action="store_true")
    parser.add_argument("--write-compare", action="store_true", help="write(2) vs writev(2)")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs per case")
    parser.add_argument("--cases", default="2,20", help="row sizes in MB to run (2, 20; 0: none)")
    parser.add_argument(
        "--variants",
        help="dispatcher runs to make besides the two baselines, comma separated: never,"
        " thread, batch, aggregate (default: all)",
    )
    parser.add_argument("--no-capture", action="store_true", help="skip the capture merge stall")
    parser.add_argument(
        "--baseline-child", nargs=5, metavar=("URL", "TASKS", "OUT", "C", "bytes|validate")
    )
    opts = parser.parse_args()
    if opts.baseline_child:
        url, tasks, out, concurrency, mode = opts.baseline_child
        lines = run_bodies(Path(tasks))
        figures = asyncio.run(
            stream_to_file(url, lines, Path(out), int(concurrency), mode == "validate")
        )
        Path(out).with_suffix(".json").write_bytes(orjson.dumps(figures))
        return 0
    cases = SMOKE_CASES if opts.smoke else CASES
    with tempfile.TemporaryDirectory() as tmp:
        if opts.write_compare:
            write_compare(Path(tmp))
        wanted = {int(mb) * MB for mb in opts.cases.split(",") if mb}
        for row_bytes, concurrency, rollouts in cases:
            if row_bytes in wanted:
                wanted_variants = set(opts.variants.split(",")) if opts.variants else None
                run_case(Path(tmp), row_bytes, concurrency, rollouts, opts.repeat, wanted_variants)
        if not opts.no_capture:
            capture_compare(Path(tmp))
    if opts.offload_compare:
        for row_bytes, count in ((2 * MB, 64), (20 * MB, 8)):
            offload_compare(row_bytes, count)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
