"""The rollouts a job still has to start: the task file's, then what our own faults put back.

``Pending`` reads the materialized rows in batches off the event loop,
skipping those the output files already make final (the resume contract of
``files/resume.py``), and clears each batch's old capture files before its
rollouts start. A rollout put back after a fault of ours (contracts §11) is
started again before the next new one.

On resume, the rollouts whose earlier attempts ran longest start first
(contracts §15: their failure rows, and the rows of rollouts cut off with
``--record-omitted``, carry each attempt's duration): longest first, then in
input order; then every other rollout in input order. Only their offsets in
the materialized file are held, so memory grows with the failed rollouts, not
their rows.

With a ``StartOrder`` (``admission/order.py``, contracts §13, start order) every other
rollout starts in its order instead, longest expected first: the file is read
ahead only as far as its window, a batch of lines once the window has room for
it, each line held as where it starts and ends and its task's digest (as a
number); a row is sliced from the file mapped into memory when it starts (no
read call, no thread hop, no search for its end a row).
The lines read ahead are reserved as one span a read (§5).
"""

from __future__ import annotations

import asyncio
import mmap
import os
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from dispatcher import jsonx
from dispatcher.admission.history import line_key
from dispatcher.admission.order import StartOrder, Waiting
from dispatcher.files.reservations import Reservations
from dispatcher.files.resume import RunState
from dispatcher.rows.capture import clear_rollout_captures
from dispatcher.tasks.keys import materialized_key, task_of
from dispatcher.tasks.materialize import Rollout

READ_BATCH_ROWS = 512
# Rollouts taken from the order at a time: few, so a sibling that finishes
# meanwhile still reorders the rest.
ORDERED_BATCH = 8
# A row the start order takes longer than this is decoded in a worker thread.
INLINE_ROW_BYTES = 64 * 1024


class Pending:
    """The rollouts left to start, in input order, put-back ones first."""

    def __init__(
        self,
        materialized: Path,
        state: RunState,
        capture_dir: Path | None,
        capture_token: str | None,
        reservations: Path,
        order: StartOrder | None = None,
    ) -> None:
        self.order = order
        self._materialized = materialized
        self._state = state
        self._capture_dir = capture_dir
        self._capture_token = capture_token
        self._requeued: deque[Rollout] = deque()
        self._wake = asyncio.Event()
        # Turns the file's lines into rollouts; it reads the earlier hops'
        # reservations in the thread hop of the first read, not a hop of their own.
        self._source = _Source(state, reservations, capture_token)
        # The materialized lines handed out since the last reservation (byte spans).
        self._unreserved: list[tuple[int, int]] = []

    async def reserve(self) -> None:
        """Make the attempt indices of the rollouts handed out so far durable: called
        before one of them is sent (contracts §5). Once per batch read, not per
        rollout; a hop that sends nothing (drained at once) reserves nothing."""
        if self._unreserved:
            spans, self._unreserved = self._unreserved, []
            await asyncio.to_thread(self._source.reserved().reserve, spans)

    def put_back(self, rollout: Rollout) -> None:
        self._requeued.append(rollout)
        self._wake.set()

    def wake(self) -> None:
        """Look again: the last flight landed (the iteration may end)."""
        self._wake.set()

    async def each(self, in_flight: Callable[[], bool]) -> AsyncIterator[Rollout]:
        """Every rollout to start; ends once the file is read and, with nothing
        ``in_flight`` any more, nothing was put back."""
        async for rollout in self._from_file():
            while self._requeued:
                yield await self._take_requeued()
            yield rollout
        while True:
            while self._requeued:
                yield await self._take_requeued()
            if not in_flight():
                return
            self._wake.clear()
            await self._wake.wait()

    async def _take_requeued(self) -> Rollout:
        rollout = self._requeued.popleft()
        # Whatever the faulted try left in the capture dir is not this attempt's.
        await self._clear_captures([rollout])
        return rollout

    async def _from_file(self) -> AsyncIterator[Rollout]:
        """The file's rollouts. A job of a few rows takes one thread hop to read them
        (with the reservations), and one to reserve them: a hop per file read, none
        for what needs no reading (no earlier attempt on record, the end of the file
        seen with its last rows)."""
        source = self._source
        with self._materialized.open("rb") as f:
            first = []
            if self._state.longest_s:
                first = await asyncio.to_thread(longest_first, f, self._state)
            for start in range(0, len(first), READ_BATCH_ROWS):
                offsets = first[start : start + READ_BATCH_ROWS]
                batch = await asyncio.to_thread(_read_at, f, offsets, source, self._unreserved)
                await self._clear_captures(batch)
                for rollout in batch:
                    yield rollout
            f.seek(0)
            skip = frozenset(first)
            if self.order is not None:
                async for rollout in self._ordered(self.order, f, source, skip):
                    yield rollout
                return
            while True:
                rest, ended = await asyncio.to_thread(
                    _read_batch, f, source, self._unreserved, skip
                )
                await self._clear_captures(rest)
                for rollout in rest:
                    yield rollout
                if ended:
                    return

    async def _ordered(
        self, order: StartOrder, f: BinaryIO, source: _Source, skip: frozenset[int]
    ) -> AsyncIterator[Rollout]:
        """The rest of the file in ``order``'s start order."""
        feed = _Feed(f, source.state, skip, order.window)
        with _Lines(f) as lines:
            while True:
                if feed.due(order.admits_until()):
                    found = await asyncio.to_thread(
                        _feed_read, feed, source, order.admits_until(), self._unreserved
                    )
                    order.add_all(found)
                    order.skip_to(feed.position)
                picks = order.take_many(ORDERED_BATCH)
                if not picks:
                    if feed.ended:
                        return
                    continue
                # Reserved as the feed read them: no span of their own.
                batch = []
                for w in picks:
                    line = lines.line(w)
                    if len(line) > INLINE_ROW_BYTES:
                        batch.append(await asyncio.to_thread(source.rollout, line, w.key, w.offset))
                    else:
                        batch.append(source.rollout(line, w.key, w.offset))
                await self._clear_captures(batch)
                for rollout in batch:
                    yield rollout
                history = order.history
                if history is not None and history.due():
                    await history.save()

    async def _clear_captures(self, batch: list[Rollout]) -> None:
        if self._capture_dir is None or not batch:
            return
        await clear_rollout_captures(self._capture_dir, [r.rollout_id for r in batch])


def longest_first(f: BinaryIO, state: RunState) -> list[int]:
    """The offsets of the rollouts to start first: not final, with an earlier attempt's
    duration on record, longest first, then in input order (blocking)."""
    if not state.longest_s:
        return []
    found: list[tuple[float, int]] = []
    offset = 0
    for line in f:
        key = materialized_key(line)
        duration = state.longest_s.get(key)
        if duration is not None and not state.is_final(key):
            found.append((-duration, offset))
        offset += len(line)
    return [offset for _, offset in sorted(found)]


class _Source:
    """What turns a materialized line into a rollout: its attempt index is the next
    one neither a failure row nor an earlier hop's reservation has used (§5)."""

    def __init__(self, state: RunState, reservations: Path, capture_token: str | None):
        self.state = state
        self.capture_token = capture_token
        self._path = reservations
        self._reserved: Reservations | None = None

    def reserved(self) -> Reservations:
        """The reservations, read at the first call (blocking: every read of the
        file calls it first, in its thread)."""
        if self._reserved is None:
            self._reserved = Reservations.load(self._path)
        return self._reserved

    def rollout(self, line: bytes, key: int, offset: int) -> Rollout:
        attempt = max(self.state.attempt_index(key), self.reserved().earlier(offset))
        row = jsonx.loads(line)
        return Rollout.from_materialized(row, attempt, self.capture_token, line)


class _Feed:
    """The materialized file read ahead for a ``StartOrder``: each line not final
    (nor started first) as a ``Waiting``, up to a given input position."""

    def __init__(self, f: BinaryIO, state: RunState, skip: frozenset[int], window: int) -> None:
        self._f = f
        # Lines read at a time once the window has room for them: one thread hop and
        # one reservation a batch, not a few lines each time the window moves on.
        self._batch = max(1, min(READ_BATCH_ROWS * 8, window // 2))
        # A line becomes final only after its rollout starts, so only once it is
        # read: with nothing final when the run starts, no line read is final.
        final = state.successes or state.terminal or state.failed_attempts
        self._is_final = state.is_final if final else None
        self._skip = skip
        self.position = 0  # the next line's input position
        self._offset = 0
        self.ended = False
        self._last = (-1, 0)  # the last row's task index and history key

    def due(self, until: int) -> bool:
        """Whether to read on: lines are left and the window (up to position ``until``)
        has room for a batch of them."""
        return not self.ended and until - self.position >= self._batch

    def read(self, until: int, spans: list[tuple[int, int]]) -> list[Waiting]:
        """The waiting rollouts of the lines before position ``until`` (in a thread);
        the span of lines read is added to ``spans``."""
        found: list[Waiting] = []
        first = offset = self._offset
        position, end = self.position, min(until, self.position + READ_BATCH_ROWS * 8)
        readline, is_final, skip = self._f.readline, self._is_final, self._skip
        # A task's repeats are consecutive lines: its row is parsed once.
        last_task, digest = self._last
        while position < end:
            line = readline()
            if not line:
                self.ended = True
                break
            at, offset = offset, offset + len(line)
            position += 1
            key = materialized_key(line)
            if (is_final is not None and is_final(key)) or at in skip:
                continue
            task = task_of(key)
            if task != last_task:
                last_task, digest = task, line_key(line)
            found.append(Waiting(position - 1, at, offset, key, task, digest))
        self.position, self._offset, self._last = position, offset, (last_task, digest)
        if found:
            spans.append((first, offset))
        return found


class _Lines:
    """The materialized file mapped into memory, for the rows a ``StartOrder`` takes out
    of input order: a row is a slice of the map, not a read and a thread hop a row. The
    feed's thread has read every line it handed the order (their pages are in
    memory); a row longer than ``INLINE_ROW_BYTES`` is still decoded in a thread."""

    def __init__(self, f: BinaryIO) -> None:
        size = os.fstat(f.fileno()).st_size
        # An empty file cannot be mapped, and has no line to take.
        self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def __enter__(self) -> _Lines:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._map is not None:
            self._map.close()

    def line(self, waiting: Waiting) -> bytes:
        """The line ``waiting`` names."""
        assert self._map is not None, "a waiting rollout's line is in the file"
        return self._map[waiting.offset : waiting.end]


def _feed_read(
    feed: _Feed, source: _Source, until: int, spans: list[tuple[int, int]]
) -> list[Waiting]:
    """``feed.read`` (in a thread), the reservations read first if not yet."""
    source.reserved()
    return feed.read(until, spans)


def _read_at(
    f: BinaryIO, offsets: list[int], source: _Source, spans: list[tuple[int, int]]
) -> list[Rollout]:
    """The rollouts of the materialized lines at ``offsets`` (in a thread); their
    byte spans are added to ``spans``, to be reserved before one is sent."""
    source.reserved()
    batch: list[Rollout] = []
    for offset in offsets:
        f.seek(offset)
        line = f.readline()
        batch.append(source.rollout(line, materialized_key(line), offset))
        spans.append((offset, offset + len(line)))
    return batch


def _read_batch(
    f: BinaryIO,
    source: _Source,
    spans: list[tuple[int, int]],
    skip: frozenset[int] = frozenset(),
) -> tuple[list[Rollout], bool]:
    """Up to READ_BATCH_ROWS rollouts not yet final (in a thread), and whether the
    file's end was read. The span of lines read is added to ``spans`` (to be
    reserved before one of them is sent). Lines at the offsets in ``skip`` were
    started first."""
    source.reserved()
    batch: list[Rollout] = []
    first = offset = f.tell()
    ended = False
    for _ in range(READ_BATCH_ROWS * 8):
        line = f.readline()
        if not line:
            ended = True
            break
        at, offset = offset, offset + len(line)
        # Most rows are final on a late resume: find their key without parsing them.
        key = materialized_key(line)
        if source.state.is_final(key) or (skip and at in skip):
            continue
        batch.append(source.rollout(line, key, at))
        if len(batch) >= READ_BATCH_ROWS:
            break
    if batch:
        spans.append((first, offset))
    # An empty batch of a file not read to its end: every line scanned was final.
    return batch, ended
