"""Which waiting rollout starts next: the longest expected first (contracts §13, start order).

A job's makespan is set by its last rollouts to finish; starting the long
ones first lets the short ones fill in behind them. ``StartOrder`` holds a
window of a job's waiting rollouts and gives the next to start:

1. a task never seen (no history, no sibling started): its first rollout,
   in input order. It may be long, and its latency is what the rest learn;
2. the siblings of a task whose first rollout is still running, in input
   order: it has run longer than every sibling that finished already;
3. every other rollout, longest expected first, then in input order. A
   task's expectation is its first finished sibling's latency in this job,
   else its history (``history.py``).

In the service (``whole_groups``), a task's repeats start together, as its
step control counts open groups: tiers 1 and 3 only, the estimate from the
history alone.

No starvation: the window holds rollouts from the oldest waiting one (by
input position) up to ``window`` positions after it, and only those can
start. So a rollout starts before any rollout ``window`` or more positions
after it in input order.

Pure and synchronous: ``run/pending.py`` feeds it and reads the rows.
"""

from __future__ import annotations

import heapq
import math
import struct
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

from dispatcher.admission.history import HISTORY_FILE, TaskHistory, task_key
from dispatcher.latency.quantile import quantile
from dispatcher.settings.config import RunSettings

DEFAULT_WINDOW = 65_536
# Estimate errors kept for the job's status (the median of the latest).
ERRORS_KEPT = 4096


def start_order_for(
    settings: RunSettings, history: TaskHistory | None, whole_groups: bool = False
) -> StartOrder | None:
    """The job's start order, or None for input order (``start_order = "input"``).
    Without a shared ``history`` (the service's), the run's own file is read
    (blocking): ``task_history``, else ``task_history.jsonl`` beside the output."""
    if settings.start_order == "input":
        return None
    if history is None:
        path = settings.task_history or Path(settings.output).parent / HISTORY_FILE
        history = TaskHistory.load(path, settings.task_history_max_tasks)
    return StartOrder(history, settings.start_order_window, whole_groups=whole_groups)


class Tier(IntEnum):
    UNSEEN = 0
    PROBING = 1
    EXPECTED = 2


# A heap entry of tiers 2 and 3 is one int, compared in C: the tier, then the
# estimate (a non-negative float's bits, inverted: the longest first), then the
# input position.
POSITION_BITS = 48
_POSITION_MASK = (1 << POSITION_BITS) - 1
_EXPECTED = (int(Tier.EXPECTED) << 64 | ((1 << 64) - 1)) << POSITION_BITS
_PROBING = int(Tier.PROBING) << 64 << POSITION_BITS
_DOUBLE = struct.Struct("<d")
_BITS = struct.Struct("<Q")


def _rank(estimate_s: float | None, probed: bool) -> int | None:
    """A task's part of its heap entries; None in tier 1 (unseen)."""
    if estimate_s is not None:
        bits: int = _BITS.unpack(_DOUBLE.pack(estimate_s if estimate_s > 0.0 else 0.0))[0]
        return _EXPECTED ^ (bits << POSITION_BITS)
    return _PROBING if probed else None


@dataclass(slots=True)
class Waiting:
    """One waiting rollout: where its line is (``offset`` to ``end``, its newline
    included) and which task it runs (``digest``: the task's digest, or its number,
    ``history.task_key``)."""

    position: int
    offset: int
    end: int
    key: int
    task_index: int
    digest: str | int


class _Task:
    """A task with rollouts waiting or started: what the order knows of it."""

    __slots__ = ("at", "estimate_s", "key", "learned", "probed", "rank", "waiting")

    def __init__(self, key: int, at: int, estimate_s: float | None, position: int) -> None:
        self.key = key  # its history's name for it
        self.at = at  # where the history has it (a hint)
        self.waiting = {position}
        self.probed = False
        self.estimate_s = estimate_s
        self.learned = False  # a sibling finished in this job
        self.rank = _rank(estimate_s, False)


class StartOrder:
    """A job's waiting rollouts in start order; see the module docstring.

    Rollouts are added in input order. Tier 1 is a queue of positions in that
    order (a task is unseen only when added, so it only grows at its end); tiers
    2 and 3 are a heap. An entry whose task has another rank since is skipped.
    """

    def __init__(
        self,
        history: TaskHistory | None,
        window: int = DEFAULT_WINDOW,
        *,
        whole_groups: bool = False,
    ) -> None:
        self.history = history
        self.window = window
        # A task's repeats start one after another (tiers 1 and 2 and a sibling's
        # estimate are left out): the service's step control counts open groups.
        self.whole_groups = whole_groups
        self._waiting: dict[int, Waiting] = {}
        self._tasks: dict[int, _Task] = {}
        self._unseen: deque[int] = deque()
        self._heap: list[int] = []  # rank | position
        self._oldest: deque[int] = deque()  # the positions added, in input order
        self._next_position = 0
        # Started, not finished: its task's history key and hint, and what it was
        # expected to take (None: unseen).
        self._started: dict[int, tuple[int, int, float | None]] = {}
        self.errors: deque[float] = deque(maxlen=ERRORS_KEPT)
        self.estimated = 0
        self.unseen = 0

    # ---- the window ---------------------------------------------------------------

    def admits_until(self) -> int:
        """The first input position the window cannot take yet."""
        return self.oldest_position() + self.window

    def oldest_position(self) -> int:
        oldest, waiting = self._oldest, self._waiting
        while oldest and oldest[0] not in waiting:
            oldest.popleft()
        return oldest[0] if oldest else self._next_position

    def skip_to(self, position: int) -> None:
        """Lines up to ``position`` were read and need no start (final ones)."""
        self._next_position = max(self._next_position, position)

    def add(self, rollout: Waiting) -> None:
        """One more waiting rollout, after every one added before in input order."""
        self.add_all((rollout,))

    def add_all(self, rollouts: Iterable[Waiting]) -> None:
        """``add`` each of ``rollouts``, in their order (one call for a batch read)."""
        waiting, oldest, tasks, history = self._waiting, self._oldest, self._tasks, self.history
        unseen, heap, push = self._unseen, self._heap, heapq.heappush
        for rollout in rollouts:
            position = rollout.position
            if not self._next_position <= position <= _POSITION_MASK:
                raise ValueError(f"position {position} added after {self._next_position - 1}")
            waiting[position] = rollout
            self._next_position = position + 1
            oldest.append(position)
            task = tasks.get(rollout.task_index)
            if task is None:
                key = rollout.digest if type(rollout.digest) is int else task_key(rollout.digest)
                estimate, at = history.find(key) if history is not None else (None, -1)
                task = tasks[rollout.task_index] = _Task(key, at, estimate, position)
            else:
                task.waiting.add(position)
            if task.rank is None:
                unseen.append(position)
            else:
                push(heap, task.rank | position)

    def __len__(self) -> int:
        return len(self._waiting)

    # ---- taking -------------------------------------------------------------------

    def take(self) -> Waiting | None:
        """The rollout to start next (it counts as started); None when none waits."""
        taken = self.take_many(1)
        return taken[0] if taken else None

    def take_many(self, count: int) -> list[Waiting]:
        """The next ``count`` rollouts to start, in order (fewer when fewer wait)."""
        unseen, heap, waiting, tasks = self._unseen, self._heap, self._waiting, self._tasks
        started, pop = self._started, heapq.heappop
        taken: list[Waiting] = []
        while len(taken) < count:
            if unseen:
                position = unseen.popleft()
                rank = None
            elif heap:
                entry = pop(heap)
                position = entry & _POSITION_MASK
                rank = entry ^ position
            else:
                break
            rollout = waiting.get(position)
            if rollout is None:
                continue
            task = tasks[rollout.task_index]
            if rank != task.rank:
                continue
            del waiting[position]
            task.waiting.discard(position)
            started[rollout.key] = (task.key, task.at, task.estimate_s)
            if task.estimate_s is None:
                self.unseen += 1
                if not task.probed and not self.whole_groups:
                    task.probed = True
                    task.rank = _rank(None, True)
                    self._reorder(task)
            else:
                self.estimated += 1
            if not task.waiting and task.learned:
                del tasks[rollout.task_index]
            taken.append(rollout)
        return taken

    # ---- learning -----------------------------------------------------------------

    def finished(self, key: int, task_index: int, latency_s: float) -> float | None:
        """A started rollout ran to an answer in ``latency_s``: learn from it. The
        estimate's error, |ln(actual / expected)|; None for a rollout not expected."""
        started = self._started.pop(key, None)
        if started is None:
            return None
        key, at, expected_s = started
        error = None
        if expected_s is not None and expected_s > 0 and latency_s > 0:
            error = abs(math.log(latency_s / expected_s))
            self.errors.append(error)
        if self.history is not None:
            self.history.observe(key, latency_s, at)
        task = self._tasks.get(task_index)
        if task is not None and not task.learned and not self.whole_groups:
            self._learn(task_index, task, latency_s)
        return error

    def _learn(self, task_index: int, task: _Task, latency_s: float) -> None:
        if not task.waiting:
            del self._tasks[task_index]  # nothing left to order by it
            return
        task.learned, task.estimate_s = True, latency_s
        task.rank = _rank(latency_s, task.probed)
        self._reorder(task)

    def median_error(self) -> float | None:
        """The median of |ln(actual / expected)| over the latest estimated rollouts."""
        return quantile(sorted(self.errors), 0.5) if self.errors else None

    def figures(self) -> dict[str, Any]:
        """The order's part of a job's status."""
        return {
            "order": "longest",
            "started_unseen": self.unseen,
            "started_expected": self.estimated,
            "estimate_error_median": self.median_error(),
            "history_tasks": len(self.history) if self.history is not None else 0,
        }

    def _reorder(self, task: _Task) -> None:
        for position in task.waiting:
            self._push(position, task)

    def _push(self, position: int, task: _Task) -> None:
        if task.rank is None:
            self._unseen.append(position)
        else:
            heapq.heappush(self._heap, task.rank | position)


# Makes a job's start order from its settings, the shared task history and whether
# a group's repeats stay together: ``start_order_for``, or a step policy's ordering.
OrderFor = Callable[[RunSettings, TaskHistory | None, bool], StartOrder | None]
