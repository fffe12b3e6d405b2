"""A job's start window (contracts §12): ``max_in_flight`` and ``admit``.

Two bounds a job's body may set on when its next rollout starts, checked by
its gate before each one (``served.py``):

- ``max_in_flight`` W: fewer than W of its rollouts at agents; the next starts
  as one leaves its agent.
- ``admit`` N: at most N of its rollouts started (final, or in flight), until
  the caller raises N (``POST /v1/jobs/<id>/admit``). A trainer's window of
  resident tasks, Gym's ``max_resident_tasks``, frees a slot when the trainer
  takes a result, not when the rollout leaves its agent: the caller admits
  one more rollout for each result it hands over, so a trainer that stops
  taking stops the job's starts, and the results waiting for it stay within
  its window. The caller may also hold admissions back (a dispatch budget
  that drains the rest).

Admissions live in memory: no fsync per result. After a restart the job
admits its ``admit`` more than it has final (as if the caller had taken every
result it was sent), and a caller that goes on raises it from there.
"""

from __future__ import annotations

from collections.abc import Callable

from dispatcher.aio import Wakeup
from dispatcher.run.job import Job

# A gate that waits re-reads the job this often even if nothing wakes it.
RECHECK_S = 60.0


class StartWindow:
    """The ``max_in_flight`` and ``admit`` bounds of one job; ``wait`` before each start."""

    def __init__(self, max_in_flight: int | None, admit: int | None, left_agent: Wakeup) -> None:
        self.max_in_flight = max_in_flight
        self._admit = admit
        self._left_agent = left_agent
        # Raised by the caller (never lowered); None until it says so.
        self._admitted: int | None = None
        # The job's final rollouts when this process first gated it: a restart
        # counts them taken.
        self._final_at_start: int | None = None
        self._admitted_more = Wakeup()

    @property
    def admitted(self) -> int | None:
        """How many of the job's rollouts may have started (None: no ``admit`` bound)."""
        if self._admit is None:
            return None
        floor = self._admit + (self._final_at_start or 0)
        return max(floor, self._admitted or 0)

    def admit(self, count: int) -> int | None:
        """The caller admits ``count`` rollouts in all (a running total; lower is ignored)."""
        if self._admit is not None:
            self._admitted = max(self._admitted or 0, count)
            self._admitted_more.fire()
        return self.admitted

    async def wait(self, job: Callable[[], Job | None]) -> None:
        """Until the job's next rollout may start (or the job's hop is gone)."""
        while (hop := job()) is not None:
            if self.max_in_flight is not None and hop.at_agents() >= self.max_in_flight:
                await self._left_agent.wait(RECHECK_S)
            elif self._admit is not None and self._started(hop) >= (self.admitted or 0):
                # Its caller admits more as it takes rows: none may wait for a batch.
                _hurry(hop, True)
                try:
                    await self._admitted_more.wait(RECHECK_S)
                finally:
                    _hurry(hop, False)
            else:
                return

    def _started(self, hop: Job) -> int:
        """Rollouts of the job started: final (every hop) and in flight."""
        final = (hop.expected() or 0) - hop.remaining()
        if self._final_at_start is None:
            self._final_at_start = final
        return final + len(hop.flights)


def _hurry(hop: Job, hurried: bool) -> None:
    for writer in hop.writers:
        writer.hurry(hurried)
