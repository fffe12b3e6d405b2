"""The capture proxy's own ceiling: calls per second it relays, against a bare proxy.

In one sitting, the same load goes through a bare aiohttp reverse proxy (forwards
the body, relays the answer chunk by chunk, records nothing: the least a Python
proxy does) and through ``dispatcher capture-proxy`` (routing, identity headers,
a capture record per call, fsynced), each in its own process, in front of the
same ``sim-model`` (zero latency, streamed answers). ``--workers`` concurrent
clients post chat completions whose request bodies are ``--sizes`` KiB for
``--seconds`` each; bare and capture runs alternate, ``--rounds`` times.

    python bench/proxy_ceiling.py [--sizes 32,256] [--seconds 5] [--rounds 2]

Printed per size: calls/s of each (median over rounds) and capture / bare (goal:
at least 0.8), with the proxy process's CPU seconds per 1,000 calls: a proxy at
one core's worth is the limit of one process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import aiohttp
import orjson
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dispatcher_server


def bare_proxy_app(upstream: str) -> web.Application:
    """Forward a POST's body and relay the answer as it comes; nothing else."""

    async def forward(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with session.post(upstream + request.path, data=body, headers=headers) as answer:
            response = web.StreamResponse(status=answer.status)
            response.content_type = answer.content_type
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def lifecycle(app: web.Application) -> Iterator[None]:  # type: ignore[misc]
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app["session"].close()

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/{tail:.*}", forward)
    return app


async def _serve_bare(upstream: str) -> None:
    runner = web.AppRunner(bare_proxy_app(upstream), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(f"listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()


class Server(NamedTuple):
    url: str
    pid: int


@contextlib.contextmanager
def server_process(*command: str) -> Iterator[Server]:
    """Run a server that prints "listening on URL" first; its URL and pid."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline().decode()
        if "listening on " not in line:
            raise SystemExit(f"{command[1:3]} did not start: {line!r}")
        yield Server(line.rsplit(" ", 1)[-1].strip(), proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(urls: list[str], body: bytes, workers: int, seconds: float) -> int:
    """Calls completed by ``workers`` clients in ``seconds``, each reading its whole answer."""
    done = 0
    deadline = time.monotonic() + seconds
    headers = {"Content-Type": "application/json"}

    async def worker(session: aiohttp.ClientSession, url: str) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            async with session.post(url, data=body, headers=headers) as answer:
                await answer.read()
                assert answer.status == 200, answer.status
            done += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(worker(session, urls[i % len(urls)]) for i in range(workers)))
    return done


def request(size_kib: int) -> bytes:
    text = "x" * (size_kib * 1024)
    messages = [{"role": "user", "content": text}]
    return orjson.dumps({"model": "m", "messages": messages, "stream": True})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="32,256", help="request body sizes, KiB")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workers", type=int, default=32)
    p.add_argument("--bare-proxy", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.bare_proxy:
        asyncio.run(_serve_bare(args.bare_proxy))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-ceiling-")))
        model = stack.enter_context(dispatcher_server("sim-model", "--completion-tokens", "64"))
        bare = stack.enter_context(server_process(sys.executable, __file__, "--bare-proxy", model))
        capture_command = (
            sys.executable, "-m", "dispatcher", "capture-proxy", "--upstream", model,
            "--capture-dir", str(tmp), "--listen", "127.0.0.1:0",
        )  # fmt: skip
        capture = stack.enter_context(server_process(*capture_command))
        print(
            f"{args.workers} clients, streamed answers, {args.seconds:g} s per run, "
            f"{args.rounds} rounds; one sim-model upstream; os.cpu_count()={os.cpu_count()}"
        )
        print(
            f"{'body KiB':>8} {'bare calls/s':>13} {'capture calls/s':>16} {'capture/bare':>13} "
            f"{'bare cpu ms/call':>17} {'capture cpu ms/call':>20}"
        )
        for size in sizes:
            one_size(size, args, bare, capture)
    return 0


def one_size(size: int, args: argparse.Namespace, bare: Server, capture: Server) -> None:
    """Bare and capture runs of one body size, alternating, ``--rounds`` times: its line."""
    body = request(size)
    rates: dict[str, list[float]] = {"bare": [], "capture": []}
    cpu: dict[str, list[float]] = {"bare": [], "capture": []}
    for round_ in range(args.rounds):
        for name, urls, pid in (
            ("bare", [f"{bare.url}/v1/chat/completions"], bare.pid),
            ("capture", _rollout_urls(capture.url, round_), capture.pid),
        ):
            before = cpu_s(pid)
            calls = asyncio.run(load(urls, body, args.workers, args.seconds))
            rates[name].append(calls / args.seconds)
            cpu[name].append((cpu_s(pid) - before) * 1000 / max(1, calls))
    b, c = statistics.median(rates["bare"]), statistics.median(rates["capture"])
    print(
        f"{size:>8} {b:>13.0f} {c:>16.0f} {c / b:>13.2f} "
        f"{statistics.median(cpu['bare']):>17.2f} "
        f"{statistics.median(cpu['capture']):>20.2f}"
    )


def _rollout_urls(proxy: str, round_: int) -> list[str]:
    # Many rollouts, each with its own capture file, as a job's calls are.
    return [f"{proxy}/ng-rollout/{i}-{round_}/v1/chat/completions" for i in range(256)]


if __name__ == "__main__":
    raise SystemExit(main())
