"""A job's results stream (contracts §12): durable success rows as NDJSON, resumable exactly.

Rows are read back from the job's output file by line number, so the stream
only ever shows what is durable, in commit order, and ``after=SEQ`` resumes
it exactly. A row's line gets ``"_ng_seq": N`` spliced in front (its bytes
are not parsed). With ``group=true`` the stream walks ``groups.jsonl``
instead (``groups.py``) and sends each complete group with its rows.

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
import functools
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import orjson

from dispatcher.files.writer import LineIndex
from dispatcher.lifecycle import JobState

# Lines read per chunk: big enough to amortize the thread hop, small enough
# that a stream of multi-megabyte rows holds a bounded amount of memory.
CHUNK_LINES = 64
CHUNK_BYTES = 8 * 1024 * 1024
# Chunks up to this size are read on the loop, bigger ones in a thread.
READ_ON_LOOP_BYTES = 64 * 1024
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


# A chunk of the stream, and when each of its lines became durable (for the
# stream's delay; None for lines of an earlier daemon).
Chunk = tuple[bytes, list[float | None]]


async def stream(
    source: Source, after: int, group: bool, wait: bool, filtered: bool = False
) -> AsyncIterator[Chunk]:
    """NDJSON chunks: rows (or groups) after ``after``; with ``wait``, up to the end line."""
    index = source.groups if group else source.rows
    next_seq = after + 1
    with _Reader(source.output) as rows, _Reader(source.groups_path) as groups:
        while True:
            # The job's state first: a job final now has every line indexed.
            final = source.final_state()
            # Known as soon as its line is indexed (the same call sets both).
            satisfied = source.satisfied_seq() if group else None
            stop_at = satisfied if satisfied is not None and after < satisfied else None
            end = len(index) if stop_at is None else min(len(index), stop_at)
            if next_seq <= end:
                last = _chunk_end(index, next_seq, end)
                read = (
                    functools.partial(_groups_chunk, groups, rows, source, filtered)
                    if group
                    else functools.partial(_rows_chunk, rows, index)
                )
                size = _chunk_bytes(source, group, next_seq, last)
                chunk = await _read(read, next_seq, last, size)
                next_seq = last + 1
                yield chunk
                continue
            if stop_at is not None:
                if wait:
                    yield _end_line(JobState.SATISFIED.value, None), []
                return
            if final is not None:
                if wait:
                    yield _end_line(final, source.final_error()), []
                return
            if not wait:
                return
            await index.grew.wait(IDLE_CHECK_S)


def _end_line(state: str, error: str | None) -> bytes:
    end: dict[str, str] = {"end": state}
    if error is not None:
        end["error"] = error
    return orjson.dumps(end, option=orjson.OPT_APPEND_NEWLINE)


async def _read(read: Callable[[int, int], Chunk], first: int, last: int, size: int) -> Chunk:
    """Small chunks are read here (page-cache reads of microseconds: a thread hop
    would cost more than it saves); big ones in a thread."""
    if size <= READ_ON_LOOP_BYTES:
        return read(first, last)
    return await asyncio.to_thread(read, first, last)


def _chunk_bytes(source: Source, group: bool, first: int, last: int) -> int:
    """About how many bytes a chunk reads: its rows' span, or for groups an
    estimate from the average row and group sizes (the rows are not known yet)."""
    rows = source.rows
    if not group:
        start, end = rows.span(first, last)
        return end - start
    average_row = rows.end / max(1, len(rows))
    rows_per_group = len(rows) / max(1, len(source.groups))
    return int(average_row * rows_per_group * (last - first + 1))


def _chunk_end(index: LineIndex, first: int, end: int) -> int:
    last = min(end, first + CHUNK_LINES - 1)
    while last > first and index.span(first, last)[1] - index.span(first, first)[0] > CHUNK_BYTES:
        last = first + (last - first) // 2
    return last


class _Reader:
    """A file read with ``pread``, opened when first read."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd: int | None = None

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)

    def read(self, start: int, end: int) -> bytes:
        # Opened on first use: a queued job's files do not exist yet.
        if self._fd is None:
            self._fd = os.open(self._path, os.O_RDONLY)
        return os.pread(self._fd, end - start, start)


def with_seq(line: bytes, seq: int) -> bytes:
    """A row's line with ``"_ng_seq": seq`` first, without parsing it."""
    head = b'{"_ng_seq":%d' % seq
    body = line.rstrip(b"\n")
    if body == b"{}":
        return head + b"}"
    return head + b"," + body[1:]


def _rows_chunk(reader: _Reader, index: LineIndex, first: int, last: int) -> Chunk:
    start, end = index.span(first, last)
    data = reader.read(start, end)
    lines = data.splitlines()
    born = [index.durable_since(seq) for seq in range(first, last + 1)]
    return b"".join(with_seq(line, first + i) + b"\n" for i, line in enumerate(lines)), born


def _groups_chunk(
    groups: _Reader, rows: _Reader, source: Source, filtered: bool, first: int, last: int
) -> Chunk:
    start, end = source.groups.span(first, last)
    out = []
    born: list[float | None] = []
    for i, record in enumerate(groups.read(start, end).splitlines()):
        group = orjson.loads(record)
        flag = b""
        if group.get("filtered") is True:
            if not filtered:
                continue
            flag = b',"filtered":true'
        born.append(source.group_completed_at(group["task_index"]))
        parts = [with_seq(rows.read(*source.rows.span(s, s)), s) for s in group["rows"]]
        out.append(
            b'{"_ng_seq":%d,"task_index":%d,"failures":%d%s,"rows":[%s]}\n'
            % (first + i, group["task_index"], group["failures"], flag, b",".join(parts))
        )
    return b"".join(out), born
