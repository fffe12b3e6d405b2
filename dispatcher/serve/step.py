"""Step control of one job (contracts §13): stop at N kept groups, refill a group at a time.

A job with ``target_groups`` N is *satisfied* once N complete groups are
kept. ``StepControl`` owns that decision and the admission rule behind it:
a rollout of a task not yet started (a new group) may start only while
kept + open groups < ceil(N × ``overprovision``), where an open group is a
task started and not yet complete. A complete group that the filter drops
leaves the open ones without joining the kept ones, so it frees exactly one
place: refill comes a group at a time, never in waves. Rollouts of an open
group always start (its repeats, its retries) until the job is satisfied;
after that nothing of the job starts, not after a restart either, since the
groups file it is counted from is read back first.

It is told two things: a group line was written (``Groups`` calls
``on_group``, for lines of earlier daemons too, in file order) and a task
was found open in the files on resume (``reopen``). ``admits`` answers the
job's gate.

The group filter ``nonzero_reward_std`` drops a group whose rows' rewards
are all equal (a missing reward counts as a value of its own): its
advantages are all zero, it teaches nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from dispatcher.aio import Wakeup
from dispatcher.serve.registry import now_iso

OnTarget = Literal["finish", "cancel"]
# The timeline's points: the kept groups at which each is taken, as fractions of N.
TIMELINE = (("first_group_s", 0.0), ("p50_s", 0.5), ("p90_s", 0.9), ("p100_s", 1.0))


def teaches_nothing(rewards: Sequence[Any]) -> bool:
    """``nonzero_reward_std``: True (filter the group out) when every reward is equal."""
    return len(set(map(_hashable, rewards))) <= 1


def _hashable(value: Any) -> Any:
    return value if isinstance(value, int | float | str | bool | None) else repr(value)


class StepControl:
    """One job's target, its admission rule and its step's figures (module docstring)."""

    def __init__(
        self,
        target: int | None,
        overprovision: float | None = None,
        on_target: OnTarget | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.target = target
        self.on_target: OnTarget = on_target or "finish"
        self.bound = math.ceil(target * (overprovision or 1.0)) if target is not None else None
        self.open: set[int] = set()
        self.kept = 0
        self.filtered = 0
        # The groups file's line of the N-th kept group: a grouped stream ends there.
        self.satisfied_seq: int | None = None
        self.satisfied_at: str | None = None
        # Seconds from the job's submission (or the daemon's restart) to each point of TIMELINE.
        self.timeline: dict[str, float | None] = {name: None for name, _ in TIMELINE}
        self.changed = Wakeup()
        self._clock = clock
        self._started_at = clock()
        self._on_satisfied: list[Callable[[], None]] = []

    @property
    def satisfied(self) -> bool:
        return self.satisfied_seq is not None

    def when_satisfied(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the job is satisfied (now, if it already is)."""
        if self.satisfied:
            callback()
        else:
            self._on_satisfied.append(callback)

    def forget_callbacks(self) -> None:
        """The job is final: nothing more is told (a callback holds the job, in a cycle)."""
        self._on_satisfied.clear()

    # ---- what it is told ---------------------------------------------------------------

    def reopen(self, tasks: Sequence[int]) -> None:
        """Tasks the files show started but not complete (on resume): open groups."""
        self.open.update(tasks)

    def on_group(self, task: int, filtered: bool, seq: int) -> None:
        """A group line was written (or read back): its group is complete."""
        self.open.discard(task)
        if filtered:
            self.filtered += 1
        else:
            self.kept += 1
            self._mark_timeline()
            if self.target is not None and self.kept == self.target:
                self._satisfy(seq)
        self.changed.fire()

    def _mark_timeline(self) -> None:
        if self.target is None:
            return
        elapsed_s = round(self._clock() - self._started_at, 3)
        for name, fraction in TIMELINE:
            reached = self.kept >= max(1, math.ceil(fraction * self.target))
            if reached and self.timeline[name] is None:
                self.timeline[name] = elapsed_s

    def _satisfy(self, seq: int) -> None:
        self.satisfied_seq = seq
        self.satisfied_at = now_iso()
        callbacks, self._on_satisfied = self._on_satisfied, []
        for callback in callbacks:
            callback()

    # ---- the gate ------------------------------------------------------------------------

    def admits(self, task: int) -> bool | None:
        """Whether a rollout of ``task`` may start: True; False: not now (no room for a
        new group); None: never (the job is satisfied)."""
        if self.satisfied:
            return None
        if self.bound is None or task in self.open:
            return True
        if self.kept + len(self.open) >= self.bound:
            return False
        self.open.add(task)
        return True

    # ---- what its status shows -----------------------------------------------------------

    def figures(self) -> dict[str, Any]:
        """The step's part of the job's status."""
        return {
            "target_groups": self.target,
            "groups_kept": self.kept,
            "groups_filtered": self.filtered,
            "groups_open": len(self.open),
            "satisfied_at": self.satisfied_at,
            "satisfied_seq": self.satisfied_seq,
            "timeline": dict(self.timeline) if self.target is not None else None,
        }
