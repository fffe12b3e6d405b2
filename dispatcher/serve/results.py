"""A job's results stream (contracts §12): durable success rows as NDJSON, resumable exactly.

Rows are read back from the job's output file by line number, so the stream
only ever shows what is durable, in commit order, and ``after=SEQ`` resumes
it exactly. A row's line gets ``"_ng_seq": N`` spliced in front (its bytes
are not parsed). With ``group=true`` the stream walks ``groups.jsonl``
instead (``groups.py``) and sends each complete group with its rows; a
group's line is sent in pieces when its rows are more than a chunk's bytes, so
what a stream holds is bounded by the rows it carries, never by how many rows
a group names.

A live job's line indexes wake waiting streams the moment a batch is
durable; a job that is no longer running is read from its files.

Step control (contracts §13): a grouped stream leaves out the groups marked
``"filtered"`` unless asked for them (their ``_ng_seq`` numbers are skipped,
so ``after=`` still resumes exactly). A grouped stream that starts before
the line of a job's target-th kept group ends right after it, with
``{"end": "satisfied"}`` when it waits; one that starts after it (the tail
of a job that finishes its rollouts in flight) goes on until the job is final.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from dispatcher.files.resume import FAILURE_FACTS, final_after_failure, spends_attempt
from dispatcher.files.writer import LineIndex
from dispatcher.lifecycle import JobState
from dispatcher.serve.lines import EndLine, encode, read_group
from dispatcher.tasks.keys import ROLLOUT_INDEX, SEQ, TASK_INDEX
from dispatcher.tasks.schema import FAILURE_SEQ

# A streamed line's opening: a row's or a group's ``_ng_seq``, a failure's own number.
_SEQ_OPEN = b'{"%s":' % SEQ.encode()
_FAILURE_OPEN = b'{"%s":' % FAILURE_SEQ.encode()

# Lines read per chunk at most: enough to amortize the thread hop. A chunk is
# bounded in bytes too, by the bytes of the rows it carries (the stream's
# buffer bound; one row bigger than it goes alone).
CHUNK_LINES = 64
# Chunks up to this size are read on the loop, bigger ones in a thread unless
# their lines were written lately (HOT_S).
READ_ON_LOOP_BYTES = 64 * 1024
# Streams' big reads have threads of their own: in the default executor they
# queued behind the row writers' fsyncs, which held a group's delivery for
# hundreds of ms at 10,000 in flight (bench/service.py).
_READERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="stream-read")
# Lines made durable this recently are read on the loop whatever their size: a
# chunk is at most the stream's buffer (256 KiB by default) and these are in the
# page cache, just written.
HOT_S = 60.0
# A stream wakes at least this often to check that its job is still running.
IDLE_CHECK_S = 1.0


@dataclass
class Source:
    """Where a job's results are, and whether more may come."""

    output: Path
    rows: LineIndex
    groups_path: Path
    groups: LineIndex
    final_state: Callable[[], str | None]
    # When a task's group completed in this process (monotonic), if it did.
    group_completed_at: Callable[[int], float | None]
    # Why the job failed, once final: the end line carries it.
    final_error: Callable[[], str | None] = lambda: None
    # The groups file's line of the target-th kept group, once the job is satisfied.
    satisfied_seq: Callable[[], int | None] = lambda: None
    # The job's failure rows, and its attempt cap: which of them are final.
    failures_path: Path | None = None
    failures: LineIndex | None = None
    attempt_cap: int = 1


# Lines as they are read, and when each of them became durable.
_Read = tuple[bytes, list[float | None]]
_T = TypeVar("_T")


class Chunk(NamedTuple):
    """A piece of the stream, written to the peer at once: its bytes, when each of its
    lines became durable (for the stream's delay; None for lines of an earlier
    daemon), and whether it is the stream's last (its end goes with it)."""

    data: bytes
    born: list[float | None]
    last: bool = False


async def stream(
    source: Source,
    after: int,
    group: bool,
    wait: bool,
    filtered: bool = False,
    *,
    chunk_bytes: int,
    gone: Callable[[], bool] = lambda: False,
    failures_after: int | None = None,
) -> AsyncGenerator[Chunk, None]:
    """NDJSON chunks: rows (or groups) after ``after``; with ``wait``, up to the end line.
    A chunk carries at most ``chunk_bytes`` of rows, or one row bigger than that. A
    waiting stream whose client is ``gone`` ends (checked at each wake). With
    ``failures_after`` (a stream of rows), the final failure rows after that line of
    the failures file too, as they become durable.

    What is ready at once goes out as one chunk, one write to the peer: the lines
    read in one wake, and the end line with the last of them, up to ``chunk_bytes``
    (each write is a system call and a turn of the send path: a job of one group
    was four). The last chunk says so (its peer's end goes with it); before the
    stream first waits, an empty chunk (its peer has the headers then)."""
    parts: list[bytes] = []
    born: list[float | None] = []
    size = 0
    sent = False
    lines = _lines(source, after, group, wait, filtered, chunk_bytes=chunk_bytes, gone=gone,
                   failures_after=failures_after)  # fmt: skip
    async with contextlib.aclosing(lines):
        async for chunk in lines:
            if chunk is not None and not (parts and size + len(chunk[0]) > chunk_bytes):
                parts.append(chunk[0])
                born.extend(chunk[1])
                size += len(chunk[0])
                continue
            if parts or not sent:
                yield Chunk(b"".join(parts), born)
                parts, born, size, sent = [], [], 0, True
            if chunk is not None:
                parts, born, size = [chunk[0]], list(chunk[1]), len(chunk[0])
    yield Chunk(b"".join(parts), born, last=True)


# The stream is about to wait: what it holds goes out first.
_WAITING = None


async def _lines(
    source: Source,
    after: int,
    group: bool,
    wait: bool,
    filtered: bool,
    *,
    chunk_bytes: int,
    gone: Callable[[], bool],
    failures_after: int | None,
) -> AsyncGenerator[_Read | None, None]:
    """``stream``'s lines as they are read, and ``_WAITING`` before each wait."""
    index = source.groups if group else source.rows
    next_seq = after + 1
    failed = _Failures(source, failures_after, chunk_bytes)
    with _Reader(source.output) as rows, _Reader(source.groups_path) as groups, failed:
        while True:
            # The job's state first: a job final now has every line indexed.
            final = source.final_state()
            if (chunk := await failed.next_chunk()) is not None:
                yield chunk
                continue
            # Known as soon as its line is indexed (the same call sets both).
            satisfied = source.satisfied_seq() if group else None
            stop_at = satisfied if satisfied is not None and after < satisfied else None
            end = len(index) if stop_at is None else min(len(index), stop_at)
            if next_seq <= end:
                last = _chunk_end(index, next_seq, end, chunk_bytes)
                readers = (rows, groups if group else None)
                async for chunk in _chunks(source, readers, filtered, next_seq, last, chunk_bytes):
                    yield chunk
                next_seq = last + 1
                continue
            if stop_at is not None:
                if wait:
                    yield encode(EndLine(JobState.SATISFIED.value)), []
                return
            if final is not None:
                if wait:
                    yield encode(EndLine(final, source.final_error())), []
                return
            if not wait or gone():
                return
            yield _WAITING
            await index.grew.wait(IDLE_CHECK_S)


async def _read(read: Callable[[], _T], size: int, hot: bool) -> _T:
    """Small reads (``size`` bytes) and reads of lines written lately (``hot``) are done
    here: page-cache reads of microseconds, where a thread hop would cost more than it
    saves (on a busy loop, a hop waits for the GIL and a turn of the loop, each way:
    at 10,000 in flight, group deliveries waited hundreds of ms). Others, which may
    go to the disk, in a thread."""
    if hot or size <= READ_ON_LOOP_BYTES:
        return read()
    return await asyncio.get_running_loop().run_in_executor(_READERS, read)


async def _chunks(
    source: Source,
    readers: tuple[_Reader, _Reader | None],
    filtered: bool,
    first: int,
    last: int,
    chunk_bytes: int,
) -> AsyncGenerator[_Read, None]:
    """Lines ``first``..``last`` of the rows, or of the groups when there is a groups reader."""
    rows, groups = readers
    index = source.rows if groups is None else source.groups
    span = _span_bytes(index, first, last)
    # A live job's new lines: its rows were written moments ago.
    hot = _written_lately(index, first)
    if groups is None:
        yield await _read(functools.partial(_rows_chunk, rows, index, first, last), span, hot)
        return
    plan = _GroupPlan(source, filtered, chunk_bytes)
    lines = await _read(functools.partial(groups.lines, index, first, last), span, hot)
    for pieces, born, size in plan.chunks(lines, first):
        fill = functools.partial(_groups_chunk, rows, source.rows, pieces, born)
        yield await _read(fill, size, hot)


class _Failures:
    """The final failure rows of a stream that asked for them, a chunk at a time.

    A rollout's failure is final by its counted failures before it (contracts
    §5), so the file is read from its first line, counting per rollout, and the
    lines after ``after`` are sent. The counts are one entry per rollout that
    failed: bounded by the job's rollouts."""

    def __init__(self, source: Source, after: int | None, chunk_bytes: int) -> None:
        self._index = source.failures if after is not None else None
        self._after = after or 0
        self._next = 1
        self._counted: Counter[tuple[Any, Any]] = Counter()
        self._cap = source.attempt_cap
        self._chunk_bytes = chunk_bytes
        self._reader = _Reader(source.failures_path) if source.failures_path else None

    def __enter__(self) -> _Failures:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._reader is not None:
            self._reader.__exit__()

    async def next_chunk(self) -> _Read | None:
        """The next final failures of the durable lines, or None once caught up."""
        index, reader = self._index, self._reader
        while index is not None and reader is not None and self._next <= len(index):
            first = self._next
            last = _chunk_end(index, first, len(index), self._chunk_bytes)
            self._next = last + 1
            read = functools.partial(reader.lines, index, first, last)
            span, hot = _span_bytes(index, first, last), _written_lately(index, first)
            lines = await _read(read, span, hot)
            out = [
                _FAILURE_OPEN + b'%d,"failure":%s}\n' % (first + i, line)
                for i, line in enumerate(lines)
                if self._final(line) and first + i > self._after
            ]
            if out:
                return b"".join(out), []
        return None

    def _final(self, line: bytes) -> bool:
        """Whether a failure row makes its rollout final (the recorder's rule), counted:
        only the keys that rule reads are decoded."""
        row = FAILURE_FACTS.read(line)
        if row is None:
            return False
        key = (row.get(TASK_INDEX), row.get(ROLLOUT_INDEX))
        final = final_after_failure(row, self._counted[key], self._cap)
        self._counted[key] += spends_attempt(row)
        return final


def _written_lately(index: LineIndex, seq: int) -> bool:
    """Whether line ``seq`` was made durable by this process in the last HOT_S seconds."""
    durable_at = index.durable_since(seq)
    return durable_at is not None and time.monotonic() - durable_at < HOT_S


def _chunk_end(index: LineIndex, first: int, end: int, chunk_bytes: int) -> int:
    """The last line of a chunk from ``first``: at most CHUNK_LINES lines and
    ``chunk_bytes`` bytes, at least one line."""
    last = min(end, first + CHUNK_LINES - 1)
    start = index.span(first, first)[0]
    while last > first and index.span(first, last)[1] - start > chunk_bytes:
        last = first + (last - first) // 2
    return last


class ReaderClosed(Exception):
    """A read that reached its thread after its stream had ended."""


class _Reader:
    """A file read with ``pread``, opened when first read.

    A read may run in a thread that outlives its stream (a client gone cancels the
    stream, not the thread): opening there after the stream closed the reader left
    the descriptor open for good (EMFILE after thousands of readers), and closing
    while a thread reads could hand it another file's descriptor. So the reader
    counts reads in progress under a lock, refuses new ones once closed, and the
    last one out closes the file.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._reading = 0
        self._closed = False

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._closed = True
            self._close_if_idle()

    def read(self, start: int, end: int) -> bytes:
        with self._lock:
            if self._closed:
                raise ReaderClosed(str(self._path))
            # Opened on first use: a queued job's files do not exist yet.
            if self._fd is None:
                self._fd = os.open(self._path, os.O_RDONLY)
            fd = self._fd
            self._reading += 1
        try:
            return os.pread(fd, end - start, start)
        finally:
            with self._lock:
                self._reading -= 1
                self._close_if_idle()

    def _close_if_idle(self) -> None:
        if self._closed and not self._reading and self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def lines(self, index: LineIndex, first: int, last: int) -> list[bytes]:
        """Lines ``first``..``last`` of the file ``index`` indexes."""
        return self.read(*index.span(first, last)).splitlines()


def _span_bytes(index: LineIndex, first: int, last: int) -> int:
    start, end = index.span(first, last)
    return end - start


def with_seq(line: bytes, seq: int) -> bytes:
    """A row's line with ``"_ng_seq": seq`` first, without parsing it.

    The row cannot hold an ``_ng_seq`` of its own: it is a reserved key, dropped
    from an agent's result (rows/build.py), so the line has exactly one."""
    head = _SEQ_OPEN + b"%d" % seq
    body = line.rstrip(b"\n")
    if body == b"{}":
        return head + b"}"
    return head + b"," + body[1:]


def _rows_chunk(reader: _Reader, index: LineIndex, first: int, last: int) -> _Read:
    start, end = index.span(first, last)
    data = reader.read(start, end)
    lines = data.splitlines()
    born = [index.durable_since(seq) for seq in range(first, last + 1)]
    return b"".join(with_seq(line, first + i) + b"\n" for i, line in enumerate(lines)), born


# A piece of a grouped chunk: literal bytes, or the seq of a row to read there.
Piece = bytes | int


class _GroupPlan:
    """Group lines cut into chunks of at most ``chunk_bytes`` of rows each."""

    def __init__(self, source: Source, filtered: bool, chunk_bytes: int) -> None:
        self.source = source
        self.filtered = filtered
        self.chunk_bytes = chunk_bytes

    def chunks(
        self, lines: list[bytes], first: int
    ) -> Iterator[tuple[list[Piece], list[float | None], int]]:
        """(pieces, when each group ended in them became durable, bytes of rows)."""
        pieces: list[Piece] = []
        born: list[float | None] = []
        size = 0
        for i, raw in enumerate(lines):
            group = read_group(raw)
            if (group.filtered or group.surplus) and not self.filtered:
                continue
            flag = b',"filtered":true' if group.filtered else b""
            flag += b',"surplus":true' if group.surplus else b""
            pieces.append(
                _SEQ_OPEN
                + b'%d,"task_index":%d,"failures":%d%s,"rows":['
                % (first + i, group.task_index, group.failures, flag)
            )
            for n, seq in enumerate(group.rows):
                start, end = self.source.rows.span(seq, seq)
                if size and size + (end - start) > self.chunk_bytes:
                    yield pieces, born, size
                    pieces, born, size = [], [], 0
                pieces.extend((b"," if n else b"", seq))
                size += end - start
            pieces.append(b"]}\n")
            born.append(self.source.group_completed_at(group.task_index))
        if pieces:
            yield pieces, born, size


def _groups_chunk(
    reader: _Reader, index: LineIndex, pieces: list[Piece], born: list[float | None]
) -> _Read:
    """A grouped chunk's bytes: its literal pieces and its rows, read."""
    out = [
        p if isinstance(p, bytes) else with_seq(reader.read(*index.span(p, p)), p) for p in pieces
    ]
    return b"".join(out), born
