"""Lifecycle states as enums whose moves only go forward.

A late event must not undo a later state: a SIGTERM that arrives while the
daemon writes its summary must not turn "finished" back into "draining", and
a cancel that races a job's last commit must not turn "done" into
"cancelled". ``Lifecycle.advance`` ignores any move to a state that is not
after the current one, and says so by returning False.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import Generic, TypeVar


class Phase(StrEnum):
    """The daemon's phases, in the only order they can follow."""

    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    SHUTTING_DOWN = "shutting_down"
    FINISHED = "finished"


class JobState(StrEnum):
    """A job's states (service mode). The last five are final. ``paced`` is how a
    running job held back by ``--max-off-policy-steps`` is shown; the lifecycle
    never moves to it. ``satisfied`` is a job with ``target_groups`` that
    reached its target (contracts §13): it starts nothing again."""

    QUEUED = "queued"
    RUNNING = "running"
    PACED = "paced"
    DONE = "done"
    INCOMPLETE = "incomplete"
    FAILED = "failed"
    CANCELLED = "cancelled"
    SATISFIED = "satisfied"

    @property
    def final(self) -> bool:
        return self not in (JobState.QUEUED, JobState.RUNNING, JobState.PACED)


class Stage(IntEnum):
    """A rollout in flight (``run/flight.py``), in the order it lives them; the
    flight, the shutdown grace and the job read it.

    The one move back is AT_AGENT to WAITING: a request that was not delivered
    waits for its retry. Nothing moves back from ANSWERED: an agent's answer is
    the rollout's, and its row is written (contracts §10).
    """

    WAITING = 0  # admitted, at no replica: before its request, or between retries
    AT_AGENT = 1  # its request is at a replica
    ANSWERED = 2  # the agent answered; its row waits for room in the commit queue
    COMMITTING = 3  # its row is built and written; its agent slots are free
    DONE = 4

    def may_move_to(self, to: Stage) -> bool:
        return to > self or (self is Stage.AT_AGENT and to is Stage.WAITING)


S = TypeVar("S", Phase, JobState)

# The rank of each state: a move goes only to a higher rank. The final job
# states share one rank, so whichever comes first stays.
_RANK: dict[StrEnum, int] = {
    **{phase: rank for rank, phase in enumerate(Phase)},
    JobState.QUEUED: 0,
    JobState.RUNNING: 1,
    JobState.PACED: 1,
    JobState.DONE: 2,
    JobState.INCOMPLETE: 2,
    JobState.FAILED: 2,
    JobState.CANCELLED: 2,
    JobState.SATISFIED: 2,
}


class Lifecycle(Generic[S]):
    """The current state, moved only forward."""

    def __init__(self, initial: S) -> None:
        self.state: S = initial

    def advance(self, to: S) -> bool:
        """Move to ``to`` when it comes after the current state; False otherwise."""
        if _RANK[to] <= _RANK[self.state]:
            return False
        self.state = to
        return True

    def at_least(self, state: S) -> bool:
        return _RANK[self.state] >= _RANK[state]
