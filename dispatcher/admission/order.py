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
from dataclasses import dataclass, field
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
# Bound once: a rank is made for every task a job adds.
_PACK_DOUBLE = struct.Struct("<d").pack
_UNPACK_BITS = struct.Struct("<Q").unpack


def _rank(estimate_s: float | None, probed: bool) -> int | None:
    """A task's part of its heap entries; None in tier 1 (unseen)."""
    if estimate_s is not None:
        bits: int = _UNPACK_BITS(_PACK_DOUBLE(estimate_s if estimate_s > 0.0 else 0.0))[0]
        return _EXPECTED ^ (bits << POSITION_BITS)
    return _PROBING if probed else None


@dataclass(slots=True)
class Waiting:
    """One waiting rollout: where its line is (``offset`` to ``end``, its newline
    included) and which task it runs (``digest``: the task's digest, or its number,
    ``history.task_key``). ``task`` and ``expected_s`` are the order's: the task it
    was added to, and what it was expected to take when it started."""

    position: int
    offset: int
    end: int
    key: int
    task_index: int
    digest: str | int
    task: _Task | None = field(default=None, repr=False, compare=False)
    expected_s: float | None = field(default=None, repr=False, compare=False)


class _Task:
    """A task with rollouts waiting or started: what the order knows of it."""

    __slots__ = (
        "at",
        "estimate_s",
        "gone",
        "key",
        "learned",
        "left",
        "positions",
        "probed",
        "rank",
    )

    def __init__(self, key: int, at: int, estimate_s: float | None, position: int) -> None:
        self.key = key  # its history's name for it
        self.at = at  # where the history has it (a hint)
        # Where its rollouts were added (some may have started since: a list appended
        # to, not a set kept exact, as only a change of rank reads it) and how many wait.
        self.positions = [position]
        self.left = 1
        self.probed = False
        self.estimate_s = estimate_s
        self.learned = False  # a sibling finished in this job
        self.gone = False  # no longer the order's task of its index
        self.rank = _rank(estimate_s, False)


# A batch of at least this many entries of tiers 2 and 3, and a 32nd of the sorted
# ones, is merged into them; a smaller one is pushed on the heap (a merge passes over
# every entry sorted: its cost is kept to a few steps an entry merged).
_MERGED_BATCH = 256

# Taken slots at the front of the window dropped at once, when at least this many.
_COMPACT_FRONT = 4096


class StartOrder:
    """A job's waiting rollouts in start order; see the module docstring.

    Rollouts are added in input order. Tier 1 is a queue of positions in that
    order (a task is unseen only when added, so it only grows at its end); tiers
    2 and 3 are a heap. An entry whose task has another rank since is skipped.
    The waiting rollouts are a list indexed by input position (from ``_base``), a
    taken one None: a rollout starts out of input order, and a dict or a deque
    beside it was a few more cache misses a rollout, each in another place.
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
        self._slots: list[Waiting | None] = []  # by input position, from ``_base``
        self._base = 0
        self._front = 0  # the slots before it are all taken
        self._count = 0  # rollouts waiting
        self._tasks: dict[int, _Task] = {}
        self._unseen: deque[int] = deque()
        # Tiers 2 and 3, each entry ``rank | position``: the entries added in batches,
        # sorted (the least last, taken from the end), and a heap of the others (a
        # task's new rank, a small batch's).
        self._sorted: list[int] = []
        self._heap: list[int] = []
        self._next_position = 0
        # Started, not finished, by rollout key.
        self._started: dict[int, Waiting] = {}
        self.errors: deque[float] = deque(maxlen=ERRORS_KEPT)
        self.estimated = 0
        self.unseen = 0

    # ---- the window ---------------------------------------------------------------

    def admits_until(self) -> int:
        """The first input position the window cannot take yet."""
        return self.oldest_position() + self.window

    def oldest_position(self) -> int:
        slots, front = self._slots, self._front
        while front < len(slots) and slots[front] is None:
            front += 1
        if front >= _COMPACT_FRONT and 2 * front >= len(slots):
            del slots[:front]
            self._base += front
            front = 0
        self._front = front
        return self._base + front if front < len(slots) else self._next_position

    def skip_to(self, position: int) -> None:
        """Lines up to ``position`` were read and need no start (final ones)."""
        self._next_position = max(self._next_position, position)

    def add(self, rollout: Waiting) -> None:
        """One more waiting rollout, after every one added before in input order."""
        self.add_all((rollout,))

    def add_all(self, rollouts: Iterable[Waiting]) -> None:
        """``add`` each of ``rollouts``, in their order (one call for a batch read)."""
        slots, tasks, history = self._slots, self._tasks, self.history
        unseen, ranked = self._unseen, []
        for rollout in rollouts:
            position = rollout.position
            if not self._next_position <= position <= _POSITION_MASK:
                raise ValueError(f"position {position} added after {self._next_position - 1}")
            self._next_position = position + 1
            if position - self._base != len(slots):
                slots = self._gap_to(position)
            slots.append(rollout)
            self._count += 1
            task = tasks.get(rollout.task_index)
            if task is None:
                key = rollout.digest if type(rollout.digest) is int else task_key(rollout.digest)
                estimate, at = history.find(key) if history is not None else (None, -1)
                task = tasks[rollout.task_index] = _Task(key, at, estimate, position)
            else:
                task.positions.append(position)
                task.left += 1
            rollout.task = task
            if task.rank is None:
                unseen.append(position)
            else:
                ranked.append(task.rank | position)
        self._queue(ranked)

    def _queue(self, ranked: list[int]) -> None:
        """Queue a batch's entries of tiers 2 and 3.

        A big batch is merged into the sorted entries (a merge of two sorted runs, in
        C, walking memory in order); a pop from a heap of the whole window went down
        ~16 levels of entries scattered in memory, a cache miss each.
        """
        if len(ranked) < max(_MERGED_BATCH, len(self._sorted) // 32):
            for entry in ranked:
                heapq.heappush(self._heap, entry)
            return
        self._sorted += ranked
        self._sorted.sort(reverse=True)

    def _gap_to(self, position: int) -> list[Waiting | None]:
        """The slots, the next one ``position``'s: lines between were final or skipped."""
        if not self._count:
            # Nothing waits: the window starts anew (every entry queued is below it).
            self._slots, self._base, self._front = [], position, 0
        else:
            self._slots.extend([None] * (position - self._base - len(self._slots)))
        return self._slots

    def __len__(self) -> int:
        return self._count

    # ---- taking -------------------------------------------------------------------

    def take(self) -> Waiting | None:
        """The rollout to start next (it counts as started); None when none waits."""
        taken = self.take_many(1)
        return taken[0] if taken else None

    def take_many(self, count: int) -> list[Waiting]:
        """The next ``count`` rollouts to start, in order (fewer when fewer wait)."""
        unseen, slots, base, started = self._unseen, self._slots, self._base, self._started
        merged, heap = self._sorted, self._heap
        taken: list[Waiting] = []
        while len(taken) < count:
            if unseen:
                position = unseen.popleft()
                rank = None
            else:
                if not merged and not heap:
                    break
                # The least of the sorted entries' last and the heap's first.
                least_merged = merged and (not heap or merged[-1] < heap[0])
                entry = merged.pop() if least_merged else heapq.heappop(heap)
                position = entry & _POSITION_MASK
                rank = entry ^ position
            # Below the slots: taken before the window moved on.
            rollout = slots[position - base] if position >= base else None
            if rollout is None:
                continue
            task = rollout.task
            assert task is not None
            if rank != task.rank:
                continue
            slots[position - base] = None
            self._count -= 1
            task.left -= 1
            if not task.left:
                # All started: none to queue again (a task the service keeps for the
                # job's life holds no position of each of its rollouts). A task that
                # has learned (never one to probe) has nothing more to order by.
                task.positions.clear()
                if task.learned:
                    self._forget(rollout.task_index, task)
            rollout.expected_s = task.estimate_s
            started[rollout.key] = rollout
            if task.estimate_s is None:
                self.unseen += 1
                if not task.probed and not self.whole_groups:
                    task.probed = True
                    task.rank = _rank(None, True)
                    self._reorder(task)
            else:
                self.estimated += 1
            taken.append(rollout)
        return taken

    # ---- learning -----------------------------------------------------------------

    def finished(self, key: int, task_index: int, latency_s: float) -> float | None:
        """A started rollout ran to an answer in ``latency_s``: learn from it. The
        estimate's error, |ln(actual / expected)|; None for a rollout not expected."""
        rollout = self._started.pop(key, None)
        if rollout is None:
            return None
        task, expected_s = rollout.task, rollout.expected_s
        assert task is not None
        error = None
        if expected_s is not None and expected_s > 0 and latency_s > 0:
            error = abs(math.log(latency_s / expected_s))
            self.errors.append(error)
        if self.history is not None:
            self.history.observe(task.key, latency_s, task.at)
        if task.gone:  # the index has another task since, or none
            task = self._tasks.get(task_index)
        if task is not None and not task.learned and not self.whole_groups:
            self._learn(task_index, task, latency_s)
        return error

    def _learn(self, task_index: int, task: _Task, latency_s: float) -> None:
        if not task.left:
            self._forget(task_index, task)  # nothing left to order by it
            return
        task.learned, task.estimate_s = True, latency_s
        task.rank = _rank(latency_s, task.probed)
        self._reorder(task)

    def _forget(self, task_index: int, task: _Task) -> None:
        del self._tasks[task_index]
        task.gone = True

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
        """Queue ``task``'s waiting rollouts at its new rank (the entries at the old
        one are skipped when they come up)."""
        slots, base = self._slots, self._base
        task.positions = [p for p in task.positions if p >= base and slots[p - base] is not None]
        for position in task.positions:
            self._push(position, task)

    def _push(self, position: int, task: _Task) -> None:
        if task.rank is None:
            self._unseen.append(position)
        else:
            heapq.heappush(self._heap, task.rank | position)


# Makes a job's start order from its settings, the shared task history and whether
# a group's repeats stay together: ``start_order_for``, or a step policy's ordering.
OrderFor = Callable[[RunSettings, TaskHistory | None, bool], StartOrder | None]
