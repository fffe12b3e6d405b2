"""The service under hostile clients: daemon memory against its configured bounds.

``dispatcher serve`` runs in its own process with stated bounds
(``--max-streams``, ``--stream-buffer-bytes``, ``--stream-idle-timeout-s``,
``--max-body-bytes-in-flight``, ``--header-timeout-s``, ``--max-job-rollouts``); a
simulated agent answers. Its resident memory is sampled from /proc every
20 ms; each phase prints its peak (VmRSS) above the daemon's memory before the
phase, and what the settings allow for it:

1. A big job (``--big-mb`` of output, rows of ``--row-kb``), then one
   well-behaved ``group=true`` reader of it, read to its end: it may hold
   one stream's buffer and one chunk (each at most ``--stream-buffer-bytes``).
2. ``--streams`` clients open ``wait=true`` streams of the big job and read
   nothing: at most ``--max-streams`` are served (the rest answered 503), each
   holding its buffer and a chunk; after the idle timeout every one is cut
   (open streams and the daemon's file descriptors back to where they were).
3. Six bodies of ``--body-mb`` each sent at once: they are read one at a time
   under ``--max-body-bytes-in-flight``; each is a job over ``--max-job-rollouts``, so
   it is parsed and checked whole, then refused (400), nothing run.
4. ``--jobs`` jobs of inline 2 KB rows, one after another, each to its end:
   RSS after the first tenth and at the end (flat within 10% is the goal).
5. ``--slowloris`` clients that never finish their headers: how many the
   daemon closed, and the longest one lived, against ``--header-timeout-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ServeProcess, dispatcher_server

MIB = 1024 * 1024
# The jobs API takes JSON bodies only: what a browser sends unasked is refused.
JSON_TYPE = {"Content-Type": "application/json"}


class Daemon(ServeProcess):
    """``dispatcher serve`` in its own process, with its bounds."""

    def __init__(self, work: Path, agents: dict[str, str], bounds: dict[str, str]) -> None:
        self.bounds = bounds
        flags = [item for pair in bounds.items() for item in pair]
        for name, url in agents.items():
            flags += ["--agent", f"{name}={url}"]
        super().__init__(
            work, "--concurrency", "256", "--fsync", "never", "--log-format", "json", *flags
        )
        self.host, port = self.url.removeprefix("http://").split(":")
        self.port = int(port)

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def bound(self, flag: str) -> int:
        return int(float(self.bounds[flag]))

    def stop(self, timeout_s: float = 120) -> int:
        return super().stop(timeout_s)


def _status_kb(pid: int, key: bytes) -> int:
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise RuntimeError(f"no {key!r}")


@asynccontextmanager
async def peak(daemon: Daemon, what: str, allowed_mb: float | None) -> AsyncIterator[list[float]]:
    """Sample the daemon's RSS while the block runs; print the peak above the start
    against ``allowed_mb`` (None: just print it); the block gets ``[growth_mb]``."""
    start = daemon.rss_mb()
    top = start
    growth = [0.0]

    async def sample() -> None:
        nonlocal top
        while True:
            top = max(top, daemon.rss_mb())
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample())
    try:
        yield growth
    finally:
        sampler.cancel()
        top = max(top, daemon.rss_mb())
        growth[0] = top - start
        line = f"  {what}: RSS {start:.0f} -> peak {top:.0f} MB (+{top - start:.0f} MB)"
        if allowed_mb is not None:
            verdict = "within" if top - start <= allowed_mb else "OVER"
            line += f"; allowed +{allowed_mb:.0f} MB: {verdict}"
        print(line)


async def api(http: aiohttp.ClientSession, method: str, url: str, body: Any = None) -> Any:
    data = orjson.dumps(body) if body is not None else None
    async with http.request(method, url, data=data, headers=JSON_TYPE) as r:
        return await r.json()


async def until_final(http: aiohttp.ClientSession, url: str, job_id: str) -> dict[str, Any]:
    """Wait for the job's end by reading its results stream to the end line."""
    async with http.get(f"{url}/v1/jobs/{job_id}/results?wait=true") as r:
        async for _ in r.content.iter_any():
            pass
    status: dict[str, Any] = await api(http, "GET", f"{url}/v1/jobs/{job_id}")
    return status


def task(i: int, text_bytes: int, agent: str = "small") -> dict[str, Any]:
    return {"agent_ref": {"name": agent}, "responses_create_params": {"input": "x" * text_bytes},
            "i": i}  # fmt: skip


async def big_job_phase(daemon: Daemon, http: aiohttp.ClientSession, args: Any) -> None:
    rows = max(1, args.big_mb * 1024 // args.row_kb // 4)
    print(f"1. a job of {rows} tasks x 4 repeats, rows of {args.row_kb} KB "
          f"(~{args.big_mb} MB of output)")  # fmt: skip
    started = time.perf_counter()
    body = {"job_id": "big", "rows": [task(i, 64, "big") for i in range(rows)], "num_repeats": 4}
    await api(http, "POST", f"{daemon.url}/v1/jobs", body)
    status = await until_final(http, daemon.url, "big")
    size = (args.work / "state" / "jobs" / "big" / "rollouts.jsonl").stat().st_size
    print(f"  done in {time.perf_counter() - started:.1f} s: {status['rows_durable']} rows, "
          f"{size / MIB:.0f} MB")  # fmt: skip
    buffer_mb = daemon.bound("--stream-buffer-bytes") / MIB
    # A chunk is read (its rows) and built (the same bytes with their seqs) while
    # the previous one is in the buffer; one row bigger than a chunk goes alone.
    allowed = 3 * max(buffer_mb, args.row_kb / 1024) + 8
    async with peak(daemon, "one group=true reader of the whole job", allowed):
        got = 0
        async with http.get(f"{daemon.url}/v1/jobs/big/results?group=true") as r:
            async for chunk in r.content.iter_any():
                got += len(chunk)
    print(f"  read {got / MIB:.0f} MB")


async def open_stream(daemon: Daemon, path: str) -> tuple[int, asyncio.StreamWriter]:
    """A client that asks for a stream and then reads nothing past the status line."""
    reader, writer = await asyncio.open_connection(daemon.host, daemon.port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {daemon.host}\r\n\r\n".encode())
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    return status, writer


async def silent_streams_phase(daemon: Daemon, http: aiohttp.ClientSession, args: Any) -> None:
    limit = daemon.bound("--max-streams")
    idle_s = float(daemon.bounds["--stream-idle-timeout-s"])
    print(f"2. {args.streams} clients open wait=true streams and read nothing "
          f"(--max-streams {limit}, --stream-idle-timeout-s {idle_s:g})")  # fmt: skip
    fds_before = daemon.fds()
    per_stream_mb = 3 * max(daemon.bound("--stream-buffer-bytes") / MIB, args.row_kb / 1024)
    allowed = limit * per_stream_mb + 16
    async with peak(daemon, f"{args.streams} silent streams", allowed):
        opened = await asyncio.gather(
            *(open_stream(daemon, "/v1/jobs/big/results?wait=true") for _ in range(args.streams))
        )
        served = sum(1 for status, _ in opened if status == 200)
        refused = sum(1 for status, _ in opened if status == 503)
        print(f"  served {served}, refused 503 {refused}; daemon fds {fds_before} -> "
              f"{daemon.fds()}")  # fmt: skip
        started = time.perf_counter()
        await streams_closed(daemon, http)
    print(f"  every stream cut {time.perf_counter() - started:.1f} s after they were open "
          f"(idle timeout {idle_s:g} s); daemon fds now {daemon.fds()}")  # fmt: skip
    for _, writer in opened:
        writer.close()


async def streams_closed(daemon: Daemon, http: aiohttp.ClientSession) -> None:
    """Poll /status until no results stream is open (the daemon has no event to wait on)."""
    for _ in range(10_000):
        if not (await api(http, "GET", f"{daemon.url}/status"))["streams_open"]:
            return
        await asyncio.sleep(0.1)


async def send_body(daemon: Daemon, rows: int, row_bytes: int) -> int:
    """POST a job body of ``rows`` rows built as it is sent; the answer's status."""
    row = orjson.dumps(task(0, row_bytes - 80))
    body_len = 10 + rows * (len(row) + 1) + 1
    reader, writer = await asyncio.open_connection(daemon.host, daemon.port)
    writer.write(f"POST /v1/jobs HTTP/1.1\r\nHost: {daemon.host}\r\nContent-Length: {body_len}"
                 "\r\nContent-Type: application/json\r\n\r\n".encode())  # fmt: skip
    writer.write(b'{"rows": [')
    batch = 512
    for start in range(0, rows, batch):
        count = min(batch, rows - start)
        last = start + count == rows
        writer.write(b",".join([row] * count) + (b"" if last else b","))
        await writer.drain()
    writer.write(b" ]}")
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    writer.close()
    return status


async def bodies_phase(daemon: Daemon, http: aiohttp.ClientSession, args: Any) -> None:
    budget_mb = daemon.bound("--max-body-bytes-in-flight") / MIB
    rows = args.body_mb * MIB // 2048
    print(f"3. six bodies of {args.body_mb} MB ({rows} rows of 2 KB) at once "
          f"(--max-body-bytes-in-flight {budget_mb:.0f} MiB)")  # fmt: skip
    started = time.perf_counter()
    # A body in hand is parsed into objects some times its size (one body alone
    # shows how many); the budget admits as many bodies at once as one alone of
    # this size, so six at once are allowed what one took (and 10%), plus 64 MB
    # of allocator slack (freed bodies of a few MB stay in malloc's heap).
    async with peak(daemon, "one body alone", None) as alone_mb:
        alone = await send_body(daemon, rows, 2048)
    print(f"  one body in hand costs x{alone_mb[0] / args.body_mb:.1f} its bytes")
    admitted = max(1, int(budget_mb // args.body_mb))
    async with peak(daemon, "six bodies at once", alone_mb[0] * admitted * 1.1 + 64):
        answers = await asyncio.gather(*(send_body(daemon, rows, 2048) for _ in range(6)))
    print(f"  answers {alone} then {sorted(answers)} in {time.perf_counter() - started:.1f} s")


async def jobs_phase(daemon: Daemon, http: aiohttp.ClientSession, args: Any) -> None:
    print(f"4. {args.jobs} jobs of 10 inline rows of 2 KB, one after another")
    tenth = max(1, args.jobs // 10)
    at_tenth = 0.0
    for n in range(1, args.jobs + 1):
        body = {"job_id": f"small-{n}", "rows": [task(i, 2000) for i in range(10)]}
        await api(http, "POST", f"{daemon.url}/v1/jobs", body)
        await until_final(http, daemon.url, f"small-{n}")
        if n == tenth:
            at_tenth = daemon.rss_mb()
    end = daemon.rss_mb()
    print(f"  RSS after job {tenth}: {at_tenth:.1f} MB, after job {args.jobs}: {end:.1f} MB "
          f"(x{end / at_tenth:.3f}; flat within 10%: {end <= at_tenth * 1.10})")  # fmt: skip


async def slowloris(daemon: Daemon) -> float:
    """A client that sends half a header and waits; seconds until the daemon closed it."""
    reader, writer = await asyncio.open_connection(daemon.host, daemon.port)
    started = time.perf_counter()
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    await writer.drain()
    await reader.read()
    writer.close()
    return time.perf_counter() - started


async def slowloris_phase(daemon: Daemon, http: aiohttp.ClientSession, args: Any) -> None:
    timeout_s = float(daemon.bounds["--header-timeout-s"])
    print(f"5. {args.slowloris} clients that never finish their headers "
          f"(--header-timeout-s {timeout_s:g})")  # fmt: skip
    lived = await asyncio.wait_for(
        asyncio.gather(*(slowloris(daemon) for _ in range(args.slowloris))), timeout_s * 10 + 30
    )
    print(f"  closed by the daemon: {len(lived)} of {args.slowloris}; longest lived "
          f"{max(lived):.1f} s")  # fmt: skip


async def run(daemon: Daemon, args: Any) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        phases: list[Awaitable[None]] = [
            big_job_phase(daemon, http, args),
            silent_streams_phase(daemon, http, args),
            bodies_phase(daemon, http, args),
            jobs_phase(daemon, http, args),
            slowloris_phase(daemon, http, args),
        ]
        for phase in phases:
            await phase
        print(f"daemon peak RSS over the whole run (VmHWM): "
              f"{_status_kb(daemon.proc.pid, b'VmHWM:') / 1024:.0f} MB")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big-mb", type=int, default=300)
    parser.add_argument("--row-kb", type=int, default=128)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--max-streams", type=int, default=256)
    parser.add_argument("--body-mb", type=int, default=250)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--slowloris", type=int, default=100)
    parser.add_argument("--smoke", action="store_true", help="small sizes, under a minute")
    args = parser.parse_args()
    idle_s, header_s = "10", "5"
    if args.smoke:
        args.big_mb, args.row_kb, args.streams, args.max_streams = 20, 64, 100, 32
        args.body_mb, args.jobs, args.slowloris = 4, 50, 20
        idle_s, header_s = "2", "1"
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    body_rows = args.body_mb * MIB // 2048
    bounds = {
        "--max-streams": str(args.max_streams),
        "--stream-buffer-bytes": str(256 * 1024),
        "--stream-idle-timeout-s": idle_s,
        # One body of the six in hand at a time.
        "--max-body-bytes": str((args.body_mb + 1) * MIB),
        "--max-body-bytes-in-flight": str((args.body_mb + 1) * MIB),
        "--header-timeout-s": header_s,
        # The six bodies are each just over it: parsed and checked whole, not run.
        "--max-job-rollouts": str(body_rows - 1),
    }
    print("bounds: " + " ".join(f"{k} {v}" for k, v in bounds.items()))
    with tempfile.TemporaryDirectory() as folder:
        args.work = Path(folder)
        big_args = ("sim-agent", "--latency-s", "0", "--row-bytes", str(args.row_kb * 1024))
        with (
            dispatcher_server(*big_args) as big,
            dispatcher_server("sim-agent", "--latency-s", "0") as small,
        ):
            daemon = Daemon(args.work, {"big": big, "small": small}, bounds)
            try:
                asyncio.run(run(daemon, args))
            finally:
                code = daemon.stop()
            print(f"dispatcher serve exit code after SIGTERM: {code}")


if __name__ == "__main__":
    main()
