"""One rollout's whole life: its slots, the agent call, the commit; its outcome as a value.

A ``Flight`` is made when the pool admits a rollout and runs as one task
whose result is a ``Landing``, which its job alone records:

1. at the agent (``Stage.WAITING`` and ``AT_AGENT``): it holds its ``Slots``
   while ``AgentClient.run`` delivers the body (retrying what was not
   delivered); only here can the shutdown grace or the budget's end cancel
   it, and then it writes nothing: the job sees the task cancelled and counts
   the rollout as cancelled;
2. answered (``ANSWERED``): it waits for room in the commit queue (slots and
   bytes: backpressure when the disk stalls or rows are huge), then frees its
   agent slots. Its row is written whatever the grace (contracts §10); only a
   cancelled or failed job cancels it;
3. committing (``COMMITTING``): the ``Finalizer`` builds its line and ``write`` appends it.
   The commit is shielded: a cancel that arrives meanwhile waits for it to
   end, so a written row is always counted. A plain row is built without a
   pause, so only its write can meet a cancel, and the write's future refuses
   it: the commit runs in the flight's own task, not in one more, and without
   ``asyncio.shield``'s extra future and turn of the loop.

A fault of our own at any step puts the rollout back (a ``Landing`` with a
``fault``) instead of writing a row. The flight knows its job only through
``FlightParts``: the parts it uses, never the job itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import structlog

from dispatcher.admission.pool import Slots
from dispatcher.delivery.agent_errors import AgentMisconfigured
from dispatcher.delivery.client import AgentClient, Attempt
from dispatcher.delivery.faults import LocalFault, as_local_fault
from dispatcher.errors import DispatcherError, OutputWriteError
from dispatcher.files.writer import Line
from dispatcher.lifecycle import Stage
from dispatcher.outcome import Outcome
from dispatcher.rows.finalize import Finalizer
from dispatcher.tasks.keys import POLICY_VERSION_END, POLICY_VERSION_START
from dispatcher.tasks.materialize import Rollout

log = structlog.get_logger("dispatcher.run")

T = TypeVar("T")

_WAITING, _AT_AGENT = Stage.WAITING, Stage.AT_AGENT


class CommitQueue(Protocol):
    def enter_now(self, body_bytes: int) -> bool: ...
    async def enter(self, body_bytes: int) -> None: ...
    def leave(self, body_bytes: int) -> None: ...


@dataclass(frozen=True, slots=True)
class FlightParts:
    """What a flight uses: the job's and the daemon's parts, passed down, never called up."""

    # The loop the flights run on (their job's ``create_task``).
    loop: asyncio.AbstractEventLoop
    agents: AgentClient
    commit_queue: CommitQueue
    finalizer: Finalizer
    # Queues an attempt's line for its file; resolves to the output's line number
    # for a success once the line is durable. The future refuses a cancel.
    write: Callable[[Outcome, Line], asyncio.Future[int | None]]
    policy_version: Callable[[], int | None]
    # Told once, when the rollout's agent slots are freed.
    left_agent: Callable[[Rollout], None]
    # Told once, when the flight's task is done (also one cancelled before it ran).
    landed: Callable[[Flight, asyncio.Task[Landing]], None]


@dataclass(slots=True)
class Landing:
    """How a flight ended: an outcome to record, a rollout to put back, or a failed commit."""

    outcome: Outcome
    duration_s: float
    attempt: Attempt | None = None
    # What the finality rule reads of the row (``Finalizer.finalize``).
    row: dict[str, Any] | None = None
    capture: dict[str, Any] | None = None
    seq: int | None = None
    # Our own fault (§11): the rollout goes back to the queue, nothing is written.
    fault: LocalFault | None = None
    # The commit could not be written: the job fails with this error.
    error: DispatcherError | None = None


class Flight:
    """Owns one admitted rollout from its slots to its ``Landing``.

    A flight is as small as it can be: at 10,000 in flight, every object one
    holds is walked by each young GC pass (``aio.tune_gc``). So it is its own
    ``AgentClient.run`` progress (``sending``, read from its ``stage``), its
    done callback is a bound method, and the whole agent call is one coroutine
    deep here.
    """

    __slots__ = ("_parts", "_slots", "rollout", "stage", "started", "task")

    def __init__(self, rollout: Rollout, slots: Slots, parts: FlightParts) -> None:
        self.rollout = rollout
        self._parts = parts
        # Held until the row's turn to commit; None once given back.
        self._slots: Slots | None = slots
        self.stage = Stage.WAITING
        self.started = time.perf_counter()
        self.task: asyncio.Task[Landing] | None = None

    @property
    def sending(self) -> bool:
        """Whether its request is at a replica now, not waiting to retry (``Progress``)."""
        return self.stage is Stage.AT_AGENT

    @sending.setter
    def sending(self, value: bool) -> None:
        # ``_move`` spelled out (twice a try): only these two stages trade places, so
        # a late "not sending" (a retry's, after a cancel) never undoes a stage.
        stage = self.stage
        if value and stage is _WAITING:
            self.stage = _AT_AGENT
        elif not value and stage is _AT_AGENT:
            self.stage = _WAITING

    def _move(self, to: Stage) -> None:
        # A late move (a retry's "not sending" after a cancel) never undoes a stage.
        if self.stage.may_move_to(to):
            self.stage = to

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    async def fly(self) -> Landing:
        rollout, parts = self.rollout, self._parts
        version_start = parts.policy_version()
        try:
            attempt = await parts.agents.run(
                rollout.agent, rollout.body, rollout.rollout_id, self, rollout.wire
            )
            # An outcome to write (an answer, or a delivery given up): from here on
            # the shutdown grace never cancels it.
            self._move(Stage.ANSWERED)
            # Backpressure: past the queue's bounds the rollout keeps its agent
            # slots, so no new rollout starts until rows are written.
            if not parts.commit_queue.enter_now(attempt.body_bytes):
                await parts.commit_queue.enter(attempt.body_bytes)
            self._move(Stage.COMMITTING)
        except LocalFault as fault:
            return Landing(Outcome.REQUEUED, self.elapsed_s(), fault=fault)
        except AgentMisconfigured as exc:
            # A wrong agent URL is the operator's to fix (exit 2), not the task's failure.
            return Landing(Outcome.CANCELLED, self.elapsed_s(), error=exc)
        finally:
            self.leave_agent()
        try:
            if parts.finalizer.pauses(attempt):
                # Its row is built across awaits (capture, a worker): shield all of it.
                return await _to_the_end(self._commit(attempt, version_start, True))
            return await self._commit(attempt, version_start, False)
        finally:
            parts.commit_queue.leave(attempt.body_bytes)

    def land(self, task: asyncio.Task[Landing]) -> None:
        """The task's done callback: its job records the landing."""
        self._move(Stage.DONE)
        self._parts.landed(self, task)
        # Landed, it lets go of its task: a cancelled task's exception holds the
        # flight's frames, and so the flight and its job, in a reference cycle.
        self.task = None

    def leave_agent(self) -> None:
        """Free the slots and leave the job's in-flight count, once: also for a task
        cancelled before it ever ran, whose ``finally`` never runs."""
        if self._slots is not None:
            self._slots.release()
            self._slots = None
            self._parts.left_agent(self.rollout)

    async def _commit(self, attempt: Attempt, version_start: int | None, pauses: bool) -> Landing:
        rollout, parts = self.rollout, self._parts
        try:
            extra = _policy_keys(version_start, parts.policy_version())
            if pauses:
                line, row, capture = await parts.finalizer.finalize(rollout, attempt, extra)
            else:
                line, row, capture = parts.finalizer.finalize_now(rollout, attempt, extra)
        except Exception as exc:
            # A bug of ours (or our memory) while handling an answer: not the
            # agent's failure, so no row; the rollout runs again.
            fault = as_local_fault(exc) or LocalFault("bug", f"handling an answer raised {exc!r}")
            log.error("answer_handling_failed", rollout_id=rollout.rollout_id, exc_info=exc)
            return Landing(Outcome.REQUEUED, attempt.duration_s, attempt, fault=fault)
        try:
            seq = None
            if line is not None:
                written = parts.write(attempt.outcome, line)
                try:
                    seq = await written
                except asyncio.CancelledError:
                    # ``written`` refuses a cancel: one that came meanwhile is seen
                    # once the row is settled, and a written row is counted.
                    if not written.done():
                        raise
                    seq = written.result()
        except OutputWriteError as exc:
            return Landing(Outcome.CANCELLED, attempt.duration_s, error=exc)
        except Exception as exc:
            error = DispatcherError(f"committing {rollout.rollout_id} failed: {exc!r}")
            return Landing(Outcome.CANCELLED, attempt.duration_s, error=error)
        return Landing(attempt.outcome, attempt.duration_s, attempt, row, capture, seq)


async def _to_the_end(step: Awaitable[T]) -> T:
    """Await ``step`` to its end, even when the flight is cancelled meanwhile."""
    inner = asyncio.ensure_future(step)
    try:
        return await asyncio.shield(inner)
    except asyncio.CancelledError:
        # The row may be on its way to disk: it must be counted, not lost.
        return await inner


def _policy_keys(start: int | None, end: int | None) -> dict[str, Any]:
    if start is None or end is None:
        return {}
    return {POLICY_VERSION_START: start, POLICY_VERSION_END: end}
