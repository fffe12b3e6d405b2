"""The durable row writer (contracts §4); the lock and files written whole are ``atomic.py``'s.

Rows are appended whole by ``write(2)`` (a big row in ``Pieces`` by
``writev(2)``) on an ``O_APPEND`` descriptor, a batch at a time, and the
rollout counts as done only once its batch is written (and fsynced, by
policy). A write that fails truncates the file back to its last good size, so
what is on disk always parses; the writer then refuses further rows.

Before each batch the writer checks that the file under its name is still the
one it opened, at the size it left it: a file deleted, replaced or truncated
under a running dispatcher would otherwise take rows into a deleted inode (a
run that "succeeds" with its output gone) or leave a torn line in the middle
of the file for good. That stops the run (exit 1) naming the file.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeAlias

import orjson
import structlog

from dispatcher import jsonx
from dispatcher.aio import Wakeup
from dispatcher.errors import OutputWriteError
from dispatcher.files.atomic import write_fully

# How durable a row is before it counts as written (``--fsync``).
FsyncPolicy = Literal["always", "batch", "never"]

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Pieces:
    """A row's line kept as its pieces, in order: written by ``writev(2)``, never joined.

    A big row's kept values are slices of the agent's body (``rows/wire.py``).
    ``bytes.join`` lets go of the GIL only when every part is ``bytes``: joining
    slices copies the whole row with the GIL held, and the event loop waits
    (about 60 ms for a 20 MB row in ``bench/big_rows.py`` on 2 cores, where
    each fresh page of the copy faults). ``writev`` copies them into the page cache
    with the GIL released, and no joined copy is ever made.
    """

    parts: tuple[bytes | memoryview, ...]
    size: int

    def __len__(self) -> int:
        return self.size


class Shielded(asyncio.Future[int | None]):
    """A row's future that a cancel leaves pending (``RowWriter.submit``): the task
    awaiting it is cancelled once it is settled, not before."""

    __slots__ = ()

    def cancel(self, msg: Any | None = None) -> bool:
        return False


# One row's line: one JSON object and its newline.
Line: TypeAlias = bytes | Pieces


def open_for_append(path: Path) -> int:
    """A row file's descriptor for appending, created if absent (blocking)."""
    try:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        raise OutputWriteError(f"{path}: cannot open for writing: {exc.strerror}") from exc


class RowWriter:
    """Appends JSON rows to one file with group commit.

    ``append`` returns once the row is on disk by the fsync policy:
    ``always`` fsyncs each batch as soon as the previous one is done,
    ``batch`` gathers rows for up to ``interval_s``, ``max_rows`` or ``max_bytes`` first,
    or only until ``quiet()`` says no row is coming soon (its job has nothing at
    an agent: waiting would only delay the rows in hand) or ``hurry`` says a
    caller waits on them, ``never`` writes without fsync. Writes and fsyncs run
    in a thread, but for a small batch without fsync, written on the loop.
    """

    def __init__(
        self,
        path: Path,
        policy: FsyncPolicy,
        *,
        interval_s: float = 0.05,
        max_rows: int = 256,
        max_bytes: int = 4 << 20,
        on_error: Callable[[OutputWriteError], None] | None = None,
        index: LineIndex | None = None,
        quiet: Callable[[], bool] | None = None,
        barrier: Awaitable[None] | None = None,
    ) -> None:
        self.path = path
        self._policy = policy
        self._quiet = quiet
        # Awaited before the first batch: what must be durable before any row is.
        self._barrier = barrier
        self._interval_s = interval_s if policy == "batch" else 0.0
        self._max_rows = max_rows
        # Big rows: a batch this size gains nothing by waiting (its write and fsync
        # outweigh one more fsync), and the commit queue's byte bound would let
        # few more rows in meanwhile: the window only held them up.
        self._max_bytes = max_bytes
        self._pending_bytes = 0
        self._on_error = on_error
        self.index = index
        self._fd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._size = 0
        self._pending: list[tuple[Line, asyncio.Future[int | None]]] = []
        self._wakeup = asyncio.Event()
        self._hurried = False
        self._flusher: asyncio.Task[None] | None = None
        self._error: OutputWriteError | None = None
        self._closing = False
        self.rows_written = 0

    @property
    def error(self) -> OutputWriteError | None:
        return self._error

    def open(self, fd: int | None = None) -> None:
        """Start writing: to ``fd`` when given (``open_for_append`` of its path, in a
        thread), else to the file opened here."""
        self._fd = open_for_append(self.path) if fd is None else fd
        self._size = os.fstat(self._fd).st_size
        # Kept: ``asyncio.get_running_loop`` is a ``getpid`` system call on Python 3.11,
        # and ``submit`` needs the loop for every row.
        self._loop = asyncio.get_running_loop()
        self._flusher = self._loop.create_task(self._flush_loop(), name=f"writer:{self.path.name}")

    async def append(self, row: Mapping[str, Any]) -> None:
        """Queue one row and wait until it is durable; raises ``OutputWriteError``."""
        await self.append_line(jsonx.dumps(row, option=orjson.OPT_APPEND_NEWLINE))

    async def append_line(self, line: Line) -> int | None:
        """``append`` for a row already serialized: one JSON object and its newline.

        Returns the row's line number (from 1) when the writer keeps a
        ``LineIndex``, else None.
        """
        return await self.submit(line)

    def submit(self, line: Line, *, shielded: bool = False) -> asyncio.Future[int | None]:
        """Queue ``line`` (``append_line`` without the wait): a future of its line number,
        set once the line is durable. Raises ``OutputWriteError`` at once after a failure.

        ``shielded``: the future refuses a cancel, so a task that awaits it and is
        cancelled meanwhile sees its ``CancelledError`` only once the line is
        settled, and can still count it (``asyncio.shield`` without its extra
        future, callbacks and turn of the loop).
        """
        if self._error is not None:
            raise self._error
        loop = self._loop or asyncio.get_running_loop()
        future = Shielded(loop=loop) if shielded else loop.create_future()
        pending = self._pending
        pending.append((line, future))
        self._pending_bytes += len(line)
        # The flusher is woken by a batch's first row and by what ends its window
        # early; any other row would wake it only to wait again (a task and a
        # timer per row in ``_gather_window``).
        if len(pending) == 1 or self._window_full():
            self._wakeup.set()
        return future

    def _window_full(self) -> bool:
        """Whether the rows in hand end the gathering window now (``_gather_window``)."""
        return (
            not self._interval_s
            or len(self._pending) >= self._max_rows
            or self._pending_bytes >= self._max_bytes
            or (self._quiet is not None and self._quiet())
            or self._hurried
        )

    def hurry(self, hurried: bool) -> None:
        """While hurried, each batch is written at once, gathering nothing more (what
        comes meanwhile waits for the write before it, as with ``always``): a row
        someone waits on is not held for a batch."""
        self._hurried = hurried
        if hurried and self._pending:
            self._wakeup.set()  # a batch gathering now stops there

    async def close(self) -> None:
        """Write what is queued, then close."""
        self._closing = True
        self._wakeup.set()
        if self._flusher is not None:
            await self._flusher
            self._flusher = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        # Closed, it reports nothing more; its owner's callbacks would hold the
        # owner in a reference cycle (what a long-lived daemon frees late).
        self._on_error = self._quiet = self._barrier = None

    async def _flush_loop(self) -> None:
        """Write batches until closed; if it dies, every waiting row fails with it.

        A flusher that died silently would leave each ``append`` waiting for
        ever: the run would hang instead of failing.
        """
        try:
            await self._flush_batches()
        except Exception as exc:
            self._error = OutputWriteError(f"{self.path}: the row writer failed: {exc!r}")
            log.error("row_writer_failed", path=str(self.path), exc_info=exc)
            batch = self._take_batch()
            _settle([f for _, f in batch], self._error, 0)
            if self._on_error is not None:
                self._on_error(self._error)

    async def _flush_batches(self) -> None:
        while True:
            await self._wakeup.wait()
            if self._interval_s and not self._closing:
                await self._gather_window()
            self._wakeup.clear()
            batch = self._take_batch()
            if batch and self._barrier is not None:
                barrier, self._barrier = self._barrier, None
                try:
                    await barrier
                except BaseException:
                    self._pending = batch + self._pending  # failed by _flush_loop
                    raise
            if batch:
                try:
                    if self._on_loop(batch):
                        self._written(batch, *self._write_batch(batch))
                    else:
                        await asyncio.to_thread(self._commit, batch)
                except BaseException:
                    self._pending = batch + self._pending  # failed by _flush_loop
                    self._pending_bytes += sum(len(line) for line, _ in batch)
                    raise
            if self._closing and not self._pending:
                return

    async def _gather_window(self) -> None:
        deadline = asyncio.get_running_loop().time() + self._interval_s
        while not self._closing and not self._window_full():
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), remaining)

    def _take_batch(self) -> list[tuple[Line, asyncio.Future[int | None]]]:
        batch, self._pending = self._pending, []
        self._pending_bytes = 0
        return batch

    def _on_loop(self, batch: list[tuple[Line, asyncio.Future[int | None]]]) -> bool:
        """Whether to write ``batch`` here: without fsync, a small batch is a copy into
        the page cache of microseconds, where a thread hop (waking a thread, the GIL,
        then waking the loop) costs more than it saves: milliseconds on a busy
        machine, on the way of each row to a caller that waits for it."""
        return self._policy == "never" and sum(len(line) for line, _ in batch) <= ON_LOOP_BYTES

    def _commit(self, batch: list[tuple[Line, asyncio.Future[int | None]]]) -> None:
        """Write one batch (in a thread) and settle its futures on the loop."""
        start, error = self._write_batch(batch)
        loop = batch[0][1].get_loop()
        loop.call_soon_threadsafe(self._written, batch, start, error)

    def _write_batch(
        self, batch: list[tuple[Line, asyncio.Future[int | None]]]
    ) -> tuple[int, OutputWriteError | None]:
        """Write one batch (blocking): where it starts, and the error that stopped it."""
        lines = [line for line, _ in batch]
        error: OutputWriteError | None = None
        start = self._size
        try:
            self._check_unchanged()
            self._write_all(lines)
        except _ChangedUnderUs as exc:
            error = self._refuse(str(exc))
        except OSError as exc:
            error = self._fail(exc)
        if error is None:
            self.rows_written += len(batch)
        return start, error

    def _written(
        self,
        batch: list[tuple[Line, asyncio.Future[int | None]]],
        start: int,
        error: OutputWriteError | None,
    ) -> None:
        """On the loop: index the batch's lines (durable now), then wake their rows."""
        first_seq = 0
        if error is None and self.index is not None:
            first_seq = self.index.add(start, [len(line) for line, _ in batch])
        _settle([f for _, f in batch], error, first_seq)

    def _check_unchanged(self) -> None:
        """Raise ``_ChangedUnderUs`` unless our name still leads to our file, at our size."""
        assert self._fd is not None
        ours = os.fstat(self._fd)
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            raise _ChangedUnderUs("was deleted while the run was writing it") from None
        if not os.path.samestat(ours, named):
            raise _ChangedUnderUs("was replaced by another file while the run was writing it")
        if ours.st_size < self._size:
            raise _ChangedUnderUs(
                f"was truncated while the run was writing it ({ours.st_size} bytes, "
                f"expected {self._size})"
            )
        if ours.st_size > self._size:
            raise _ChangedUnderUs(
                f"was written by someone else while the run was writing it "
                f"({ours.st_size} bytes, expected {self._size})"
            )

    def _refuse(self, problem: str) -> OutputWriteError:
        # Not ours to repair: no truncation, and nothing more is appended.
        self._error = OutputWriteError(f"{self.path} {problem}; the run stops")
        log.error("output_changed_under_run", path=str(self.path), problem=problem)
        return self._error

    def _write_all(self, lines: list[Line]) -> None:
        assert self._fd is not None
        size = sum(len(line) for line in lines)
        for chunk in _chunks(lines):
            if isinstance(chunk, Pieces):
                writev_all(self._fd, chunk.parts)
                continue
            write_fully(self._fd, chunk)
        if self._policy != "never":
            os.fsync(self._fd)
        self._size += size

    def _fail(self, exc: OSError) -> OutputWriteError:
        # Cut back to the last whole batch so the file still parses.
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
        self._error = OutputWriteError(f"{self.path}: write failed: {exc.strerror or exc}")
        log.error("output_write_failed", path=str(self.path), error=str(exc))
        return self._error


# A batch up to this size is written on the loop when it is not fsynced (``_on_loop``).
ON_LOOP_BYTES = 64 * 1024

# Rows smaller than this are joined into one write; a bigger one is written as
# it is, not copied into a joined batch first. (writev(2) of the batch was
# measured no cheaper than a write(2) per big row: bench/big_rows.py --write-compare.)
JOIN_BYTES = 1 << 20


def _chunks(lines: list[Line]) -> Iterator[Line]:
    """A batch as few writes, without copying its big rows once more."""
    small: list[bytes] = []
    size = 0
    for line in lines:
        if isinstance(line, Pieces) or len(line) >= JOIN_BYTES:
            if small:
                yield b"".join(small)
                small, size = [], 0
            yield line
            continue
        small.append(line)
        size += len(line)
        if size >= JOIN_BYTES:
            yield b"".join(small)
            small, size = [], 0
    if small:
        yield b"".join(small)


# writev(2) takes at most this many buffers a call (POSIX's minimum is 16).
IOV_MAX = os.sysconf("SC_IOV_MAX")


def writev_all(fd: int, parts: Iterable[bytes | memoryview]) -> None:
    """Write ``parts`` in order, resuming after a short write."""
    views = [memoryview(part) for part in parts]
    while views:
        written = os.writev(fd, views[:IOV_MAX])
        while views and written >= views[0].nbytes:
            written -= views.pop(0).nbytes
        if written:
            views[0] = views[0][written:]


class _ChangedUnderUs(Exception):
    """The output file is not the one the writer opened, or not at its size."""


# Rows acknowledged per loop iteration: each wakes a commit that logs and
# counts its rollout, and a whole batch at once would stall the loop.
SETTLE_CHUNK = 32


def _settle(
    futures: list[asyncio.Future[int | None]], error: BaseException | None, first_seq: int
) -> None:
    """Wake each row's commit with its line number (``first_seq`` on; 0: not indexed)."""
    for i, future in enumerate(futures[:SETTLE_CHUNK]):
        if future.done():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(first_seq + i if first_seq else None)
    if len(futures) > SETTLE_CHUNK:
        rest = futures[SETTLE_CHUNK:]
        next_seq = first_seq + SETTLE_CHUNK if first_seq else 0
        asyncio.get_running_loop().call_soon(_settle, rest, error, next_seq)


class LineIndex:
    """Where each line of an output file starts, so rows can be read by line number.

    Service mode's results stream reads a job's rows from its file by their
    ``_ng_seq`` (line number, from 1). The writer adds each batch once it is
    durable and fires ``grew``; readers wait on it.
    """

    def __init__(self) -> None:
        self.starts = array.array("Q")
        # When each line added by a writer became durable (monotonic); lines
        # read back from an earlier hop have none.
        self.durable_at = array.array("d")
        self.end = 0
        self.grew = Wakeup()

    def __len__(self) -> int:
        return len(self.starts)

    def add(self, start: int, lengths: list[int]) -> int:
        """Index lines of ``lengths`` bytes written from ``start``; the first one's number."""
        first_seq = len(self.starts) + 1
        offset = start
        now = time.monotonic()
        for length in lengths:
            self.starts.append(offset)
            self.durable_at.append(now)
            offset += length
        self.end = offset
        self.grew.fire()
        return first_seq

    def durable_since(self, seq: int) -> float | None:
        """Monotonic time line ``seq`` became durable, when this process wrote it."""
        missing = len(self.starts) - len(self.durable_at)
        return self.durable_at[seq - 1 - missing] if seq > missing else None

    def span(self, first_seq: int, last_seq: int) -> tuple[int, int]:
        """Byte offsets ``[start, end)`` of lines ``first_seq``..``last_seq``."""
        start = self.starts[first_seq - 1]
        end = self.starts[last_seq] if last_seq < len(self.starts) else self.end
        return start, end

    @classmethod
    def scan(cls, path: Path) -> LineIndex:
        """An index of a file's whole lines (blocking). A torn tail is never indexed."""
        index = cls()
        index.load(path)
        return index

    def load(self, path: Path) -> None:
        """Index the whole lines a file holds now (blocking; before anything is added)."""
        offset = 0
        with contextlib.suppress(FileNotFoundError), path.open("rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break
                self.starts.append(offset)
                offset += len(line)
        self.end = offset
