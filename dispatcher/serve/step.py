"""Step control of one job (contracts §13): its tally of groups, its gate, its figures.

``StepControl`` keeps what a job's target (``policy.py``) reads: kept groups
(and the generated tokens they hold) and open groups, by agent, where an open
group is a task started and not yet complete. The target answers whether a
rollout that opens a new group may start (``admits``) and when the job is
*satisfied*. A complete group that the filter drops leaves the open ones
without joining the kept ones, so it frees exactly one place: refill comes a
group at a time, never in waves. Rollouts of an open group always start (its
repeats, its retries) until the job is satisfied; after that nothing of the
job starts, not after a restart either, since the groups file it is counted
from is read back first.

It is told two things: a group line was written and is durable by the
fsync policy (``Groups`` calls ``on_group``, for lines of earlier daemons
too, in file order) and a task was found open in the files on resume
(``reopen``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from dispatcher.aio import Wakeup
from dispatcher.serve.lines import GroupLine
from dispatcher.serve.metrics import StepTotals
from dispatcher.serve.policy import AgentQuotas, GroupsTarget, Room, Tally, Target, TokensTarget
from dispatcher.serve.registry import now_iso
from dispatcher.tasks.materialize import Rollout

OnTarget = Literal["finish", "cancel"]
# The timeline's points: the kept groups at which each is taken, as fractions of N.
TIMELINE = (("first_group_s", 0.0), ("p50_s", 0.5), ("p90_s", 0.9), ("p100_s", 1.0))
# The agent of a group whose agent is not known (read back from an older line).
UNKNOWN = ""
# Tasks held aside per agent (their rollouts' bodies are in memory): the others
# are read again by the job's next hop.
HELD_TASKS = 64


class StepControl:
    """One job's tally, its target's gate and its step's figures (module docstring)."""

    def __init__(
        self,
        target: Target | None,
        on_target: OnTarget | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.target = target
        self.on_target: OnTarget = on_target or "finish"
        self.tally = Tally()
        # Open groups: task -> its agent.
        self.open: dict[int, str] = {}
        self.filtered = 0
        # The groups file's line of the group that satisfied the job: a grouped stream ends there.
        self.satisfied_seq: int | None = None
        self.satisfied_at: str | None = None
        # Seconds from the job's submission (or the daemon's restart) to each point of TIMELINE.
        self.timeline: dict[str, float | None] = {name: None for name, _ in TIMELINE}
        self.changed = Wakeup()
        # Told of an agent whose open groups went down without its kept ones going up
        # (a filtered group): one group of it may start again.
        self.on_room: Callable[[str], None] | None = None
        self._clock = clock
        self._started_at = clock()
        self._on_satisfied: list[Callable[[], None]] = []

    @property
    def kept(self) -> int:
        return self.tally.kept.total()

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
        self.on_room = None

    # ---- what it is told ---------------------------------------------------------------

    def reopen(self, tasks: Sequence[int]) -> None:
        """Tasks the files show started but not complete (on resume): open groups."""
        for task in tasks:
            self._open(task, UNKNOWN)

    def _open(self, task: int, agent: str) -> None:
        self.open[task] = agent
        self.tally.open[agent] += 1

    def on_group(self, group: GroupLine, seq: int) -> None:
        """A group line was written and made durable (or read back): its group is complete."""
        task = group.task_index
        agent = self.open.pop(task, None)
        if agent is not None:
            self.tally.open[agent] -= 1
        agent = group.agent if group.agent is not None else (agent or UNKNOWN)
        tally = self.tally
        if group.filtered:
            self.filtered += 1
            if self.on_room is not None:
                self.on_room(agent)
        elif not group.surplus and (self.target is None or self.target.counts(agent, tally)):
            tally.kept[agent] += 1
            tally.tokens += group.tokens or 0
            self._mark_timeline()
            if self.target is not None and not self.satisfied and self.target.reached(tally):
                self._satisfy(seq)
        else:
            tally.surplus[agent] += 1
        self.changed.fire()

    def _mark_timeline(self) -> None:
        if not isinstance(self.target, GroupsTarget):
            return
        elapsed_s = round(self._clock() - self._started_at, 3)
        for name, fraction in TIMELINE:
            reached = self.kept >= max(1, math.ceil(fraction * self.target.target))
            if reached and self.timeline[name] is None:
                self.timeline[name] = elapsed_s

    def _satisfy(self, seq: int) -> None:
        self.satisfied_seq = seq
        self.satisfied_at = now_iso()
        if self.timeline["p100_s"] is None:
            self.timeline["p100_s"] = round(self._clock() - self._started_at, 3)
        callbacks, self._on_satisfied = self._on_satisfied, []
        for callback in callbacks:
            callback()

    def surplus(self, agent: str) -> bool:
        """Whether a kept group of ``agent`` completing now would not count (its quota met)."""
        return self.target is not None and not self.target.counts(agent, self.tally)

    # ---- the gate ------------------------------------------------------------------------

    def admits(self, task: int, agent: str = UNKNOWN) -> Room | None:
        """Whether a rollout of ``task`` (of ``agent``) may start now (``Room``); None:
        never (the job is satisfied)."""
        if self.satisfied:
            return None
        if task in self.open:
            if self.open[task] == UNKNOWN and agent != UNKNOWN:
                # A group reopened on resume: its agent is known now.
                self.tally.open[UNKNOWN] -= 1
                self._open(task, agent)
            return Room.START
        if self.target is None:
            return Room.START
        room = self.target.room(agent, self.tally)
        if room is Room.START:
            self._open(task, agent)
        return room

    # ---- what its status shows -----------------------------------------------------------

    def figures(self) -> dict[str, Any]:
        """The step's part of the job's status."""
        figures: dict[str, Any] = {
            "target_groups": None,
            "groups_kept": self.kept,
            "groups_filtered": self.filtered,
            "groups_open": len(self.open),
            "satisfied_at": self.satisfied_at,
            "satisfied_seq": self.satisfied_seq,
            "timeline": dict(self.timeline) if self.target is not None else None,
        }
        if self.target is not None:
            figures.update(self.target.figures(self.tally))
            if self.tally.tokens or not isinstance(self.target, GroupsTarget):
                figures["tokens_kept"] = self.tally.tokens
        return figures

    def add_to(self, totals: StepTotals) -> None:
        """Its quotas and token target, added to the service's (``/metrics``)."""
        target, tally = self.target, self.tally
        if isinstance(target, AgentQuotas):
            for agent, quota in target.quotas.items():
                totals.quota_by_agent[agent] += quota
                totals.kept_by_agent[agent] += tally.kept[agent]
        elif isinstance(target, TokensTarget):
            totals.tokens_target += target.target
            totals.tokens_kept += tally.tokens


class HeldAside:
    """Rollouts the gate held aside (``Room.DEFER``), by agent and task, in the order
    they came; at most ``HELD_TASKS`` tasks per agent, a task's rollouts together."""

    def __init__(self) -> None:
        self._tasks: dict[str, dict[int, list[Rollout]]] = {}

    def add(self, rollout: Rollout) -> None:
        tasks = self._tasks.setdefault(rollout.agent, {})
        held = tasks.get(rollout.task_index)
        if held is None and len(tasks) < HELD_TASKS:
            held = tasks[rollout.task_index] = []
        if held is not None:
            held.append(rollout)

    def take(self, agent: str) -> list[Rollout]:
        """The rollouts of the first task held for ``agent`` (none when it has none)."""
        tasks = self._tasks.get(agent)
        return tasks.pop(next(iter(tasks))) if tasks else []

    def clear(self) -> None:
        self._tasks.clear()
