"""One job: one output's files and state, driven on a ``Daemon`` (contracts §4, §5, §9).

``Job`` owns everything of a single run: the lock and the prepared files, the
row writers, the exact latency tracker, its ``Recorder`` (outcome counts and
the files NeMo Gym Main reads, ``recorder.py``), the rollouts left to start
(``pending.py``) and its ``Flight``s. Reading order:

- ``open``: lock, materialize, load what is done (``prepare.py``), open the
  writers; a failure half-way releases what was taken (an exit stack);
- ``dispatch``: the producer admits pending rollouts through the daemon's
  pool, each into a ``Flight`` (``flight.py``), until all settle or a stop;
  when the daemon says the budget is spent, rollouts at agents get the grace;
- ``_landed``: a flight's ``Landing`` (its outcome, a fault of ours, or a
  failed commit) is recorded, here and nowhere else;
- ``close``: rollouts at agents get the grace (``grace.py``), then are
  cancelled (no row: they run on resume); answered rows and commits are awaited, writers
  closed, the hop recorded (coverage and status files, the manifest by
  ``reporting.py``), the lock released.

Outcomes are counted in ``Recorder.record`` and nowhere else. Crash-only: the output
files are the only state; a kill -9 anywhere loses nothing acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import structlog

from dispatcher.admission.history import TaskHistory
from dispatcher.admission.order import OrderFor, StartOrder, start_order_for
from dispatcher.admission.pool import Slots
from dispatcher.aio import cancel_all, cancel_and_wait, first_of
from dispatcher.delivery.faults import LocalFault
from dispatcher.errors import DispatcherError, OutputWriteError
from dispatcher.files.resume import nothing_succeeded
from dispatcher.files.writer import Line, LineIndex, RowWriter
from dispatcher.latency.tracker import DispatchLatencyTracker
from dispatcher.lifecycle import JobState, Lifecycle, Stage
from dispatcher.outcome import Outcome
from dispatcher.rows.finalize import Finalizer
from dispatcher.run import grace
from dispatcher.run.daemon import Daemon
from dispatcher.run.flight import Flight, FlightParts, Landing
from dispatcher.run.job_figures import HopEnd as HopEnd
from dispatcher.run.job_figures import JobFigures
from dispatcher.run.pending import Pending
from dispatcher.run.prepare import PreparedRun, prepare_and_open, publish_metrics_endpoint
from dispatcher.run.recorder import (
    FinalHook,
    NothingSucceeded,
    Recorder,
)
from dispatcher.run.views import LatencyView
from dispatcher.settings.config import RunSettings
from dispatcher.tasks.materialize import Rollout, new_capture_token

log = structlog.get_logger("dispatcher.run")

START_BURST = 8

# Called before each rollout starts: True, start it; False, not in this hop;
# None, start nothing more (service mode's pacing and step control).
Gate = Callable[[Rollout], Awaitable["bool | None"]]


class Job(JobFigures):
    """Owns one run's files and state; see the module docstring."""

    def __init__(
        self,
        daemon: Daemon,
        settings: RunSettings,
        *,
        shard_filter: Callable[[int], bool] | None = None,
        tracker: DispatchLatencyTracker | None = None,
        rank: Callable[[], tuple[int, ...]] = tuple,
        on_final: FinalHook | None = None,
        publish_endpoint: bool = True,
        output_index: LineIndex | None = None,
        failures_index: LineIndex | None = None,
        gate: Gate | None = None,
        history: TaskHistory | None = None,
        order_for: OrderFor = start_order_for,
        durable_start: bool = True,
        end: HopEnd | None = None,
    ) -> None:
        self.daemon = daemon
        self.settings = settings
        self.tracker = tracker or DispatchLatencyTracker()
        self.end = end or HopEnd()
        self._shard_filter = shard_filter
        self._rank = rank
        self._publish_endpoint = publish_endpoint
        self._gate = gate
        # False: the hop's files are prepared without fsync and made durable beside
        # its first rollouts, before its first row (a served job: ``prepare_run``).
        self._durable_start = durable_start
        # Which rollout starts next (contracts §13, start order); None: input order.
        self._history = history
        self._order_for = order_for
        # Service mode reads rows back by line number (the results stream).
        self.output_index = output_index
        self.failures_index = failures_index
        self._init_unopened()
        self.finalizer = Finalizer(settings, daemon.metrics, count_tokens=on_final is not None)
        # Bound once: the module-level proxy would rebuild a logger per call.
        self.log = log.bind()
        self.recorder = Recorder(settings, daemon, self._latency_views(), on_final, self.log)

    def _init_unopened(self) -> None:
        """The state of a job not yet opened: no files, no flights, no stop, idle."""
        self.state = Lifecycle(JobState.QUEUED)
        self.fatal: DispatcherError | None = None
        self.prepared: PreparedRun | None = None
        self.order: StartOrder | None = None
        self.flights: set[Flight] = set()
        # Rollouts at agents (admitted, not answered): the one count of them,
        # moved with the in-flight gauge in ``_launch`` and ``_left_agent``.
        self._at_agents = 0
        self._parts: FlightParts | None = None
        self._context: contextvars.Context | None = None
        self.writers: tuple[RowWriter, ...] = ()
        self._synced: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        # Set by ``close_starts``: nothing more starts, what is in flight goes on.
        self._starts_closed = asyncio.Event()
        self._cancel_reason: str | None = None
        self._pending: Pending | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._resources = contextlib.AsyncExitStack()
        # The job's own times (``Daemon.clock``): a job served an hour after the
        # daemon started has its rate and ETA from its own start, not the daemon's.
        self._opened_at: float | None = None
        self._dispatch_started: float | None = None
        self._dispatch_ended: float | None = None
        # One per hop: scopes each attempt's model-call capture (capture/scope.py).
        self._capture_token = new_capture_token() if self.settings.capture_dir is not None else None

    # ---- open --------------------------------------------------------------------

    async def open(self, then: Callable[[PreparedRun], None] | None = None) -> None:
        """Lock, prepare and open the files in one thread hop, with ``then`` (or release all)."""
        self._opened_at = self.daemon.clock()
        async with contextlib.AsyncExitStack() as stack:
            indexes = (self.output_index, self.failures_index)
            self.prepared, fds = prepared, fds = await asyncio.to_thread(
                prepare_and_open, self.settings, self._shard_filter, self._durable_start,
                indexes, partial(self._choose_order, then),
            )  # fmt: skip
            stack.callback(prepared.lock.release)
            if prepared.sync is not None:
                self._synced = asyncio.create_task(asyncio.to_thread(prepared.sync))
                # Awaited by the writers' first batch, and by close whatever happens.
                stack.push_async_callback(self._sync_ended)
            paths = (prepared.paths.output, prepared.paths.failures)
            self.writers = tuple(map(self._writer, paths, indexes))
            for writer, fd in zip(self.writers, fds, strict=True):
                writer.open(fd)
                stack.push_async_callback(writer.close)
            endpoint = self.daemon.metrics_endpoint
            if self._publish_endpoint and endpoint is not None:
                await asyncio.to_thread(publish_metrics_endpoint, prepared, endpoint, self.settings)
            # Every row carries the run's id (contracts §15).
            self.finalizer.run_id = self.recorder.attach(prepared, self.writers[1])
            if self.recorder.files is not None:
                self.recorder.files.durable = self.end.durable
            self._resources = stack.pop_all()
        self.daemon.jobs.add(self)

    def _choose_order(self, then: Callable[..., None] | None, prepared: PreparedRun) -> None:
        """The start order, then ``then`` (blocking). A gated or capture-routed job keeps each
        group's repeats together: they share a replica's prefix cache only together."""
        whole_groups = self._gate is not None or self.settings.capture_proxy_url is not None
        self.order = self._order_for(self.settings, self._history, whole_groups)
        if then is not None:
            then(prepared)

    async def _sync_ended(self) -> None:
        """The deferred fsync of the hop's files, ended: a failure of it fails the job."""
        assert self._synced is not None
        await asyncio.wait([self._synced])
        if not self._synced.cancelled() and (exc := self._synced.exception()) is not None:
            self.fail(DispatcherError(f"the run's files could not be made durable: {exc}"))

    def started_event(self) -> dict[str, Any]:
        """The fields of ``run_started``."""
        prepared = self.prepared
        assert prepared is not None
        return {
            "run_id": prepared.record.run_id,
            "hop": prepared.record.hops,
            "resumed": prepared.resumed,
            "expected": prepared.materialized.rollouts,
            "already_final": prepared.already_final,
            "output": str(prepared.paths.output),
        }

    def _writer(self, path: Path, index: LineIndex | None) -> RowWriter:
        return RowWriter(
            path,
            self.settings.fsync,
            interval_s=self.settings.fsync_batch_interval_s,
            max_rows=self.settings.fsync_batch_rows,
            on_error=self.fail,
            index=index,
            # Nothing at an agent: a row of this job is not coming soon.
            quiet=lambda: self._at_agents == 0,
            barrier=self._synced,
        )

    # ---- dispatch ------------------------------------------------------------------

    async def dispatch(self) -> None:
        """Start every pending rollout (or drain it) and wait for all to settle, or a stop."""
        self.state.advance(JobState.RUNNING)
        self._dispatch_started = self.daemon.clock()
        producer = asyncio.create_task(self._produce(), name="producer")
        # The stops, waited for by both steps and cancelled with the rest at the end,
        # all at once: a task cancelled and awaited alone is a turn of the loop each.
        stops = [asyncio.create_task(self._stop.wait()),
                 asyncio.create_task(self.daemon.stop_requested.wait())]  # fmt: skip
        budget_end = asyncio.create_task(self._settle_at_budget_end(), name="budget-end")
        tasks = [producer, budget_end, *stops]
        try:
            tasks.append(closed := asyncio.create_task(self._starts_closed.wait()))
            await first_of(producer, [*stops, closed])
            if self._starts_closed.is_set():
                # A producer waiting for a slot gives it back.
                await cancel_and_wait(producer)
            if producer.done() and (producer.cancelled() or producer.exception() is None):
                tasks.append(idle := asyncio.create_task(self._idle.wait(), name="wait-idle"))
                await first_of(idle, stops)
        finally:
            await cancel_all(tasks)
            self._dispatch_ended = self.daemon.clock()

    async def _settle_at_budget_end(self) -> None:
        await self.daemon.budget_spent.wait()
        await self.settle(self.settings.shutdown_grace_s, "dispatch budget exhausted")

    def stopping(self) -> bool:
        return self._stop.is_set() or self.daemon.stop_requested.is_set()

    def cancel(self, reason: str) -> None:
        """Stop starting rollouts; ``close`` cancels those at agents without grace."""
        self._cancel_reason = reason
        self._stop.set()

    def close_starts(self) -> None:
        """Start nothing more; the rollouts in flight run to their end."""
        self._starts_closed.set()

    def fail(self, error: DispatcherError) -> None:
        if self.fatal is None:
            self.fatal = error
            self.log.error("run_failed", error=str(error))
        self._stop.set()

    async def _produce(self) -> None:
        started = 0
        async for rollout in self._pending_rollouts().each(lambda: bool(self.flights)):
            if self.stopping() or self._starts_closed.is_set():
                return
            slots = await self._admit(rollout)
            if slots is None:
                continue
            # Its attempt index is durable before it is sent (contracts §5).
            await self._pending_rollouts().reserve()
            self._launch(rollout, slots)
            started += 1
            if started % START_BURST == 0:
                # Starting hundreds of rollouts in one loop iteration (at
                # startup, or when many slots free at once) would stall every
                # other rollout's I/O: yield between small bursts.
                await asyncio.sleep(0)

    async def _admit(self, rollout: Rollout) -> Slots | None:
        """The slots to start ``rollout`` with, or None: not now (its agent is down,
        the gate says so, the budget drains it) or nothing more starts."""
        if self.daemon.load.is_down(rollout.agent):
            self.recorder.not_started(rollout, Outcome.AGENT_DOWN)
            return None
        if self._gate is not None:
            start = await self._gate(rollout)
            if start is None:
                self.close_starts()
            if not start:
                return None
        slots = await self.daemon.pool.admit(rollout.agent, self._rank())
        if slots is None:
            self.recorder.not_started(rollout, Outcome.DRAINED)
            return None
        if self.stopping() or self._starts_closed.is_set():
            # Stopped while it waited for the slot.
            slots.release()
            return None
        return slots

    def _pending_rollouts(self) -> Pending:
        if self._pending is None:
            assert self.prepared is not None
            self._pending = Pending(
                self.prepared.paths.materialized,
                self.prepared.state,
                self.settings.capture_dir,
                self._capture_token,
                self.prepared.paths.reservations,
                self.order,
            )
        return self._pending

    def _launch(self, rollout: Rollout, slots: Slots) -> None:
        parts = self._flight_parts()
        flight = Flight(rollout, slots, parts)
        self._at_agents += 1
        self.daemon.metrics.rollout_started(rollout.agent)
        self.flights.add(flight)
        self._idle.clear()
        # Every flight of the job runs in the one context copied here (no flight
        # binds a context variable): a copy per task and per callback would be
        # two more objects per rollout in flight for each GC pass to walk.
        if self._context is None:
            self._context = contextvars.copy_context()
        name = f"rollout:{rollout.rollout_id}"
        # The loop's own ``create_task``: ``asyncio.create_task`` asks for the running
        # loop each time (a ``getpid`` system call on Python 3.11).
        flight.task = task = parts.loop.create_task(flight.fly(), name=name, context=self._context)
        task.add_done_callback(flight.land, context=self._context)

    def _flight_parts(self) -> FlightParts:
        if self._parts is None:
            daemon = self.daemon
            self._parts = FlightParts(
                loop=asyncio.get_running_loop(),
                agents=daemon.agents,
                commit_queue=daemon.commit_queue,
                finalizer=self.finalizer,
                write=self._write,
                policy_version=daemon.policy_version,
                left_agent=self._left_agent,
                landed=self._landed,
            )
        return self._parts

    def _landed(self, flight: Flight, task: asyncio.Task[Landing]) -> None:
        """A flight ended: record its landing (the one place a rollout's end is handled)."""
        flight.leave_agent()
        self.flights.discard(flight)
        if not self.flights:
            self._idle.set()
            self._pending_rollouts().wake()
        rollout = flight.rollout
        if task.cancelled():
            # Cancelled at its agent: it wrote nothing and runs again on resume.
            self.recorder.record(rollout, Outcome.CANCELLED, flight.elapsed_s())
            return
        error = task.exception()
        if error is not None:
            self.log.error("rollout_task_crashed", task=task.get_name(), exc_info=error)
            self.fail(DispatcherError(f"rollout {rollout.rollout_id} crashed: {error!r}"))
            self.recorder.record(rollout, Outcome.CANCELLED, flight.elapsed_s())
            return
        self._land(rollout, task.result())

    def _land(self, rollout: Rollout, landing: Landing) -> None:
        if landing.error is not None:
            self.fail(landing.error)
            self.recorder.record(rollout, Outcome.CANCELLED, landing.duration_s)
        elif landing.fault is not None:
            self.requeue(rollout, landing.fault, landing.duration_s)
        else:
            self.daemon.handled_answer()
            self._learn(rollout, landing.duration_s)
            self.recorder.record(
                rollout,
                landing.outcome,
                landing.duration_s,
                landing.attempt,
                landing.row,
                landing.capture,
                landing.seq,
            )
            # A success counts no failure: the limit is where the last failure left it.
            limit = None if landing.outcome is Outcome.SUCCESS else self.recorder.failure_limit()
            if limit is not None and self.fatal is None:
                self.fail(limit)

    def _learn(self, rollout: Rollout, latency_s: float) -> None:
        """An answered rollout's latency, for the start order and the task history."""
        if self.order is not None:
            error = self.order.finished(rollout.key, rollout.task_index, latency_s)
            if error is not None:
                self.daemon.metrics.start_order_error(error)

    # ---- the parts flights use -----------------------------------------------------

    def _write(self, outcome: Outcome, line: Line) -> asyncio.Future[int | None]:
        """Queue an attempt's line for its file; the output's line number for a success.
        The future refuses a cancel: the flight that awaits it counts a written row."""
        output, failures = self.writers
        writer = output if outcome is Outcome.SUCCESS else failures
        return writer.submit(line, shielded=True)

    def requeue(self, rollout: Rollout, fault: LocalFault, duration_s: float) -> None:
        """Put a rollout back after our own fault: no row, no attempt spent, a smaller pool."""
        self.recorder.record(rollout, Outcome.REQUEUED, duration_s)
        if self.daemon.local_fault(fault, rollout.rollout_id):
            self._pending_rollouts().put_back(rollout)

    def start_later(self, rollout: Rollout) -> None:
        """Offer a rollout its gate held aside again, before the next new one."""
        self._pending_rollouts().put_back(rollout)

    def _left_agent(self, rollout: Rollout) -> None:
        """A flight's agent answered (or it was cancelled or put back): its slots are free."""
        self._at_agents -= 1
        self.daemon.metrics.rollout_left_agent(rollout.agent)
        self.daemon.left_agent.fire()

    @property
    def idle(self) -> asyncio.Event:
        """Set while none of the job's rollouts is in flight."""
        return self._idle

    async def settle(self, grace_s: float, reason: str, spare: Stage = Stage.ANSWERED) -> None:
        """Give rollouts at agents ``grace_s`` to answer, then cancel the rest (no row);
        those at ``spare`` or past it are never cancelled (``grace.settle``)."""
        await grace.settle(self.flights, grace_s, reason, self.log, spare)

    # ---- close -----------------------------------------------------------------------

    async def close(self) -> None:
        """Settle the flights, close the files, record the hop, release the lock."""
        # After a fatal error nothing more can be written, and a cancelled job
        # wants nothing more: no grace.
        if self.fatal is not None or self.daemon.fatal is not None or self._cancel_reason:
            reason = self._cancel_reason or "the run failed"
            await self.settle(0.0, reason, spare=Stage.COMMITTING)
        else:
            await self.settle(self.settings.shutdown_grace_s, "shutdown grace period ended")
        # Commits under way, and answered rows waiting for theirs, are never
        # cancelled: wait for them.
        if self.flights:
            await asyncio.wait({f.task for f in self.flights if f.task is not None})
        try:
            await self.recorder.drain()
            for writer in self.writers:
                await writer.close()
            if self.order is not None and self.order.history is not None:
                await self.order.history.save()
            await self._record_hop()
        finally:
            # The lock and the files are given back even when the disk is full.
            await self._resources.aclose()
            # Its flights' parts are bound methods of the job: a reference cycle
            # that would keep the job's rows' state until a rare full GC pass.
            self._parts = None

    async def _record_hop(self) -> None:
        """Gym's aggregate file, the hop's state, the manifest's ``last_run``, the summary."""
        self._refuse_nothing_succeeded()
        summary = self.summary()
        try:
            aggregation = await self._write_aggregate_metrics()
            write_files = await self.recorder.finish(aggregation)
            await asyncio.to_thread(self._write_end_files, write_files, summary)
        except OSError as exc:
            # The rows are whole (each was durable before it counted); only the
            # hop's record is missing, which the next hop writes again.
            self.fail(OutputWriteError(f"recording the end of the hop failed: {exc}"))
        self.state.advance(self._final_state())
        self.log.info("run_summary", **summary)

    def _refuse_nothing_succeeded(self) -> None:
        state = self.recorder.state
        if self.fatal is None and self.remaining() == 0 and state is not None:
            why = nothing_succeeded(state, self.expected() or 0)
            if why is not None:
                self.fail(NothingSucceeded(why))

    # ---- the latency views (outcomes are counted in ``recorder.py``) ----------------

    def _latency_views(self) -> tuple[LatencyView, ...]:
        # The daemon's live view is this tracker itself for ``dispatcher run``.
        live = self.daemon.latency
        return (self.tracker,) if live is self.tracker else (self.tracker, live)
