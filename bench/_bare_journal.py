"""A bare submit server: ``POST /v1/jobs`` parsed, its line appended to a journal
and fsynced, then answered 201; nothing else.

The floor a burst of submits can be answered in on this machine: aiohttp and
uvloop, one JSON parse a submit, and the one durable write a submit must wait for
(the lines that wait while one fsync runs go in the next write, one fsync for
them all, in one thread), as ``dispatcher serve``'s journal does. No job is
checked, started or run. ``GET /status`` gives its own submit times as the
daemon's does (``submit_s``: p50, p99 of its handler's start to its answer).
``python bench/_bare_journal.py --listen 127.0.0.1:0 --journal FILE`` prints
``listening on URL``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import orjson
import uvloop
from aiohttp import web


class Journal:
    """Lines appended in batches: one write and one fsync for every line that waited."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._thread = ThreadPoolExecutor(1)
        self._waiting: list[tuple[bytes, asyncio.Future[None]]] = []
        self._writing = False

    async def append(self, line: bytes) -> None:
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((line, done))
        if not self._writing:
            self._writing = True
            asyncio.get_running_loop().create_task(self._drain())
        await done

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting:
            batch, self._waiting = self._waiting, []
            await loop.run_in_executor(self._thread, self._write, [b for b, _ in batch])
            for _, done in batch:
                if not done.done():
                    done.set_result(None)
        self._writing = False

    def _write(self, lines: list[bytes]) -> None:
        os.write(self._fd, b"".join(lines))
        os.fsync(self._fd)


def app_for(journal: Journal) -> web.Application:
    took: list[float] = []

    async def submit(request: web.Request) -> web.Response:
        started = time.perf_counter()
        spec = orjson.loads(await request.read())
        if not isinstance(spec, dict) or not isinstance(spec.get("job_id"), str):
            return web.json_response({"error": "job_id: a string is required"}, status=400)
        await journal.append(orjson.dumps(spec, option=orjson.OPT_APPEND_NEWLINE))
        answer = web.json_response({"job_id": spec["job_id"], "state": "queued"}, status=201)
        took.append(time.perf_counter() - started)
        return answer

    async def status(request: web.Request) -> web.Response:
        ordered = sorted(took[-10_000:])
        at = {q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.5, 0.99)}
        submit = {"p50": at[0.5], "p99": at[0.99]} if ordered else {}
        return web.json_response({"submit_s": submit})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/jobs", submit)
    app.router.add_get("/status", status)
    return app


async def serve(host: str, port: int, journal: Path) -> None:
    runner = web.AppRunner(app_for(Journal(journal)), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    bound = runner.addresses[0]
    print(f"bare journal listening on http://{bound[0]}:{bound[1]}", flush=True)
    await asyncio.Event().wait()


@contextmanager
def bare_journal(journal: Path) -> Iterator[str]:
    """The bare submit server in its own process, appending to ``journal``; yields its URL."""
    from _common import server_process

    command = [sys.executable, __file__, "--journal", str(journal)]
    with server_process(command, "the bare journal server") as url:
        yield url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--journal", type=Path, required=True)
    args = parser.parse_args()
    host, port = args.listen.rsplit(":", 1)
    uvloop.run(serve(host, int(port), args.journal))
    return 0


if __name__ == "__main__":
    sys.exit(main())
