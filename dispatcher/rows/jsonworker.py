"""A worker process that validates big answers and finds their top-level values.

A thread that parses holds the GIL for each of the parser's C calls (about
15 ms for a 20 MB body), and the event loop waits for every one of them. A
process holds no lock of ours: the body goes to it through a pipe (the
writes let go of the GIL), and what comes back is small, where each
top-level value lies and the dispatcher's own keys (``rowbytes.Split``).
The loop then keeps the body it already holds and slices it; nothing big is
copied back.

The child is ``python -m dispatcher.jsonworker``: a plain pipe and
length-prefixed frames, no multiprocessing machinery (which would re-import
the CLI as the child's main module). It ends when its input closes, so it
never outlives the dispatcher, even after a ``kill -9``. A child that dies is
a ``LocalFault`` for the rollout it was handling (requeued, §11), and the
next call starts a new one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from typing import IO, Any

from dispatcher.delivery.client import Classified, classify_response
from dispatcher.delivery.faults import LocalFault
from dispatcher.delivery.limits import Body
from dispatcher.files.atomic import write_fully
from dispatcher.rows.wire import Split, split_body

_LENGTH = struct.Struct("!Q")
# Fewer, larger pipe writes: each one gives the GIL back and takes it again.
PIPE_BYTES = 1 << 20

Answer = tuple[str, Any]


def answer_for(raw: bytes) -> Answer:
    """What the child sends back for a 2xx body: a split, or the full parse's verdict."""
    split = split_body(raw)
    if split is not None:
        return ("split", split)
    return ("classified", classify_response(200, raw))


class WorkerProcess:
    """The parent's end: one child, called by one thread at a time (blocking calls)."""

    def __init__(self) -> None:
        self._child: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    def split(self, raw: Body) -> Split | Classified:
        """``raw`` handed to the child, its answer back; ``LocalFault`` if the child is gone."""
        with self._lock:
            child = self._started()
            try:
                kind, value = self._exchange(child, raw)
            except (OSError, EOFError) as exc:
                self._discard()
                raise LocalFault(
                    "worker_exited", f"the big-JSON worker process ended ({exc!r})"
                ) from exc
        if kind == "error":
            raise LocalFault("bug", f"the big-JSON worker raised {value}")
        assert isinstance(value, Split | tuple)
        return value

    def close(self) -> None:
        """End the child: its input closes, it exits."""
        with self._lock:
            self._discard()

    def _started(self) -> subprocess.Popen[bytes]:
        if self._child is None:
            self._child = subprocess.Popen(
                [sys.executable, "-m", "dispatcher.rows.jsonworker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                close_fds=True,
            )
            assert self._child.stdin is not None and self._child.stdout is not None
            _widen(self._child.stdin.fileno())
        return self._child

    def _exchange(self, child: subprocess.Popen[bytes], raw: Body) -> Answer:
        assert child.stdin is not None and child.stdout is not None
        _write_frame(child.stdin.fileno(), raw)
        answer: Answer = pickle.loads(_read_frame(child.stdout))
        return answer

    def _discard(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()
        # Its input is closed: a live child exits at once; a dead one is reaped.
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _widen(fd: int) -> None:
    # A lower pipe-max-size only means smaller writes, same result.
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)


def _write_frame(fd: int, data: Body) -> None:
    os.write(fd, _LENGTH.pack(len(data)))
    write_fully(fd, data)


def _read_frame(stream: IO[bytes]) -> bytes:
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        raise EOFError("the worker closed its output")
    (size,) = _LENGTH.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the worker closed its output mid-answer")
    return data


def serve(source: IO[bytes], sink: IO[bytes]) -> None:
    """The child's loop: a body in, its answer out, until the input ends."""
    _widen(source.fileno())
    while True:
        try:
            raw = _read_frame(source)
        except EOFError:
            return
        try:
            answer = answer_for(raw)
        except Exception as exc:  # a bug of ours: the parent requeues the rollout
            answer = ("error", repr(exc))
        del raw
        data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        sink.write(_LENGTH.pack(len(data)) + data)
        sink.flush()


def main() -> None:
    # A terminal's Ctrl-C and a service manager's SIGTERM reach the whole
    # group: the dispatcher decides when to stop, and the child ends with its input.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Validating is bulk work; the loop's is latency: when both want the CPU,
    # the loop goes first (fewer stalls over 20 ms at 20 MB rows, same rate;
    # nice 10: no loop stall over 15 ms in 16 runs of 120 such rows, where
    # nice 5 had three over 20 ms).
    os.nice(10)
    serve(sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    main()
