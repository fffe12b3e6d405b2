"""Shared test helpers: real servers on 127.0.0.1, the real CLI in a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import orjson
import pytest
from aiohttp import web

from dispatcher.run.one_job import Dispatcher
from dispatcher.serve import auth
from dispatcher.settings.config import RunSettings, load_settings
from dispatcher.telemetry.http_app import start_site
from tests.cli_fork import can_fork, start_forked


async def wait_until(
    condition: Callable[[], bool | Awaitable[bool]], timeout_s: float = 10.0, step_s: float = 0.01
) -> None:
    """Poll ``condition`` until true; fail after ``timeout_s``. The only polling helper."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(step_s)


# Sockets that keep free_port()'s ports for the life of this test process.
_HELD_PORTS: list[socket.socket] = []


class _Settable(Protocol):
    def set(self) -> None: ...


E = TypeVar("E", bound=_Settable)


def set_after(monkeypatch: pytest.MonkeyPatch, owner: type, name: str, event: E) -> E:
    """``owner.name``, an async method, sets ``event`` (asyncio's or threading's) each
    time it has returned; returns ``event``."""
    real = getattr(owner, name)

    async def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = await real(self, *args, **kwargs)
        event.set()
        return result

    monkeypatch.setattr(owner, name, wrapped)
    return event


def free_port() -> int:
    """A 127.0.0.1 port nothing listens on, for an address that refuses.

    Its socket stays bound (never listening) until the process ends: under
    `pytest -n` the kernel then hands the port to no other worker's bind of
    port 0, while a server told to listen on it (SO_REUSEADDR, as asyncio's,
    aiohttp's and Prometheus's listeners are) still can.
    """
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    _HELD_PORTS.append(sock)
    port: int = sock.getsockname()[1]
    return port


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request off the wire: its head and its body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
    return head, await reader.readexactly(length)


@contextlib.contextmanager
def listening_port() -> Iterator[int]:
    """A 127.0.0.1 port that listens and never accepts: taken, and its
    connections are made (the kernel queues them) but never answered."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port: int = sock.getsockname()[1]
        yield port


@contextlib.asynccontextmanager
async def sim_agent_process(*args: str) -> AsyncIterator[str]:
    """``dispatcher sim-agent ARGS`` in its own process (its limits and objects are not
    this process's); yields its base URL."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dispatcher", "sim-agent", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdout is not None
    line = (await proc.stdout.readline()).decode()
    assert "listening on " in line, line
    try:
        yield line.rsplit(" ", 1)[-1].strip()
    finally:
        proc.terminate()
        await proc.wait()


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    """Start ``app`` on a free 127.0.0.1 port; returns the runner and base URL."""
    runner, port = await start_site(app, "127.0.0.1", 0)
    return runner, f"http://127.0.0.1:{port}"


def write_tasks(path: Path, count: int, agent: str | None = "sim", **extra: Any) -> Path:
    with path.open("wb") as f:
        for i in range(count):
            row: dict[str, Any] = {"responses_create_params": {"input": f"question {i}"}, **extra}
            if agent is not None:
                row["agent_ref"] = {"name": agent}
            f.write(orjson.dumps(row) + b"\n")
    return path


def in_process_run(tmp_path: Path, url: str, tasks: int, **settings: Any) -> Dispatcher:
    """A ``dispatcher run`` of ``tasks`` rows against ``url``, built in this process."""
    write_tasks(tmp_path / "tasks.jsonl", tasks)
    values = {
        "input": str(tmp_path / "tasks.jsonl"),
        "output": str(tmp_path / "x.jsonl"),
        "agents": {"sim": [url]},
        "metrics_listen": "off",
        "fsync": "never",
        **settings,
    }
    return Dispatcher(load_settings(values, env={}), budget_s=None)


def serve_arguments(tmp_path: Path, agent_url: str) -> tuple[RunSettings, Path, auth.Access]:
    """What ``dispatcher serve`` on ``tmp_path/state`` hands its ``serve``: the run
    settings, the state directory and the access of a loopback listener, no token."""
    state_dir = tmp_path / "state"
    values = {
        "input": str(state_dir / "jobs"), "output": str(state_dir / "jobs" / "x.jsonl"),
        "agents": {"sim": [agent_url]}, "metrics_listen": "127.0.0.1:0", "fsync": "never",
    }  # fmt: skip
    access = auth.access_from_flags(
        listen="127.0.0.1:0", host="127.0.0.1", token_file=None, allow_unauthenticated=False,
        tls_cert=None, tls_key=None, input_root=str(tmp_path), allowed_hosts=[], env={},
    )  # fmt: skip
    return load_settings(values, env={}), state_dir, access


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def keys_of(rows: Iterable[dict[str, Any]]) -> list[tuple[int, int]]:
    return [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows]


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISPATCHER_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


async def start_cli(
    *args: str,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
    cwd: Path | None = None,
) -> asyncio.subprocess.Process:
    """Start ``dispatcher ARGS`` as a subprocess (the test's loop keeps serving meanwhile).

    It is forked from a warm interpreter that has the CLI imported (``tests/cli_fork.py``)
    unless the run needs a new one.
    """
    full_env = cli_env(env)
    if can_fork(full_env, preexec_fn):
        return await start_forked(list(args), full_env, cwd)  # type: ignore[return-value]
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "dispatcher",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=full_env,
        preexec_fn=preexec_fn or _terminal_signals,
        cwd=cwd,
    )


def _terminal_signals() -> None:
    """SIGINT as at a terminal in a new interpreter (one started with it ignored keeps it so)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 120
) -> CliResult:
    """Run ``dispatcher ARGS`` to completion and collect its output."""
    proc = await start_cli(*args, env=env)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode is not None
    return CliResult(proc.returncode, stdout.decode(), stderr.decode())


def run_args(tasks: Path, output: Path, agent_url: str, *extra: str) -> list[str]:
    """The usual ``dispatcher run`` arguments for a test run."""
    return [
        "run",
        "--input",
        str(tasks),
        "--output",
        str(output),
        "--agent",
        f"sim={agent_url}",
        "--metrics-listen",
        "off",
        "--log-format",
        "json",
        *extra,
    ]


def log_events(stderr: str) -> list[dict[str, Any]]:
    """The JSON log lines of a run's stderr."""
    events = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            events.append(orjson.loads(line))
    return events


class CliProcess:
    """A running ``dispatcher`` subprocess whose output is read as it comes.

    Reading both pipes continuously keeps a chatty run from blocking on a full
    pipe, and lets a test wait for a log event while the run goes on.
    """

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.stdout: list[bytes] = []
        self.stderr: list[bytes] = []
        self._pumps = [
            asyncio.create_task(_pump(proc.stdout, self.stdout)),
            asyncio.create_task(_pump(proc.stderr, self.stderr)),
        ]

    @property
    def exited(self) -> bool:
        return self.proc.returncode is not None

    def events(self) -> list[dict[str, Any]]:
        """The JSON log events so far; a line cut by a kill is left out."""
        whole = [line for line in self.stderr if line.endswith(b"\n")]
        return log_events(b"".join(whole).decode())

    def saw(self, event: str) -> bool:
        needle = f'"event":"{event}"'.encode()
        return any(needle in line for line in self.stderr)

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    async def wait(self, timeout_s: float = 60) -> CliResult:
        """Wait for the exit and the end of both pipes."""
        await asyncio.wait_for(self.proc.wait(), timeout_s)
        await asyncio.wait_for(asyncio.gather(*self._pumps), timeout_s)
        assert self.proc.returncode is not None
        return CliResult(
            self.proc.returncode,
            b"".join(self.stdout).decode(),
            b"".join(self.stderr).decode(),
        )

    async def kill(self) -> CliResult:
        """SIGKILL (if still running) and collect what it wrote."""
        if not self.exited:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        return await self.wait()


async def _pump(stream: asyncio.StreamReader | None, into: list[bytes]) -> None:
    assert stream is not None
    async for line in stream:
        into.append(line)


async def spawn_cli(
    *args: str,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
    cwd: Path | None = None,
) -> CliProcess:
    """Start ``dispatcher ARGS`` and keep reading its output (see ``CliProcess``)."""
    return CliProcess(await start_cli(*args, env=env, preexec_fn=preexec_fn, cwd=cwd))


async def listening_url(proc: CliProcess) -> str:
    """The URL a spawned ``dispatcher serve`` says it listens on, once it says it (its
    stderr in the failure when it exits first)."""
    await wait_until(lambda: bool(proc.stdout) or proc.exited, timeout_s=30)
    assert proc.stdout, b"".join(proc.stderr).decode()[-2000:]
    return proc.stdout[0].decode().split()[-1]


def count_lines(path: Path) -> int:
    """Whole lines in ``path`` so far (0 when it does not exist yet)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def expected_keys(tasks: int, repeats: int) -> set[tuple[int, int]]:
    """The (task, rollout) keys of ``write_tasks(count=tasks)`` run with ``repeats``."""
    return {(t, r) for t in range(tasks) for r in range(repeats)}


def expected_rollout_id(key: tuple[int, int], attempt: int) -> str:
    base = f"{key[0]}-{key[1]}"
    return f"{base}-a{attempt}" if attempt else base


@dataclass
class Audit:
    """What a run's output files hold, once ``audit_outputs`` found them consistent."""

    successes: dict[tuple[int, int], dict[str, Any]]
    failures: dict[tuple[int, int], list[dict[str, Any]]]

    def final_failures(self, max_attempts: int) -> set[tuple[int, int]]:
        return {
            key
            for key, rows in self.failures.items()
            if key not in self.successes
            and (rows[-1]["_ng_failure_terminal"] is True or len(rows) >= max_attempts)
        }


def audit_outputs(
    output: Path, expected: set[tuple[int, int]], max_attempts: int, *, complete: bool = True
) -> Audit:
    """Check the resume contract (contracts §4, §5) on a run's files.

    Every line of both files parses and ends in a newline; each expected key
    is in ``X.jsonl`` at most once, and (when ``complete``) exactly once or
    final in the failures sidecar; a key's attempts have increasing indices
    (never one twice: an attempt a killed hop sent is skipped), at least 0..n-1,
    with ``-aN`` ids; a success comes after its failures; nothing final was run
    again.
    """
    failures_path = output.with_name(f"{output.stem}_failures.jsonl")
    for path in (output, failures_path):
        data = path.read_bytes() if path.exists() else b""
        assert not data or data.endswith(b"\n"), f"{path} ends in a torn line"
    success_rows = read_jsonl(output)
    duplicates = [k for k, n in Counter(keys_of(success_rows)).items() if n > 1]
    assert not duplicates, f"rollouts written twice: {sorted(duplicates)[:10]}"
    audit = Audit({}, defaultdict(list))
    for row in success_rows:
        audit.successes[(row["_ng_task_index"], row["_ng_rollout_index"])] = row
    for row in read_jsonl(failures_path):
        audit.failures[(row["_ng_task_index"], row["_ng_rollout_index"])].append(row)
    for key, rows in audit.failures.items():
        _check_failed_attempts(key, rows, max_attempts, key in audit.successes)
    for key, row in audit.successes.items():
        earlier = audit.failures.get(key, ())
        _check_attempt(key, row, _attempt_of(earlier[-1]) + 1 if earlier else 0)
    assert set(audit.successes) | set(audit.failures) <= expected, "rows for unknown rollouts"
    unfinished = expected - set(audit.successes) - audit.final_failures(max_attempts)
    if complete:
        assert not unfinished, f"{len(unfinished)} unfinished: {sorted(unfinished)[:10]}"
    return audit


def _attempt_of(row: dict[str, Any]) -> int:
    return int(row.get("_ng_attempt_index", 0))


def _check_attempt(key: tuple[int, int], row: dict[str, Any], at_least: int) -> None:
    """The row's attempt index is ``at_least`` or later, and its rollout id says it."""
    attempt = _attempt_of(row)
    assert attempt >= at_least, (key, row)
    assert row.get("_ng_attempt_index", 1) != 0, (key, row)  # absent on attempt 0
    assert row["_ng_dispatch"]["rollout_id"] == expected_rollout_id(key, attempt), (key, row)


def _check_failed_attempts(
    key: tuple[int, int], rows: list[dict[str, Any]], max_attempts: int, succeeded: bool
) -> None:
    assert len(rows) <= max_attempts, f"{key}: {len(rows)} failed attempts, cap {max_attempts}"
    at_least = 0
    for row in rows:
        _check_attempt(key, row, at_least)
        at_least = _attempt_of(row) + 1
        assert row["_ng_failure_class"], (key, row)
    # Only the last attempt may be terminal, and nothing runs after it.
    assert not any(r["_ng_failure_terminal"] for r in rows[:-1]), (key, rows)
    if succeeded:
        assert rows[-1]["_ng_failure_terminal"] is False, f"{key}: success after terminal"
        assert len(rows) < max_attempts, f"{key}: success after the attempt cap"


Responder = Callable[[dict[str, Any]], web.StreamResponse | Awaitable[web.StreamResponse]]


def echo_result(body: dict[str, Any]) -> web.StreamResponse:
    """A plain success: the agent's result names the task it ran."""
    return web.json_response({"reward": 1.0, "echo_task": body.get("_ng_task_index")})


class FakeAgent:
    """A scriptable agent server on 127.0.0.1 that the test controls.

    Records every ``POST /run`` body in arrival order and the most requests
    ever in flight at once; ``respond`` (plain or async) makes each answer.
    When ``gated``, each answer waits until the test
    calls ``release_next`` or ``open``; a client that goes away cancels the
    handler (``handler_cancellation``), which is counted in ``disconnects``.
    """

    def __init__(self, respond: Responder = echo_result, *, gated: bool = False) -> None:
        self.respond = respond
        self.gated = gated
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.disconnects = 0
        self._held: list[asyncio.Future[None]] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    @property
    def seen(self) -> int:
        return len(self.bodies)

    @property
    def holding(self) -> int:
        """Requests held now, waiting for ``release_next`` or ``open``."""
        return sum(1 for future in self._held if not future.done())

    def task_indexes(self) -> list[int]:
        return [b["_ng_task_index"] for b in self.bodies]

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/run", self._handle)
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            handler_cancellation=True,
            shutdown_timeout=1.0,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    def release_next(self) -> None:
        """Let the oldest held request answer."""
        for future in self._held:
            if not future.done():
                future.set_result(None)
                return
        raise AssertionError("no request is held")

    def open(self) -> None:
        """Answer every held request and stop holding new ones."""
        self.gated = False
        for future in self._held:
            if not future.done():
                future.set_result(None)

    async def close(self) -> None:
        self.open()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json(loads=orjson.loads)
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.gated:
                held = asyncio.get_running_loop().create_future()
                self._held.append(held)
                await held
            answer = self.respond(body)
            if not isinstance(answer, web.StreamResponse):
                answer = await answer
            return answer
        except asyncio.CancelledError:
            self.disconnects += 1
            raise
        finally:
            self.in_flight -= 1


def indented_blocks(markdown: str) -> list[str]:
    """The indented code blocks of a Markdown text (each after a blank line), in order."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    previous = ""
    for line in markdown.splitlines():
        if line.startswith("    ") and (current is not None or not previous.strip()):
            if current is None:
                current = []
                blocks.append(current)
            current.append(line[4:])
        elif not line.strip() and current is not None:
            current.append("")
        else:
            current = None
        previous = line
    return ["\n".join(block).strip() + "\n" for block in blocks]


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made by openssl (skips the test without it)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl binary to make a self-signed certificate")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key
