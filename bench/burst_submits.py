"""Bursts of submits, as a trainer that submits a step's prompt groups at once sends
them: how long the last answer of a burst waits, and where in the burst the time goes.

A simulated agent (``--agent-latency``, seconds by default: the daemon is not the
bottleneck) and ``dispatcher serve`` run in their own processes; this script
submits ``--size`` one-prompt jobs at once, waits for every answer, then
``--gap-s`` for their starts to settle, ``--bursts`` times. Printed: the submit
latency quantiles over every submit, and by rank of answer within a burst (the
1st, the median, the last), as the trainer times them; and the daemon's own
(``/status``: its handler's start to its answer). The jobs' results are not read:
the daemon runs them while the next bursts come.

The same bursts go first to the floor (``_bare_journal.py``): a bare aiohttp server
that parses each submit and appends it to a journal fsynced as the daemon's is, and
does nothing else; the daemon's figures are printed as ratios to it.
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
from _bare_journal import bare_journal
from _common import ServeProcess, compile_package, dispatcher_server

from dispatcher.latency.quantile import quantile

JSON_TYPE = {"Content-Type": "application/json"}


def body(job_id: str, repeats: int) -> bytes:
    row = {"agent_ref": {"name": "sim"}, "responses_create_params": {"input": job_id}}
    return orjson.dumps({"job_id": job_id, "rows": [row], "num_repeats": repeats})


async def one(http: aiohttp.ClientSession, url: str, job_id: str, repeats: int) -> float:
    started = time.perf_counter()
    async with http.post(f"{url}/v1/jobs", data=body(job_id, repeats), headers=JSON_TYPE) as r:
        if r.status != 201:
            raise SystemExit(f"submit {job_id}: {r.status} {await r.text()}")
    return time.perf_counter() - started


async def bursts(url: str, args: argparse.Namespace) -> list[list[float]]:
    """Each burst's submit times, in the order answered."""
    timeout = aiohttp.ClientTimeout(total=None)
    found: list[list[float]] = []
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as http:
        # Warm the connection pool: a burst measures submits, not TCP handshakes.
        await asyncio.gather(*(http.get(f"{url}/status") for _ in range(args.size)))
        for b in range(args.bursts):
            ids = [f"burst-{b}-{n}" for n in range(args.size)]
            times = await asyncio.gather(*(one(http, url, i, args.repeats) for i in ids))
            found.append(sorted(times))
            print(f"  burst {b}: last answer {max(times) * 1000:.1f} ms", flush=True)
            await asyncio.sleep(args.gap_s)
    return found


async def daemon_submit(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/status") as r:
        submit = (await r.json()).get("submit_s") or {}
    if submit.get("p99") is None:
        return "its own: not measured"
    return (
        f"its own (handler to answer): p50 {submit['p50'] * 1000:.1f} ms, "
        f"p99 {submit['p99'] * 1000:.1f} ms"
    )


def ms(values: list[float], q: float) -> str:
    return f"{(quantile(sorted(values), q) or 0.0) * 1000:.1f}"


async def measure(work: Path, agent: str, args: argparse.Namespace) -> None:
    with bare_journal(work / "bare-journal.jsonl") as bare:
        print("the floor: a bare aiohttp server that journals each submit")
        floor = await bursts(bare, args)
        floor_own = await daemon_submit(bare)
    daemon = await asyncio.to_thread(
        ServeProcess, work, "--agent", f"sim={agent}", "--concurrency", str(args.concurrency),
        "--log-format", "json", "--log-level", "warning",
    )  # fmt: skip
    try:
        print("dispatcher serve")
        found = await bursts(daemon.url, args)
        own = await daemon_submit(daemon.url)
    finally:
        await asyncio.to_thread(daemon.stop)
    print(
        f"{args.bursts} bursts of {args.size} one-prompt jobs x {args.repeats} repeats, "
        f"agent latency {args.agent_latency}"
    )
    report("the floor", floor, floor_own, args.size)
    report("dispatcher serve", found, own, args.size)
    ours, theirs = figures(found), figures(floor)
    for name, value in ours.items():
        print(f"  {name}: {value * 1000:.1f} ms, {value / max(theirs[name], 1e-9):.2f}x the "
              f"floor's {theirs[name] * 1000:.1f} ms")  # fmt: skip


def figures(found: list[list[float]]) -> dict[str, float]:
    """What the ratios to the floor are printed for, in seconds."""
    return {
        "the first burst's last answer": found[0][-1],
        "the median burst's last answer": quantile(sorted(b[-1] for b in found), 0.5) or 0.0,
        "p99 of every submit": quantile(flat(found), 0.99) or 0.0,
        "p99 after the first burst": quantile(flat(found[1:]), 0.99) or 0.0,
    }


def flat(found: list[list[float]]) -> list[float]:
    return sorted(t for burst in found for t in burst)


def report(name: str, found: list[list[float]], own: str, size: int) -> None:
    every = flat(found)
    print(f"{name}: submit latency p50 {ms(every, 0.5)} ms, p99 {ms(every, 0.99)} ms, max "
          f"{max(every) * 1000:.1f} ms; {own}")  # fmt: skip
    ranks = ((0, "first"), (size // 4, "quarter"), (size // 2, "median"), (size - 1, "last"))
    for rank, label in ranks:
        at = [burst[rank] for burst in found]
        print(f"  the {label} answer of a burst: median {ms(at, 0.5)} ms, max "
              f"{max(at) * 1000:.1f} ms")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bursts", type=int, default=10)
    parser.add_argument("--size", type=int, default=64, help="submits at once")
    parser.add_argument("--repeats", type=int, default=8, help="rows per job")
    parser.add_argument("--gap-s", type=float, default=2.0, help="between bursts")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--agent-latency", default="lognormal:0.5,1")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.bursts, args.size, args.repeats, args.gap_s = 2, 4, 2, 0.1
    compile_package()
    with (
        tempfile.TemporaryDirectory() as folder,
        dispatcher_server("sim-agent", "--latency-dist", args.agent_latency) as agent,
    ):
        asyncio.run(measure(Path(folder), agent, args))


if __name__ == "__main__":
    main()
