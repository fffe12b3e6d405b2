"""What model-call capture costs: time the proxy adds to a call, and finalizing one row.

Starts the simulated model (zero latency) and the capture proxy as separate
processes on 127.0.0.1, then makes the same call directly and through the
proxy, interleaved so both see the same machine state, and prints p50/p99 of
each and of the difference. Then times ``attach_capture`` on a rollout with
10 captured calls.

    python bench/capture_overhead.py [--calls 3000] [--stream-calls 1000] [--rows 2000]

Goals: under 2 ms p50 added by the proxy, under 1 ms median to finalize a row.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dispatcher_server

from dispatcher.latency.quantile import quantile as latency_quantile
from dispatcher.rows.capture import attach_capture
from dispatcher.sim.model_client import call_model, request_body


def quantile(values: list[float], q: float) -> float:
    figure = latency_quantile(sorted(values), q)
    assert figure is not None, "no values"
    return figure


async def timed(call: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await call()
    return (time.perf_counter() - started) * 1000.0


async def direct_call(session: aiohttp.ClientSession, model_url: str, stream: bool) -> None:
    body = orjson.dumps(request_body("chat", stream=stream, prompt="Solve it.", model="m"))
    async with session.post(f"{model_url}/v1/chat/completions", data=body) as answer:
        await answer.read()


async def proxied_call(
    session: aiohttp.ClientSession, proxy_url: str, rollout_id: str, stream: bool
) -> None:
    body = orjson.dumps(request_body("chat", stream=stream, prompt="Solve it.", model="m"))
    url = f"{proxy_url}/ng-rollout/{rollout_id}/v1/chat/completions"
    async with session.post(url, data=body) as answer:
        await answer.read()


async def overhead(
    session: aiohttp.ClientSession, model_url: str, proxy_url: str, calls: int, stream: bool
) -> tuple[list[float], list[float]]:
    for i in range(min(200, calls)):
        await direct_call(session, model_url, stream)
        await proxied_call(session, proxy_url, f"warm-{i % 50}", stream)
    direct: list[float] = []
    proxied: list[float] = []
    for i in range(calls):
        # Alternate which goes first so neither always runs on a warmer cache.
        pair = [
            (direct, lambda: direct_call(session, model_url, stream)),
            (proxied, lambda rid=f"{i % 100}-0": proxied_call(session, proxy_url, rid, stream)),
        ]
        for sink, call in pair if i % 2 else reversed(pair):
            sink.append(await timed(call))
    return direct, proxied


def report_overhead(label: str, direct: list[float], proxied: list[float]) -> None:
    d50, d99 = quantile(direct, 0.5), quantile(direct, 0.99)
    p50, p99 = quantile(proxied, 0.5), quantile(proxied, 0.99)
    print(f"{label} ({len(direct)} interleaved pairs)")
    print(f"  direct   p50 {d50:6.3f} ms   p99 {d99:6.3f} ms")
    print(f"  proxied  p50 {p50:6.3f} ms   p99 {p99:6.3f} ms")
    print(f"  added    p50 {p50 - d50:6.3f} ms   p99 {p99 - d99:6.3f} ms   (goal: p50 < 2 ms)")


async def finalize_cost(
    session: aiohttp.ClientSession, proxy_url: str, capture_dir: Path, rows: int
) -> list[float]:
    for _ in range(10):
        await call_model(session, proxy_url, "fin-0", dialect="chat", stream=False)
    # The first finalize also waits out the background writes of those ten calls.
    await attach_capture(
        {}, capture_dir=capture_dir, rollout_id="fin-0", task_id=0, agent_result=None,
        total_latency_ms=1.0,
    )  # fmt: skip
    costs = []
    for _ in range(rows):
        row: dict[str, Any] = {"reward": 1.0}
        started = time.perf_counter()
        summary = await attach_capture(
            row, capture_dir=capture_dir, rollout_id="fin-0", task_id=0, agent_result=row,
            total_latency_ms=1.0,
        )  # fmt: skip
        costs.append((time.perf_counter() - started) * 1000.0)
        assert summary.num_calls == 10 and not summary.gaps, summary
    return costs


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="capture-bench-") as tmp:
        capture_dir = Path(tmp)
        # Each server in its own process, started by the real CLI, as deployed.
        with contextlib.ExitStack() as servers:
            model_url = servers.enter_context(dispatcher_server("sim-model"))
            proxy_url = servers.enter_context(
                dispatcher_server(
                    "capture-proxy", "--upstream", model_url, "--capture-dir", str(capture_dir)
                )
            )
            await measure(args, model_url, proxy_url, capture_dir)


async def measure(
    args: argparse.Namespace, model_url: str, proxy_url: str, capture_dir: Path
) -> None:
    async with aiohttp.ClientSession() as session:
        direct, proxied = await overhead(session, model_url, proxy_url, args.calls, False)
        report_overhead("capture-proxy, non-streamed chat", direct, proxied)
        if args.stream_calls:
            direct, proxied = await overhead(session, model_url, proxy_url, args.stream_calls, True)
            report_overhead("capture-proxy, streamed chat", direct, proxied)
        costs = await finalize_cost(session, proxy_url, capture_dir, args.rows)
    median, p99 = statistics.median(costs), quantile(costs, 0.99)
    print(f"finalize, 10 captured calls ({args.rows} rows)")
    print(f"  median {median:6.3f} ms   p99 {p99:6.3f} ms   (goal: median < 1 ms)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000, help="non-streamed pairs")
    parser.add_argument("--stream-calls", type=int, default=1000, help="streamed pairs")
    parser.add_argument("--rows", type=int, default=2000, help="rows to finalize")
    asyncio.run(main(parser.parse_args()))
