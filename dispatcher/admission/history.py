"""Each task's rollout latency, across jobs and restarts (contracts §13, start order).

A task is named by the digest of its input row (``task_digest``: the row's
canonical JSON without the keys the dispatcher sets), so the same prompt in
a later job, a later epoch or another output file finds its history. The
history is a moving average per task (``ALPHA`` of each new latency), at most
``max_tasks`` of them: the task updated longest ago goes first (``max_tasks // 16``
more with it, so forgetting is a rare batch, not a step of every new task).

In memory a task costs ~40 bytes (``_Tasks``: parallel arrays and a table of places):
a daemon that serves a job per prompt group sees a new task with nearly every
job, and an ordered map of digest strings to floats took ~200 bytes a task,
20 MB of resident memory at the default bound.

On disk, one JSON line per update, ``{"t": digest, "s": average}``
(``history_file.py``), appended (the last line of a task wins, so replaying the
file in order rebuilds the map and its age order). Once the file holds
``COMPACT_FACTOR`` times more lines than tasks kept, it is replaced whole (a
temporary file renamed over it). Crash-safe without fsync: a torn last line is
skipped, and a history is a hint (losing its last updates reorders rollouts,
never changes a row). Updates are buffered and appended in a worker thread
(``save``).
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import math
import operator
import sys
import threading
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import structlog

from dispatcher import jsonx
from dispatcher.admission.history_file import parse_updates, update_line, update_lines
from dispatcher.files.atomic import write_atomic
from dispatcher.tasks.keys import ATTEMPT_INDEX, CAPTURE_ID, ROLLOUT_ID, ROLLOUT_INDEX, TASK_INDEX

log = structlog.get_logger(__name__)

ALPHA = 0.3
COMPACT_FACTOR = 2
FLUSH_EVERY = 4096
SETTLE_EVERY = 512
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
        self._tasks = _Tasks(min(max_tasks, _PRESIZED))
        # Updates not written yet: each task's key and its new average.
        self._unwritten: tuple[list[int], list[float]] = ([], [])
        # Observations not applied yet: ``_settle`` moves their tasks in one pass
        # (a method call, a lock and a search fewer each).
        self._observed: list[tuple[int, float, int]] = []
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
        self._settle()
        return len(self._tasks)

    def estimate(self, digest: str | int) -> float | None:
        """The task's expected latency in seconds; None for a task never seen."""
        self._settle()
        return self._tasks.get(task_key(digest))

    def find(self, key: int) -> tuple[float | None, int]:
        """``estimate`` of the task ``key`` names, and a hint where it is for ``observe``."""
        if self._observed:
            self._settle()
        return self._tasks.find(key)

    def observe(self, digest: str | int, latency_s: float, hint: int = -1) -> None:
        """One finished rollout of the task: move its average, buffer the update.
        ``hint``: where ``find`` saw the task (searched for again if it has moved)."""
        if not 0.0 <= latency_s < math.inf:  # NaN too
            return
        key = digest if type(digest) is int else task_key(digest)
        observed = self._observed
        observed.append((key, latency_s, hint))
        if len(observed) >= SETTLE_EVERY:
            self._settle()

    def _settle(self) -> None:
        """Apply the observations made since the last time (every read of the
        history does so first)."""
        observed, self._observed = self._observed, []
        if not observed:
            return
        with self._tasks_lock:
            averages = self._tasks.move_all(observed, self.max_tasks)
        if self.path is not None:
            keys, written = self._unwritten
            keys += map(_KEY, observed)
            written += averages

    def due(self) -> bool:
        """Whether enough updates wait to be written (``save``)."""
        return len(self._unwritten[0]) + len(self._observed) >= FLUSH_EVERY

    async def save(self) -> None:
        """Write the buffered updates in a worker thread (taken here, on the loop,
        so an update made meanwhile waits for the next save)."""
        self._settle()
        lines, self._unwritten = self._unwritten, ([], [])
        if lines[0]:
            await asyncio.to_thread(self._write, *lines)

    def flush(self) -> None:
        """``save``, blocking."""
        self._settle()
        lines, self._unwritten = self._unwritten, ([], [])
        self._write(*lines)

    def _write(self, keys: list[int], averages: list[float]) -> None:
        """Append the updates of ``keys`` to ``averages``, or replace the file when it
        has grown past its bound."""
        if self.path is None or not keys:
            return
        with self._file_lock:
            try:
                if self._lines_on_disk + len(keys) > COMPACT_FACTOR * max(self.max_tasks, 1):
                    self._compact()
                else:
                    self._append(keys, averages)
            except OSError as exc:
                # A hint lost, never a row: the run goes on in its order so far.
                log.warning("task_history_not_written", path=str(self.path), error=str(exc))

    def _append(self, keys: list[int], averages: list[float]) -> None:
        assert self.path is not None
        with self.path.open("ab") as f:
            f.write(update_lines(keys, averages))
        self._lines_on_disk += len(keys)

    def _compact(self) -> None:
        assert self.path is not None
        with self._tasks_lock:
            tasks = self._tasks.copy()
        # Streamed to the file: a list of every task's line (~130 bytes of objects
        # a task) raised the heap's high-water mark at each compaction for good.
        write_atomic(self.path, map(update_line, tasks.oldest_first()))
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
        digests, averages = _last_updates(*parse_updates(data), self.max_tasks)
        self._tasks = _Tasks.of(_task_halves(digests), averages)


class _Tasks:
    """Tasks' averages in parallel arrays, a place a task in the order the tasks came,
    with the tick of each one's last update: 32 bytes a task. A table of places,
    open addressing on the digest's bits (``_index``: a place + 1 a slot, 0 empty,
    at most 3/4 full: 5 to 11 bytes a task), finds a task in a probe or two; a new
    task is an append. Places change only when tasks are forgotten (the arrays
    compressed, the table made anew)."""

    __slots__ = ("_clock", "_index", "_places_id", "average", "hi", "lo", "tick")

    def __init__(self, tasks: int = 0) -> None:
        """No task yet; the table of places made for ``tasks`` of them."""
        self.hi = array("Q")
        self.lo = array("Q")
        self.average = array("d")
        self.tick = array("Q")
        self._index = _places(_slots_for(tasks))
        self._clock = 0
        self._new_places()

    def _new_places(self) -> None:
        """The places are new (arrays made or compressed): ``find``'s hints before, void."""
        self._places_id = next(_PLACES_IDS) << _HINT_BITS

    @classmethod
    def of(cls, halves: tuple[array[int], array[int]], averages: list[float]) -> _Tasks:
        """The tasks of ``halves`` (each once: the high and the low 64 bits of their
        keys) and their ``averages``, the one updated longest ago first."""
        tasks = cls()
        tasks.hi, tasks.lo = halves
        tasks.average = array("d", averages)
        tasks.tick = array("Q", range(len(averages)))
        tasks._clock = len(averages)
        tasks._reindex(_MIN_SLOTS)
        tasks._new_places()
        return tasks

    def __len__(self) -> int:
        return len(self.lo)

    def copy(self) -> _Tasks:
        tasks = _Tasks()
        tasks.hi, tasks.lo = array("Q", self.hi), array("Q", self.lo)
        tasks.average, tasks.tick = array("d", self.average), array("Q", self.tick)
        tasks._index = array(self._index.typecode, self._index)
        tasks._clock = self._clock
        tasks._new_places()  # a hint of these places is not one of the copy's
        return tasks

    def _slot(self, key: int) -> tuple[int, int]:
        """``key``'s slot in the table and its place; -1: not there (the slot is free)."""
        hi, lo = key >> 64, key & _LOW
        index, column = self._index, self.lo
        mask = len(index) - 1
        slot = (hi ^ lo) & mask
        while place := index[slot]:
            if column[place - 1] == lo and self.hi[place - 1] == hi:
                return slot, place - 1
            slot = (slot + 1) & mask
        return slot, -1

    def get(self, key: int) -> float | None:
        return self.find(key)[0]

    def find(self, key: int) -> tuple[float | None, int]:
        """The task's average, and a hint where it is (-1: not there): its place in
        the arrays, and above ``_HINT_BITS`` which places those are."""
        # ``_slot``'s search, inlined: a find for each task a job starts.
        hi, lo = key >> 64, key & _LOW
        index, column = self._index, self.lo
        mask = len(index) - 1
        slot = (hi ^ lo) & mask
        while place := index[slot]:
            at = place - 1
            if column[at] == lo and self.hi[at] == hi:
                return self.average[at], at | self._places_id
            slot = (slot + 1) & mask
        return None, -1

    def move_all(self, updates: list[tuple[int, float, int]], max_tasks: int) -> list[float]:
        """Move each task's average by its latency, in order, and their new averages. An
        update: the task's key, its latency and a hint where it is (``find``'s, searched
        for again if the places have changed since). A task not there joins; past
        ``max_tasks`` the ones updated longest ago go (``max_tasks // 16`` more)."""
        moved: list[float] = []
        lo, average, tick, places = self.lo, self.average, self.tick, self._places_id
        for key, latency_s, hint in updates:
            # A hint of these places is its place; one of others is out of range (a
            # place is below 2 ** _HINT_BITS): the key's own bits need not be read.
            at = hint ^ places if hint >= 0 else -1
            if not 0 <= at < len(lo):
                slot, at = self._slot(key)
                if at < 0:
                    moved.append(self._join(slot, key, latency_s))
                    if len(lo) > max_tasks:
                        self.forget_oldest(len(lo) - max_tasks + max_tasks // 16)
                        lo, average, tick = self.lo, self.average, self.tick
                        places = self._places_id
                    continue
            value = average[at]
            average[at] = value = value + ALPHA * (latency_s - value)
            tick[at] = self._clock
            self._clock += 1
            moved.append(value)
        return moved

    def _join(self, slot: int, key: int, latency_s: float) -> float:
        """A task not there joins at the free ``slot`` of the table, with ``latency_s``."""
        self._index[slot] = len(self.lo) + 1
        self.hi.append(key >> 64)
        self.lo.append(key & _LOW)
        self.average.append(latency_s)
        self.tick.append(self._clock)
        self._clock += 1
        if 4 * len(self.lo) > 3 * len(self._index):
            self._reindex(2 * len(self._index))
        return latency_s

    def _reindex(self, size: int) -> None:
        """The table of places made anew, ``size`` slots (a power of two) or as many
        more as keep it at most 3/4 full."""
        size = max(size, _slots_for(len(self.lo)))
        index = _places(size)
        mask = size - 1
        slots = map(operator.and_, map(operator.xor, self.hi, self.lo), itertools.repeat(mask))
        for place, slot in enumerate(slots, 1):
            while index[slot]:
                slot = (slot + 1) & mask
            index[slot] = place
        self._index = index

    def forget_oldest(self, count: int) -> None:
        """The ``count`` tasks updated longest ago go."""
        if count <= 0:
            return
        # The count-th oldest tick, holding count numbers, not every task's.
        cutoff = heapq.nsmallest(count, self.tick)[-1]
        keep = bytes(map(cutoff.__lt__, self.tick))
        self.hi = array("Q", itertools.compress(self.hi, keep))
        self.lo = array("Q", itertools.compress(self.lo, keep))
        self.average = array("d", itertools.compress(self.average, keep))
        self.tick = array("Q", itertools.compress(self.tick, keep))
        self._reindex(len(self._index))
        self._new_places()

    def oldest_first(self) -> Iterator[tuple[int, float]]:
        """Every ``(digest, average)``, the one updated longest ago first.

        Walked a slice of ages at a time (``_age_slices``): only the places of one
        slice's tasks are objects at once, not every task's, so a compaction
        leaves the heap as it found it.
        """
        hi, lo, average, tick = self.hi, self.lo, self.average, self.tick
        for low, high in _age_slices(tick):
            places = [at for at, t in enumerate(tick) if low <= t < high]
            places.sort(key=tick.__getitem__)
            for at in places:
                yield hi[at] << 64 | lo[at], average[at]


# A hint (``_Tasks.find``) is a place, below this bit, and above it which places those
# are: each making or compressing of the arrays is a number of its own, of any history.
_HINT_BITS = 40
_PLACES_IDS = itertools.count(1)

# The table of places starts this small (a power of two), or made for as many
# tasks as the history may keep, up to ``_PRESIZED`` (512 KB): not grown step by
# step as the tasks of a first run come.
_MIN_SLOTS = 64
_PRESIZED = 1 << 16


def _slots_for(tasks: int) -> int:
    """The least table (a power of two) that holds ``tasks`` places at most 3/4 full."""
    size = _MIN_SLOTS
    while 4 * tasks > 3 * size:
        size *= 2
    return size


def _places(size: int) -> array[int]:
    """An empty table of ``size`` places (4 bytes a slot while places fit)."""
    typecode = "I" if size < 1 << 32 else "Q"
    return array(typecode, bytes(array(typecode).itemsize * size))


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


_LOW = (1 << 64) - 1
_KEY = operator.itemgetter(0)


def _last_updates(
    digests: list[str], averages: list[float], max_tasks: int
) -> tuple[list[str], list[float]]:
    """Each task's last update, of the ``max_tasks`` tasks updated last, oldest first.
    In C: a history is read before every run."""
    # A digest's last line (a dict keeps the last value it is given).
    places = dict(zip(digests, itertools.count()))
    if len(places) < len(digests):
        last = sorted(places.values())
        digests = list(map(digests.__getitem__, last))
        averages = list(map(averages.__getitem__, last))
    # Else each task once (a compacted file, a first run's): no sort, no copy.
    return digests[-max_tasks:], averages[-max_tasks:]


def _task_halves(digests: list[str]) -> tuple[array[int], array[int]]:
    """The high and the low 64 bits of ``task_key`` of each digest: at C speed when all
    are ``task_digest``'s (their bytes, read as big-endian pairs of words)."""
    if set(map(len, digests)) <= {32}:
        # Every digest 32 characters and their whole 16 bytes each: hex digits all.
        try:
            words = array("Q", bytes.fromhex("".join(digests)))
        except ValueError:
            words = array("Q")
        if len(words) == 2 * len(digests):
            if sys.byteorder == "little":
                words.byteswap()
            return words[0::2], words[1::2]
    keys = list(map(task_key, digests))
    return (
        array("Q", map(operator.rshift, keys, itertools.repeat(64))),
        array("Q", map(operator.and_, keys, itertools.repeat(_LOW))),
    )
