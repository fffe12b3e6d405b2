"""A warm ``python -m dispatcher`` for the tests: one interpreter imports the CLI once,
then forks a child per run.

The suite starts the CLI a few hundred times, and most of each start is importing
aiohttp, pydantic, structlog and the command's modules (about 0.3 s of CPU on a
2-core machine, a quarter of the whole suite). Here one server process per test
worker imports them once; each ``start_cli`` asks it for a child that becomes
``python -m dispatcher ARGS``: a process of its own with its own pid, pipes,
working directory, environment, signals and exit code, running the same
``dispatcher.cli.main`` and ending the interpreter the same way (atexit
handlers, flushed streams, non-daemon threads joined).

A run whose environment changes how Python itself starts (a ``PYTHON*`` variable
other than ``PYTHONUNBUFFERED``), or that needs a ``preexec_fn``, gets a new
interpreter as before, and so does every run with ``TESTS_CLI_FORK=0``.

Protocol, one ``SOCK_SEQPACKET`` connection per run: the test sends a JSON
request (args, env, cwd) with the child's stdin, stdout and stderr as file
descriptors; the server answers with the child's pid and a pidfd (signals go
through it, so a recycled pid is never signalled), and, once the child has
been reaped, with its exit code (``-N`` for signal N, as asyncio reports it).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import importlib
import importlib.util
import io
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ENABLE_ENV = "TESTS_CLI_FORK"
_MAX_REQUEST = 1 << 20


# ---- the test's side ----------------------------------------------------------------------


class ForkedCli:
    """What the tests use of ``asyncio.subprocess.Process``, for a child of the server."""

    def __init__(
        self,
        pid: int,
        pidfd: int,
        conn: socket.socket,
        stdout: asyncio.StreamReader,
        stderr: asyncio.StreamReader,
    ) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._conn = conn
        self._exit = asyncio.ensure_future(self._read_exit())

    async def _read_exit(self) -> int:
        loop = asyncio.get_running_loop()
        data = b""
        while not data.endswith(b"\n"):
            chunk = await loop.sock_recv(self._conn, 64)
            if not chunk:  # the server died: the child is gone with it
                data = b"-9\n"
                break
            data += chunk
        self._conn.close()
        os.close(self._pidfd)
        self.returncode = int(data)
        return self.returncode

    async def wait(self) -> int:
        return await asyncio.shield(self._exit)

    async def communicate(self) -> tuple[bytes, bytes]:
        stdout, stderr = await asyncio.gather(self.stdout.read(), self.stderr.read())
        await self.wait()
        return stdout, stderr

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    """This test process's warm CLI server (started at its first use)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="cli-fork-")
        self.path = os.path.join(self.dir, "sock")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline() != b"ready\n":
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError("the warm CLI server did not start")
        atexit.register(self.close)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # the server kills its children and exits
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self.dir)


_server: _Server | None = None


def _python_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("PYTHON") and k != "PYTHONUNBUFFERED"}


def can_fork(env: Mapping[str, str], preexec_fn: object) -> bool:
    """Whether a run with ``env`` can be a child of the warm server (started here at
    its first use; where it cannot start, every run gets a new interpreter)."""
    if os.environ.get(ENABLE_ENV, "1") == "0" or preexec_fn is not None:
        return False
    if _python_env(env) != _python_env(os.environ):  # what the server starts with
        return False
    return _started()


_unavailable = False


def _started() -> bool:
    global _server, _unavailable
    if _server is None and not _unavailable:
        try:
            _server = _Server()
        except (OSError, RuntimeError, AttributeError) as exc:  # no pidfds, say
            _unavailable = True
            sys.stderr.write(f"the warm CLI server is unavailable, so new interpreters: {exc}\n")
    return _server is not None


async def start_forked(args: list[str], env: Mapping[str, str], cwd: Path | None) -> ForkedCli:
    """``python -m dispatcher ARGS`` as a child of the warm server, stdout and stderr piped."""
    if not _started() or _server is None:  # can_fork said yes: it has started
        raise RuntimeError("the warm CLI server is not running")
    loop = asyncio.get_running_loop()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(_server.path)
        request = {"args": args, "env": dict(env), "cwd": str(cwd or os.getcwd())}
        socket.send_fds(conn, [json.dumps(request).encode()], [null, out_w, err_w])
        reply, fds, _, _ = socket.recv_fds(conn, 64, 1)
    finally:
        for fd in (null, out_w, err_w):
            os.close(fd)
    conn.setblocking(False)
    stdout, stderr = await _reader(loop, out_r), await _reader(loop, err_r)
    return ForkedCli(int(reply), fds[0], conn, stdout, stderr)


async def _reader(loop: asyncio.AbstractEventLoop, fd: int) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(limit=2**16)
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    return reader


# ---- the server's side --------------------------------------------------------------------


def _preload() -> None:
    """Import what every command imports, GC off as ``python -m dispatcher`` has it."""
    gc.disable()
    importlib.import_module("dispatcher.cli")
    from dispatcher.commands import COMMANDS

    for command in COMMANDS:
        importlib.import_module(command.module)
    gc.freeze()


def _serve(path: str) -> tuple[dict[str, Any], list[int]]:
    """Fork a child per request until this process's stdin closes; in a child,
    return its request and its stdin, stdout and stderr."""
    os.close(os.pidfd_open(os.getpid()))  # this kernel has pidfds, or no "ready"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ)
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> pid, connection
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 3)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    conn.close()
                    for pidfd, (_, other) in children.items():
                        os.close(pidfd)
                        other.close()
                    return json.loads(message), fds
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                socket.send_fds(conn, [b"%d" % pid], [pidfd])
                children[pidfd] = (pid, conn)
                selector.register(pidfd, selectors.EVENT_READ)
            elif key.fileobj == sys.stdin.fileno():  # the test process is gone or done
                for pidfd in children:
                    with contextlib.suppress(OSError):
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                raise SystemExit(0)
            else:
                pidfd = key.fd
                pid, conn = children.pop(pidfd)
                selector.unregister(pidfd)
                _, status = os.waitpid(pid, 0)
                os.close(pidfd)
                with contextlib.suppress(OSError):
                    conn.sendall(b"%d\n" % os.waitstatus_to_exitcode(status))
                conn.close()


def _become_cli(request: dict[str, Any], fds: list[int]) -> None:
    """Turn this forked child into ``python -m dispatcher ARGS`` run in ``cwd`` with ``env``."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    # Ctrl-C as at a terminal, whatever the suite was started under: a shell's
    # background job (`make test &` in a script) ignores SIGINT, and so would this.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]  # what `-m` puts first
    spec = importlib.util.find_spec("dispatcher.__main__")
    assert spec is not None and spec.origin is not None
    sys.argv = [spec.origin, *request["args"]]
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = _text_out(1, unbuffered, line_buffering=False, errors="strict")
    sys.stderr = _text_out(2, unbuffered, line_buffering=True, errors="backslashreplace")
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr  # type: ignore[misc]
    gc.disable()  # as `python -m dispatcher` starts: `main` turns it on once parsed


def _text_out(fd: int, unbuffered: bool, line_buffering: bool, errors: str) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    binary = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(
        binary,
        encoding="utf-8",
        errors=errors,
        line_buffering=line_buffering,
        write_through=unbuffered,
    )


if __name__ == "__main__":
    _preload()
    _request, _fds = _serve(sys.argv[1])
    _become_cli(_request, _fds)
    from dispatcher.cli import main

    raise SystemExit(main())
