"""Shared pieces of the benchmarks: servers in their own process, child rusage, loop lag."""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from dispatcher.latency.quantile import quantile


@contextmanager
def dispatcher_server(*args: str, log: Path | None = None) -> Iterator[str]:
    """Run ``dispatcher ARGS`` (a server command) in its own process; yield its URL.
    Its log (stderr) goes to ``log`` when given."""
    with server_process([sys.executable, "-m", "dispatcher", *args], args[0], log) as url:
        yield url


@contextmanager
def server_process(command: Sequence[str], name: str, log: Path | None = None) -> Iterator[str]:
    """Run ``COMMAND --listen 127.0.0.1:0`` in its own process until it prints
    ``... listening on URL``; yield the URL. Its stderr goes to ``log`` when given."""
    # The child holds its own copy of the log's descriptor: ours closes at once.
    with log.open("wb") if log is not None else contextlib.nullcontext() as err:
        proc = subprocess.Popen(
            [*command, "--listen", "127.0.0.1:0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL if err is None else err,
        )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    try:
        if "listening on " not in line:
            raise SystemExit(f"{name} did not start: {line!r}")
        yield line.rsplit(" ", 1)[-1].strip()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def compile_package() -> None:
    """Byte-compile the ``dispatcher`` package the children import (``-m`` finds it
    as ``-c`` does: the current directory first), as ``pip install`` and ``make test``
    leave it. Otherwise each child compiles every module it imports (with
    ``PYTHONDONTWRITEBYTECODE`` set, every time): CPU a child's figures must not hold."""
    compile_it = (
        "import compileall, os, dispatcher; "
        "compileall.compile_dir(os.path.dirname(dispatcher.__file__), quiet=1)"
    )
    subprocess.run([sys.executable, "-c", compile_it], check=True)


@dataclass
class ChildRun:
    returncode: int
    wall_s: float
    cpu_s: float
    stderr: bytes
    peak_rss_mb: float

    def events(self, name: str) -> list[dict[str, Any]]:
        found = []
        for line in self.stderr.splitlines():
            if line.startswith(b"{"):
                event = orjson.loads(line)
                if event.get("event") == name:
                    found.append(event)
        return found


def run_child(args: Sequence[str], stderr_path: Path) -> ChildRun:
    """Run a command; measure its wall time and CPU time (``wait4``)."""
    started = time.perf_counter()
    with stderr_path.open("wb") as err:
        proc = subprocess.Popen(list(args), stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
    wall_s = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    return ChildRun(
        returncode=proc.returncode,
        wall_s=wall_s,
        cpu_s=usage.ru_utime + usage.ru_stime,
        stderr=stderr_path.read_bytes(),
        peak_rss_mb=usage.ru_maxrss / 1024,
    )


def rss_mb(pid: int) -> float:
    """A live process's resident memory (VmRSS, from /proc), MB."""
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS")


class ServeProcess:
    """``dispatcher serve FLAGS`` in its own process, state in ``work/state``, its log
    in ``work/serve.log``."""

    def __init__(self, work: Path, *flags: str) -> None:
        self.log = (work / "serve.log").open("wb")
        command = [
            sys.executable, "-m", "dispatcher", "serve", "--listen", "127.0.0.1:0",
            "--state-dir", str(work / "state"), *flags,
        ]  # fmt: skip
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if "listening on " not in line:
            self.log.close()
            # The log goes with a temporary work directory: its last lines are the reason.
            last = (work / "serve.log").read_text(errors="replace").splitlines()[-5:]
            raise SystemExit(
                f"dispatcher serve did not start (stdout {line!r}); its log ends:\n"
                + "\n".join(last)
            )
        self.url = line.split()[-1]

    def rss_mb(self) -> float:
        return rss_mb(self.proc.pid)

    def cpu_s(self) -> float:
        """The daemon's CPU time so far (user + system, every thread), seconds."""
        with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, timeout_s: float = 60) -> int:
        self.proc.terminate()
        code = self.proc.wait(timeout_s)
        self.log.close()
        return code


def write_tasks(path: Path, count: int, agent: str = "sim") -> None:
    """A task file of ``count`` distinct, realistic small rows, written in chunks."""
    with path.open("wb") as f:
        chunk = []
        for i in range(count):
            row = {
                "agent_ref": {"name": agent},
                "responses_create_params": {
                    "input": [{"role": "user", "content": f"Solve problem number {i}."}],
                    "temperature": 1.0,
                },
                "expected_answer": str(i),
            }
            chunk.append(orjson.dumps(row))
            if len(chunk) == 10_000:
                f.write(b"\n".join(chunk) + b"\n")
                chunk = []
        if chunk:
            f.write(b"\n".join(chunk) + b"\n")


def run_bodies(tasks: Path) -> list[bytes]:
    """Each task row as the dispatcher POSTs it to ``/run``: with its task and rollout
    index (an agent answers a body without them 422, "not a run request")."""
    bodies = []
    for index, line in enumerate(tasks.read_bytes().splitlines()):
        row = orjson.loads(line)
        row.update({"_ng_task_index": index, "_ng_rollout_index": 0})
        bodies.append(orjson.dumps(row))
    return bodies


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


class LoopLag:
    """How late a sleep of ``interval_s`` wakes up, sampled while the block runs
    (``async with LoopLag() as lag``); the daemon's own sampler does the same."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self.lags: list[float] = []
        # When each sample ended (perf_counter: the monotonic clock processes share).
        self.ended: list[float] = []
        self._done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._sample())
        await asyncio.sleep(0)  # sampling from here on
        return self

    async def __aexit__(self, *exc: object) -> None:
        # The last sample ends after the block: a stall at its very end counts.
        self._done.set()
        if self._task is not None:
            await self._task

    async def _sample(self) -> None:
        while not self._done.is_set():
            asked = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            now = time.perf_counter()
            self.ended.append(now)
            self.lags.append(max(0.0, now - asked - self.interval_s))

    def quantile(self, q: float) -> float:
        return quantile(sorted(self.lags), q) or 0.0

    @property
    def max(self) -> float:
        return max(self.lags, default=0.0)


async def consume(http: aiohttp.ClientSession, url: str, job_id: str) -> tuple[int, int]:
    """Read a job's group stream to its end: (groups, rows)."""
    groups = rows = 0
    params = {"group": "true", "wait": "true"}
    async with http.get(f"{url}/v1/jobs/{job_id}/results", params=params) as r:
        async for line in r.content:
            data = orjson.loads(line)
            if "end" in data:
                if data["end"] != "done":
                    raise SystemExit(f"{job_id} ended {data['end']}")
                break
            groups += 1
            rows += len(data["rows"])
    return groups, rows
