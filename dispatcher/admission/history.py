"""Each task's rollout latency, across jobs and restarts (contracts §13, start order).

A task is named by the digest of its input row (``task_digest``: the row's
canonical JSON without the keys the dispatcher sets), so the same prompt in
a later job, a later epoch or another output file finds its history. The
history is a moving average per task (``ALPHA`` of each new latency), at most
``max_tasks`` of them: the task updated longest ago goes first (``max_tasks // 16``
more with it, so forgetting is a rare batch, not a step of every new task).

In memory a task costs ~40 bytes (``_Tasks``: parallel arrays sorted by digest):
a daemon that serves a job per prompt group sees a new task with nearly every
job, and an ordered map of digest strings to floats took ~200 bytes a task,
20 MB of resident memory at the default bound.

On disk, one JSON line per update, ``{"t": digest, "s": average}``, appended
(the last line of a task wins, so replaying the file in order rebuilds the
map and its age order). Once the file holds ``COMPACT_FACTOR`` times more
lines than tasks kept, it is replaced whole (a temporary file renamed over
it). Crash-safe without fsync: a torn last line is skipped, and a history is
a hint (losing its last updates reorders rollouts, never changes a row).
Updates are buffered and appended in a worker thread (``save``).
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import math
import operator
import threading
from array import array
from bisect import bisect_left
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import orjson
import structlog

from dispatcher import jsonx
from dispatcher.files.atomic import write_atomic
from dispatcher.tasks.keys import ATTEMPT_INDEX, CAPTURE_ID, ROLLOUT_ID, ROLLOUT_INDEX, TASK_INDEX

log = structlog.get_logger(__name__)

ALPHA = 0.3
COMPACT_FACTOR = 2
FLUSH_EVERY = 4096
DEFAULT_MAX_TASKS = 100_000
HISTORY_FILE = "task_history.jsonl"
# Keys a materialized row gains from the dispatcher: not part of the task.
_OWN_KEYS = frozenset((TASK_INDEX, ROLLOUT_INDEX, ROLLOUT_ID, ATTEMPT_INDEX, CAPTURE_ID))
_BLAKE2B = hashlib.blake2b(digest_size=16)  # copied: cheaper than made anew each time


def task_digest(row: dict[str, Any]) -> str:
    """The stable name of a task: a digest of its row's canonical JSON (sorted keys),
    the same for every repeat and every job that sends the row."""
    digest: str = _digest(row).hexdigest()
    return digest


def line_key(line: bytes) -> int:
    """``task_key`` of ``task_digest`` of a materialized line, without the hex between."""
    row = jsonx.loads(line)
    # Its own parse: the two keys every materialized row has go without a copy.
    row.pop(TASK_INDEX, None)
    row.pop(ROLLOUT_INDEX, None)
    return int.from_bytes(_digest(row).digest())


def _digest(row: dict[str, Any]) -> Any:
    task = (
        row if _OWN_KEYS.isdisjoint(row) else {k: v for k, v in row.items() if k not in _OWN_KEYS}
    )
    digest = _BLAKE2B.copy()
    digest.update(jsonx.dumps(task, orjson.OPT_SORT_KEYS))
    return digest


def task_key(digest: str | int) -> int:
    """A task's digest as the number the history keys it by (a number is one already):
    ``task_digest``'s 32 hex digits as an integer; any other name is digested into one."""
    if type(digest) is int:
        return digest
    assert isinstance(digest, str)
    try:
        data = bytes.fromhex(digest)
    except ValueError:
        data = b""
    if len(data) != 16:
        data = hashlib.blake2b(digest.encode(), digest_size=16).digest()
    return int.from_bytes(data)


class TaskHistory:
    """A bounded map of task digest -> moving average of its latency, kept in a file.

    A task is named by its digest or by its ``task_key`` (the number; what a caller
    that looks a task up more than once keeps). ``find`` tells where a task is, a
    hint that lets ``observe`` update it without searching again."""

    def __init__(self, path: Path | None, max_tasks: int = DEFAULT_MAX_TASKS) -> None:
        self.path = path
        self.max_tasks = max_tasks
        self._tasks = _Tasks()
        self._unwritten: list[tuple[int, float]] = []
        self._lines_on_disk = 0
        # Jobs of one service share the history; their flushes take turns.
        self._file_lock = threading.Lock()
        # The loop changes the tasks while a flush's thread copies them to compact.
        self._tasks_lock = threading.Lock()

    @classmethod
    def load(cls, path: Path | None, max_tasks: int = DEFAULT_MAX_TASKS) -> TaskHistory:
        """The history in ``path`` (a missing file is an empty history; blocking)."""
        history = cls(path, max_tasks)
        if path is not None:
            history._replay(path)
        return history

    def __len__(self) -> int:
        return len(self._tasks)

    def estimate(self, digest: str | int) -> float | None:
        """The task's expected latency in seconds; None for a task never seen."""
        return self._tasks.get(task_key(digest))

    def find(self, key: int) -> tuple[float | None, int]:
        """``estimate`` of the task ``key`` names, and a hint where it is for ``observe``."""
        return self._tasks.find(key)

    def observe(self, digest: str | int, latency_s: float, hint: int = -1) -> None:
        """One finished rollout of the task: move its average, buffer the update.
        ``hint``: where ``find`` saw the task (searched for again if it has moved)."""
        if not 0.0 <= latency_s < math.inf:  # NaN too
            return
        key = task_key(digest)
        tasks = self._tasks
        with self._tasks_lock:
            average = tasks.move_at(hint, key, latency_s)
            if average is None:
                old = tasks.get(key)
                average = latency_s if old is None else _moved(old, latency_s)
                tasks.set(key, average)
                if len(tasks) > self.max_tasks:
                    tasks.forget_oldest(len(tasks) - self.max_tasks + self.max_tasks // 16)
        if self.path is not None:
            self._unwritten.append((key, average))

    def due(self) -> bool:
        return len(self._unwritten) >= FLUSH_EVERY

    async def save(self) -> None:
        """Write the buffered updates in a worker thread (taken here, on the loop,
        so an update made meanwhile waits for the next save)."""
        lines, self._unwritten = self._unwritten, []
        if lines:
            await asyncio.to_thread(self._write, lines)

    def flush(self) -> None:
        """``save``, blocking."""
        lines, self._unwritten = self._unwritten, []
        self._write(lines)

    def _write(self, lines: list[tuple[int, float]]) -> None:
        """Append ``lines``, or replace the file when it has grown past its bound."""
        if self.path is None or not lines:
            return
        with self._file_lock:
            try:
                if self._lines_on_disk + len(lines) > COMPACT_FACTOR * max(self.max_tasks, 1):
                    self._compact()
                else:
                    self._append(lines)
            except OSError as exc:
                # A hint lost, never a row: the run goes on in its order so far.
                log.warning("task_history_not_written", path=str(self.path), error=str(exc))

    def _append(self, lines: list[tuple[int, float]]) -> None:
        assert self.path is not None
        with self.path.open("ab") as f:
            f.write(b"".join(map(_line, lines)))
        self._lines_on_disk += len(lines)

    def _compact(self) -> None:
        assert self.path is not None
        with self._tasks_lock:
            tasks = self._tasks.copy()
        # Streamed to the file: a list of every task's line (~130 bytes of objects
        # a task) raised the heap's high-water mark at each compaction for good.
        write_atomic(self.path, map(_line, tasks.oldest_first()))
        self._lines_on_disk = len(tasks)

    def _replay(self, path: Path) -> None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("task_history_not_read", path=str(path), error=str(exc))
            return
        self._lines_on_disk = data.count(b"\n") + (bool(data) and not data.endswith(b"\n"))
        digests, averages = _parse_all(data)
        # The last update of each task wins, and the ``max_tasks`` updated last stay,
        # oldest first. A digest's last line (a dict keeps the last value it is given),
        # in C: a history is read before every run.
        last = sorted(dict(zip(digests, itertools.count())).values())[-self.max_tasks :]
        self._tasks = _Tasks.of(
            _task_keys(list(map(digests.__getitem__, last))),
            list(map(averages.__getitem__, last)),
        )


class _Tasks:
    """Tasks' averages in parallel arrays sorted by digest (its high and low 64 bits),
    with the tick of each one's last update: ~40 bytes a task. A lookup is a binary
    search. New tasks wait in a dict and join the arrays ``_MERGE_AT`` at a time: a
    task added alone would move the arrays' tails, a memmove per new task."""

    def __init__(self) -> None:
        self.hi = array("Q")
        self.lo = array("Q")
        self.average = array("d")
        self.tick = array("Q")
        # Not in the arrays yet: digest -> (average, tick).
        self._new: dict[int, tuple[float, int]] = {}
        self._clock = 0

    @classmethod
    def of(cls, keys: list[int], averages: list[float]) -> _Tasks:
        """The tasks of ``keys`` (each once) and their ``averages``, the one updated
        longest ago first."""
        # Each task's place in age order is its tick: sorting the places by key sorts all.
        ordered = sorted(range(len(keys)), key=keys.__getitem__)
        by_key = list(map(keys.__getitem__, ordered))
        tasks = cls()
        tasks.hi = array("Q", map(operator.rshift, by_key, itertools.repeat(64)))
        tasks.lo = array("Q", map(operator.and_, by_key, itertools.repeat(_LOW)))
        tasks.average = array("d", list(map(averages.__getitem__, ordered)))  # a list is faster
        tasks.tick = array("Q", ordered)
        tasks._clock = len(keys)
        return tasks

    def __len__(self) -> int:
        return len(self.hi) + len(self._new)

    def copy(self) -> _Tasks:
        self._merge()
        tasks = _Tasks()
        tasks.hi, tasks.lo = array("Q", self.hi), array("Q", self.lo)
        tasks.average, tasks.tick = array("d", self.average), array("Q", self.tick)
        tasks._clock = self._clock
        return tasks

    def _find(self, key: int) -> tuple[int, bool]:
        """Where ``key`` is in the arrays (True), or where it would go (False)."""
        hi, lo = key >> 64, key & _LOW
        at = bisect_left(self.hi, hi)
        while at < len(self.hi) and self.hi[at] == hi and self.lo[at] < lo:
            at += 1
        return at, at < len(self.hi) and self.hi[at] == hi and self.lo[at] == lo

    def get(self, key: int) -> float | None:
        return self.find(key)[0]

    def find(self, key: int) -> tuple[float | None, int]:
        """The task's average, and where it is in the arrays (-1: not there)."""
        new = self._new.get(key)
        if new is not None:
            return new[0], -1
        at, found = self._find(key)
        return (self.average[at], at) if found else (None, -1)

    def move_at(self, at: int, key: int, latency_s: float) -> float | None:
        """Move the average of the task at ``at`` in the arrays by ``latency_s``, if
        that is ``key``'s place still; its new average, else None (nothing done)."""
        if not 0 <= at < len(self.lo) or self.lo[at] != key & _LOW or self.hi[at] != key >> 64:
            return None
        self.average[at] = average = _moved(self.average[at], latency_s)
        self.tick[at] = self._clock
        self._clock += 1
        return average

    def set(self, key: int, average: float) -> None:
        at, found = (0, False) if key in self._new else self._find(key)
        if found:
            self.average[at] = average
            self.tick[at] = self._clock
        else:
            self._new[key] = (average, self._clock)
            if len(self._new) >= _MERGE_AT:
                self._merge()
        self._clock += 1

    def _merge(self) -> None:
        """The new tasks into the arrays: each one's place found by a binary search,
        the arrays rebuilt from slices between those places (copies, in C)."""
        if not self._new:
            return
        columns: tuple[array[Any], ...] = (self.hi, self.lo, self.average, self.tick)
        merged: tuple[array[Any], ...] = (array("Q"), array("Q"), array("d"), array("Q"))
        start = 0
        for key, (average, tick) in sorted(self._new.items()):
            at, _ = self._find(key)
            for column, out in zip(columns, merged, strict=True):
                out.extend(column[start:at])
            merged[0].append(key >> 64)
            merged[1].append(key & _LOW)
            merged[2].append(average)
            merged[3].append(tick)
            start = at
        for column, out in zip(columns, merged, strict=True):
            out.extend(column[start:])
        self.hi, self.lo, self.average, self.tick = merged
        self._new.clear()

    def forget_oldest(self, count: int) -> None:
        """The ``count`` tasks updated longest ago go."""
        if count <= 0:
            return
        self._merge()
        # The count-th oldest tick, holding count numbers, not every task's.
        cutoff = heapq.nsmallest(count, self.tick)[-1]
        keep = bytes(map(cutoff.__lt__, self.tick))
        self.hi = array("Q", itertools.compress(self.hi, keep))
        self.lo = array("Q", itertools.compress(self.lo, keep))
        self.average = array("d", itertools.compress(self.average, keep))
        self.tick = array("Q", itertools.compress(self.tick, keep))

    def oldest_first(self) -> Iterator[tuple[int, float]]:
        """Every ``(digest, average)``, the one updated longest ago first.

        Walked a slice of ages at a time (``_age_slices``): only the places of one
        slice's tasks are objects at once, not every task's, so a compaction
        leaves the heap as it found it.
        """
        self._merge()
        hi, lo, average, tick = self.hi, self.lo, self.average, self.tick
        for low, high in _age_slices(tick):
            places = [at for at, t in enumerate(tick) if low <= t < high]
            places.sort(key=tick.__getitem__)
            for at in places:
                yield hi[at] << 64 | lo[at], average[at]


# Tasks a slice of ``oldest_first`` holds, about; and at most this many slices
# (each one a pass over the ticks).
_AGE_SLICE = 4096
_AGE_SLICES = 32


def _age_slices(tick: array[int]) -> list[tuple[int, int]]:
    """Tick ranges ``[low, high)`` that cover every tick in ``tick``, in order, each
    holding about the same number of them (cut at quantiles of a sample)."""
    if not tick:
        return []
    slices = min(_AGE_SLICES, -(-len(tick) // _AGE_SLICE))
    sample = sorted(tick[:: max(1, len(tick) // (slices * 16))])
    cuts = sorted({sample[len(sample) * k // slices] for k in range(1, slices)})
    edges = [0, *cuts, max(tick) + 1]
    return list(itertools.pairwise(edges))


# New tasks wait in a dict until there are this many (~180 KB of it at most).
_MERGE_AT = 1024

_LOW = (1 << 64) - 1


def _moved(average: float, latency_s: float) -> float:
    """A task's moving average after one more rollout (``ALPHA`` of the new latency)."""
    return average + ALPHA * (latency_s - average)


def _line(update: tuple[int, float]) -> bytes:
    key, average = update
    return orjson.dumps({"t": f"{key:032x}", "s": average}) + b"\n"


class _Update(msgspec.Struct):
    t: str
    s: float


_UPDATE = msgspec.json.Decoder(_Update)


def _parse_all(data: bytes) -> tuple[list[str], list[float]]:
    """The digests and averages of the update lines of ``data``, in order: all at
    once, or a line at a time when one is torn or foreign (skipped)."""
    try:
        updates = _UPDATE.decode_lines(data)
    except msgspec.DecodeError:
        updates = [u for u in map(_parse, data.split(b"\n")) if u is not None]
    averages = list(map(_AVERAGE, updates))
    # Each is a non-negative number (the sum is NaN or infinite otherwise): checked in C.
    if not (min(averages, default=0.0) >= 0.0 and sum(averages) < math.inf):
        updates = [u for u in updates if 0.0 <= u.s < math.inf]
        averages = list(map(_AVERAGE, updates))
    return list(map(_DIGEST, updates)), averages


_DIGEST = operator.attrgetter("t")
_AVERAGE = operator.attrgetter("s")


def _task_keys(digests: list[str]) -> list[int]:
    """``task_key`` of each digest (at C speed when all are ``task_digest``'s)."""
    try:
        data = list(map(bytes.fromhex, digests))
    except ValueError:
        data = []
    if len(data) == len(digests) and all(map((16).__eq__, map(len, data))):
        return list(map(int.from_bytes, data))
    return list(map(task_key, digests))


def _parse(line: bytes) -> _Update | None:
    """One update line; None for a torn or foreign one (skipped)."""
    try:
        update = _UPDATE.decode(line)
    except msgspec.DecodeError:
        return None
    return update
