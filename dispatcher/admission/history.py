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
import itertools
import math
import threading
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator
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
    task = (
        row if _OWN_KEYS.isdisjoint(row) else {k: v for k, v in row.items() if k not in _OWN_KEYS}
    )
    digest = _BLAKE2B.copy()
    digest.update(jsonx.dumps(task, orjson.OPT_SORT_KEYS))
    return digest.hexdigest()


def line_digest(line: bytes) -> str:
    """``task_digest`` of a materialized line."""
    row = jsonx.loads(line)
    # Its own parse: the two keys every materialized row has go without a copy.
    row.pop(TASK_INDEX, None)
    row.pop(ROLLOUT_INDEX, None)
    return task_digest(row)


class TaskHistory:
    """A bounded map of task digest -> moving average of its latency, kept in a file."""

    def __init__(self, path: Path | None, max_tasks: int = DEFAULT_MAX_TASKS) -> None:
        self.path = path
        self.max_tasks = max_tasks
        self._tasks = _Tasks()
        self._unwritten: list[tuple[str, float]] = []
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

    def estimate(self, digest: str) -> float | None:
        """The task's expected latency in seconds; None for a task never seen."""
        return self._tasks.get(_key(digest))

    def observe(self, digest: str, latency_s: float) -> None:
        """One finished rollout of the task: move its average, buffer the update."""
        if not math.isfinite(latency_s) or latency_s < 0:
            return
        key = _key(digest)
        old = self._tasks.get(key)
        average = latency_s if old is None else old + ALPHA * (latency_s - old)
        with self._tasks_lock:
            self._tasks.set(key, average)
            if len(self._tasks) > self.max_tasks:
                extra = len(self._tasks) - self.max_tasks + self.max_tasks // 16
                self._tasks.forget_oldest(extra)
        if self.path is not None:
            self._unwritten.append((_hex(key), average))

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

    def _write(self, lines: list[tuple[str, float]]) -> None:
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

    def _append(self, lines: list[tuple[str, float]]) -> None:
        assert self.path is not None
        with self.path.open("ab") as f:
            f.write(b"".join(_line(d, s) for d, s in lines))
        self._lines_on_disk += len(lines)

    def _compact(self) -> None:
        assert self.path is not None
        with self._tasks_lock:
            tasks = self._tasks.copy()
        snapshot = list(tasks.oldest_first())
        write_atomic(self.path, (_line(_hex(k), s) for k, s in snapshot))
        self._lines_on_disk = len(snapshot)

    def _replay(self, path: Path) -> None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("task_history_not_read", path=str(path), error=str(exc))
            return
        lines = data.split(b"\n")
        if not lines[-1]:
            lines.pop()
        self._lines_on_disk = len(lines)
        # The last update of each task wins, and the ``max_tasks`` updated last stay:
        # read backwards, each task's first update is its last.
        latest: dict[int, float] = {}
        for digest, average in reversed(_parse_all(lines)):
            key = _key(digest)
            if key not in latest:
                latest[key] = average
                if len(latest) >= self.max_tasks:
                    break
        self._tasks = _Tasks.of(reversed(latest.items()))


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
    def of(cls, items: Iterable[tuple[int, float]]) -> _Tasks:
        """The tasks of ``(digest, average)`` pairs, oldest update first."""
        tasks = cls()
        tasks._fill(sorted((key, tick, average) for tick, (key, average) in enumerate(items)))
        tasks._clock = len(tasks.hi)
        return tasks

    def _fill(self, ordered: list[tuple[int, int, float]]) -> None:
        """The arrays from ``(digest, tick, average)`` sorted by digest."""
        self.hi = array("Q", (key >> 64 for key, _, _ in ordered))
        self.lo = array("Q", (key & _LOW for key, _, _ in ordered))
        self.average = array("d", (average for _, _, average in ordered))
        self.tick = array("Q", (tick for _, tick, _ in ordered))

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
        new = self._new.get(key)
        if new is not None:
            return new[0]
        at, found = self._find(key)
        return self.average[at] if found else None

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
        cutoff = sorted(self.tick)[count - 1]
        keep = [tick > cutoff for tick in self.tick]
        self.hi = array("Q", itertools.compress(self.hi, keep))
        self.lo = array("Q", itertools.compress(self.lo, keep))
        self.average = array("d", itertools.compress(self.average, keep))
        self.tick = array("Q", itertools.compress(self.tick, keep))

    def oldest_first(self) -> Iterator[tuple[int, float]]:
        """Every ``(digest, average)``, the one updated longest ago first."""
        self._merge()
        for at in sorted(range(len(self.hi)), key=self.tick.__getitem__):
            yield self.hi[at] << 64 | self.lo[at], self.average[at]


# New tasks wait in a dict until there are this many (~180 KB of it at most).
_MERGE_AT = 1024

_LOW = (1 << 64) - 1


def _key(digest: str) -> int:
    """A task digest (``task_digest``: 32 hex digits) as a number; another name is
    digested into one."""
    try:
        data = bytes.fromhex(digest)
    except ValueError:
        data = b""
    if len(data) != 16:
        data = hashlib.blake2b(digest.encode(), digest_size=16).digest()
    return int.from_bytes(data)


def _hex(key: int) -> str:
    return f"{key:032x}"


def _line(digest: str, average: float) -> bytes:
    return orjson.dumps({"t": digest, "s": average}) + b"\n"


class _Update(msgspec.Struct):
    t: str
    s: float


_UPDATE = msgspec.json.Decoder(_Update)
_UPDATES = msgspec.json.Decoder(list[_Update])


def _parse_all(lines: list[bytes]) -> list[tuple[str, float]]:
    """The updates of ``lines`` in order: all at once, or a line at a time when one
    is torn or foreign (skipped)."""
    try:
        updates = _UPDATES.decode(b"[" + b",".join(lines) + b"]")
    except msgspec.DecodeError:
        updates = None
    if updates is None or len(updates) != len(lines):
        return [u for u in map(_parse, lines) if u is not None]
    return [(u.t, u.s) for u in updates if math.isfinite(u.s) and u.s >= 0]


def _parse(line: bytes) -> tuple[str, float] | None:
    """One update line; None for a torn or foreign one (skipped)."""
    try:
        update = _UPDATE.decode(line)
    except msgspec.DecodeError:
        return None
    if not math.isfinite(update.s) or update.s < 0:
        return None
    return update.t, update.s
