"""One rollout's whole life: its slots, the agent call, the commit (DESIGN A3-A5, A11).

A ``Flight`` is made when the pool admits a rollout and runs as one task:

1. at the agent: it holds its ``Slots`` while ``AgentClient.run`` delivers the
   body (retrying what was not delivered); only here can it be cancelled
   (shutdown, the budget's end, a cancelled job), and then it writes nothing;
2. it enters the daemon's commit queue (slots and bytes: backpressure when
   the disk stalls or rows are huge) and frees its agent slots;
3. committing: the ``Finalizer`` builds its line, the job's writer appends it,
   and the job counts the outcome. A commit is never cancelled.

A fault of our own at any step (A11) puts the rollout back in its job's
queue instead of writing a row.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from dispatcher.agents import Attempt
from dispatcher.errors import DispatcherError, OutputWriteError
from dispatcher.faults import LocalFault, as_local_fault
from dispatcher.outcome import Outcome
from dispatcher.scheduler import Slots
from dispatcher.tasks import Rollout

if TYPE_CHECKING:
    from dispatcher.job import Job

# Keys every row carries in service mode (DESIGN A12).
POLICY_VERSION_START = "_ng_policy_version_start"
POLICY_VERSION_END = "_ng_policy_version_end"


class Flight:
    """Owns one admitted rollout from its slots to its counted outcome."""

    __slots__ = ("_slots", "at_agent", "job", "rollout", "task")

    def __init__(self, rollout: Rollout, slots: Slots, job: Job) -> None:
        self.rollout = rollout
        self.job = job
        self._slots = slots
        self.at_agent = True
        self.task: asyncio.Task[None] | None = None

    async def fly(self) -> None:
        job = self.job
        started = time.perf_counter()
        version_start = job.daemon.policy_version()
        try:
            attempt = await self._at_agent(started)
        finally:
            self.leave_agent()
        if attempt is None:
            return
        try:
            await self._commit(attempt, version_start)
        finally:
            job.daemon.commit_queue.leave(attempt.body_bytes)

    def leave_agent(self) -> None:
        """Free the slots and leave the job's in-flight count, once: also for a task
        cancelled before it ever ran, whose ``finally`` never runs."""
        if self.at_agent:
            self.at_agent = False
            self._slots.release()
            self.job.left_agent(self.rollout)

    async def _at_agent(self, started: float) -> Attempt | None:
        """The agent's answer, with a place in the commit queue; None when requeued."""
        rollout, job = self.rollout, self.job
        try:
            attempt = await job.daemon.agents.run(rollout.agent, rollout.body, rollout.rollout_id)
        except asyncio.CancelledError:
            job.record(rollout, Outcome.CANCELLED, time.perf_counter() - started)
            raise
        except LocalFault as fault:
            job.requeue(rollout, fault, time.perf_counter() - started)
            return None
        # Backpressure: past the queue's bounds the rollout keeps its agent
        # slots, so no new rollout starts until rows are written.
        try:
            await job.daemon.commit_queue.enter(attempt.body_bytes)
        except asyncio.CancelledError:
            job.record(rollout, Outcome.CANCELLED, attempt.duration_s, attempt)
            raise
        return attempt

    async def _commit(self, attempt: Attempt, version_start: int | None) -> None:
        rollout, job = self.rollout, self.job
        try:
            line, row, capture = await job.finalizer.finalize(
                rollout, attempt, _policy_keys(version_start, job.daemon.policy_version())
            )
        except Exception as exc:
            # A bug of ours (or our memory) while handling an answer: not the
            # agent's failure, so no row; the rollout runs again.
            fault = as_local_fault(exc) or LocalFault("bug", f"handling an answer raised {exc!r}")
            job.log.error("answer_handling_failed", rollout_id=rollout.rollout_id, exc_info=exc)
            job.requeue(rollout, fault, attempt.duration_s)
            return
        try:
            seq = await job.write(attempt.outcome, line)
        except OutputWriteError as exc:
            job.fail(exc)
            job.record(rollout, Outcome.CANCELLED, attempt.duration_s)
            return
        except Exception as exc:
            job.fail(DispatcherError(f"committing {rollout.rollout_id} failed: {exc!r}"))
            raise
        job.daemon.handled_answer()
        job.record(rollout, attempt.outcome, attempt.duration_s, attempt, row, capture, seq)


def _policy_keys(start: int | None, end: int | None) -> dict[str, Any]:
    if start is None or end is None:
        return {}
    return {POLICY_VERSION_START: start, POLICY_VERSION_END: end}
