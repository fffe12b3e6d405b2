"""Each task's rollout latency, across jobs and restarts (contracts §13, start order).

A task is named by the digest of its input row (``task_digest``: the row's
canonical JSON without the keys the dispatcher sets), so the same prompt in
a later job, a later epoch or another output file finds its history. The
history is a moving average per task (``ALPHA`` of each new latency), at most
``max_tasks`` of them: the task updated longest ago goes first.

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
import math
import threading
from collections import OrderedDict
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
        self._average: OrderedDict[str, float] = OrderedDict()
        self._unwritten: list[tuple[str, float]] = []
        self._lines_on_disk = 0
        # Jobs of one service share the history; their flushes take turns.
        self._file_lock = threading.Lock()

    @classmethod
    def load(cls, path: Path | None, max_tasks: int = DEFAULT_MAX_TASKS) -> TaskHistory:
        """The history in ``path`` (a missing file is an empty history; blocking)."""
        history = cls(path, max_tasks)
        if path is not None:
            history._replay(path)
        return history

    def __len__(self) -> int:
        return len(self._average)

    def estimate(self, digest: str) -> float | None:
        """The task's expected latency in seconds; None for a task never seen."""
        return self._average.get(digest)

    def observe(self, digest: str, latency_s: float) -> None:
        """One finished rollout of the task: move its average, buffer the update."""
        if not math.isfinite(latency_s) or latency_s < 0:
            return
        old = self._average.pop(digest, None)
        average = latency_s if old is None else old + ALPHA * (latency_s - old)
        self._set(digest, average)
        if self.path is not None:
            self._unwritten.append((digest, average))

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
        snapshot = list(self._average.items())
        write_atomic(self.path, (_line(d, s) for d, s in snapshot))
        self._lines_on_disk = len(snapshot)

    def _set(self, digest: str, average: float) -> None:
        self._average[digest] = average
        while len(self._average) > self.max_tasks:
            self._average.popitem(last=False)

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
        latest: dict[str, float] = {}
        for digest, average in reversed(_parse_all(lines)):
            if digest not in latest:
                latest[digest] = average
                if len(latest) >= self.max_tasks:
                    break
        self._average = OrderedDict(reversed(latest.items()))


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
