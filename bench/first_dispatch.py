"""A one-row job on an idle ``dispatcher serve``: from the submit to its rollout at the agent.

``dispatcher serve`` (default flags: ``--fsync batch``) runs in its own
process; this script is the trainer and the agent (an aiohttp server on
127.0.0.1 that notes when each ``POST /run`` arrives and answers at once).
``--jobs`` one-row jobs, one at a time: each submit timed to its answer (the job
durable) and to its rollout's arrival at the agent, then its results read to
the end before the next. The baseline, measured in the same run: a bare
``POST /run`` from this process to the same agent (the floor of any
dispatcher). Printed: p50 / p99 of each, and the medians' ratio to the baseline.

    .venv/bin/python bench/first_dispatch.py --jobs 100
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
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ServeProcess, consume

from dispatcher.latency.quantile import quantile

JSON_TYPE = {"Content-Type": "application/json"}


class Agent:
    """An agent on 127.0.0.1 that notes when each rollout arrives, by its input."""

    def __init__(self) -> None:
        self.arrived: dict[str, float] = {}
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/run", self.run)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def run(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        self.arrived[str(body["responses_create_params"]["input"])] = time.perf_counter()
        return web.json_response({"reward": 1.0, "response": {"output": []}})


def figures(name: str, seconds: list[float]) -> float:
    ordered = sorted(seconds)
    p50, p99 = quantile(ordered, 0.5) or 0.0, quantile(ordered, 0.99) or 0.0
    print(f"  {name:32} p50 {p50 * 1000:7.2f} ms   p99 {p99 * 1000:7.2f} ms")
    return p50


async def measure(work: Path, args: argparse.Namespace) -> None:
    agent = Agent()
    await agent.start()
    serve = await asyncio.to_thread(ServeProcess, work, "--agent", f"sim={agent.url}")
    answered: list[float] = []
    dispatched: list[float] = []
    bare: list[float] = []
    try:
        async with aiohttp.ClientSession() as http:
            for n in range(args.jobs + args.warmup):
                key = f"one-{n}"
                row = {"agent_ref": {"name": "sim"}, "responses_create_params": {"input": key}}
                data = orjson.dumps({"job_id": key, "rows": [row]})
                started = time.perf_counter()
                async with http.post(f"{serve.url}/v1/jobs", data=data, headers=JSON_TYPE) as r:
                    if r.status != 201:
                        raise SystemExit(f"submit {key}: {r.status} {await r.text()}")
                took = time.perf_counter() - started
                await consume(http, serve.url, key)
                # The floor: the same agent, the same row, straight from here.
                bare_key = f"bare-{n}"
                bare_row = {**row, "responses_create_params": {"input": bare_key}}
                bare_started = time.perf_counter()
                async with http.post(f"{agent.url}/run", json=bare_row) as r:
                    await r.read()
                if n >= args.warmup:
                    answered.append(took)
                    dispatched.append(agent.arrived[key] - started)
                    bare.append(agent.arrived[bare_key] - bare_started)
    finally:
        code = await asyncio.to_thread(serve.stop)
        assert agent.runner is not None
        await agent.runner.cleanup()
    print(f"first dispatch: {args.jobs} one-row jobs, one at a time, on an idle daemon")
    floor = figures("baseline: a bare POST /run", bare)
    figures("submit answered (job durable)", answered)
    first = figures("submit to the rollout at its agent", dispatched)
    print(f"  ratio of medians, submit to agent / baseline: {first / floor:.1f}x")
    print(f"dispatcher serve exit code after SIGTERM: {code}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5, help="jobs not counted first")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        asyncio.run(measure(Path(folder), args))


if __name__ == "__main__":
    main()
