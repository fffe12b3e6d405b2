"""A job of ``dispatcher serve`` while it runs: its hops, gate and live status.

A ``ServedJob`` is one accepted job that is not final: its record (``registry.py``), a
``Job`` (``run/job.py``: the files, resume contract and exit rules of ``dispatcher run``)
made as it starts, in a task of its own, and its ``Groups``. A free slot of the daemon's
pool goes to the job of highest priority, then the earliest submitted. A job whose
``policy_version`` p is more than K ahead of the trainer's V starts nothing until
V ≥ p − K, nothing in flight cancelled for staleness (contracts §12); its start window
(``window.py``: ``max_in_flight``, ``admit``) bounds what it starts.

A job's step-control policy (``policy.py``: its target, group filter and ordering, from
its body) is applied by its ``StepControl`` (``step.py``): its gate starts a new group
only while its target leaves room, and once the target is reached the job starts nothing
more (``finish``: what is in flight runs to its end; ``cancel``: it is cancelled) and
ends ``satisfied``. A rollout whose agent has no room while others may have some
(per-agent quotas) is held aside (``step.HeldAside``) and offered again when a group of
its agent is filtered out.

Once final, the job's record (with its final status) is saved and the service replaces it
by a ``FinalJob`` (``final.py``): nothing of its rows, indexes or groups stays in memory.

Failure policy of a job's task: whatever it raises (a file it cannot write, a bug) makes
the job ``failed`` with a one-line reason, final, and ends its streams with
``{"end": "failed", "error": ...}``; the daemon and the other jobs go on. A failed job
is not settled: the same ``dispatcher serve`` command resumes it from its files, exactly.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import structlog

from dispatcher.admission.history import TaskHistory
from dispatcher.aio import cancel_all
from dispatcher.delivery.faults import as_local_fault
from dispatcher.errors import DispatcherError, OutputWriteError
from dispatcher.files.contracts import JobStatus
from dispatcher.files.resume import OutputPaths, file_outcomes
from dispatcher.files.writer import LineIndex
from dispatcher.lifecycle import JobState
from dispatcher.run.daemon import Daemon
from dispatcher.run.job import HopEnd, Job
from dispatcher.run.prepare import PreparedRun
from dispatcher.serve.faults import log_crash, one_line
from dispatcher.serve.groups import Groups
from dispatcher.serve.policy import Room, policy_of
from dispatcher.serve.registry import OUTPUT_FILE, JobRecord, Registry
from dispatcher.serve.results import Source
from dispatcher.serve.step import HeldAside, StepControl
from dispatcher.serve.window import StartWindow
from dispatcher.settings.config import RunSettings
from dispatcher.tasks.materialize import Rollout

log = structlog.get_logger("dispatcher.serve")

# Between hops of a job that made no progress (its agent down, say): 1 s, 2 s ... 60 s.
HOP_PAUSE_BASE_S = 1.0
HOP_PAUSE_CAP_S = 60.0


class Host(Protocol):
    """What a running job needs of the service that owns it."""

    daemon: Daemon
    base: RunSettings
    registry: Registry
    max_off_policy_steps: int | None
    history: TaskHistory | None
    hop_end: HopEnd

    async def write(self, write: Callable[..., Any], *args: Any) -> Any: ...

    async def save_final(self, record: JobRecord) -> None: ...

    def disk_fault(self, exc: BaseException) -> None: ...

    def finished(self, served: ServedJob) -> None: ...


class ServedJob:
    """One job of the service: its record, its ``Job`` while it runs, its groups."""

    def __init__(self, service: Host, record: JobRecord) -> None:
        self.service = service
        self.record = record
        folder = service.registry.job_dir(record.job_id)
        spec = record.spec
        self.output = folder / OUTPUT_FILE
        self.groups_path = folder / "groups.jsonl"
        # Its rows are in its folder (submitted inline) or in the file it named.
        tasks = folder / record.rows_file if record.rows_file else Path(str(spec.input))
        self.settings = spec.settings(service.base, tasks, self.output)
        self.paced = self.finished = False
        self.task: asyncio.Task[None] | None = None
        self.policy = policy = policy_of(spec)
        self.step = StepControl(policy.target, spec.on_target)
        self.step.when_satisfied(self._satisfied)
        self.step.on_room = self._room_for
        self._held = HeldAside()
        self.window = StartWindow(spec.max_in_flight, spec.admit, service.daemon.left_agent)
        self.groups: Groups | None = Groups(
            self.groups_path,
            on_error=self._groups_failed,
            group_filter=policy.group_filter.teaches_nothing if policy.group_filter else None,
            on_group=self.step.on_group,
            details=policy.needs_details,
            surplus=self.step.surplus,
            durable=self.settings.fsync != "never",
        )
        self.output_index = LineIndex()
        # Its failure rows, read by a stream that asked for them (contracts §12); one
        # wakeup for both files, so such a stream waits on one.
        self.failures_index = LineIndex()
        self.failures_index.grew = self.output_index.grew
        # Outcomes of the job's earlier hops (and, after a restart, of its files):
        # its status counts every pass, not only the hop running now.
        self.earlier_outcomes: Counter[str] = Counter()
        # Made as it starts (``start``): a burst's answers wait for no job's hop.
        self.job: Job | None = None
        self._cancelled = asyncio.Event()
        # Whether a hop has loaded the job's files (its groups, earlier outcomes).
        self._loaded = False

    def _new_job(self) -> Job:
        """One hop of the job: a ``Job`` on its files, sharing its indexes and groups."""
        spec, record = self.record.spec, self.record
        assert self.groups is not None
        return Job(
            self.service.daemon,
            self.settings,
            rank=lambda: (-spec.priority, record.submitted_seq),
            on_final=self.groups.on_final,
            publish_endpoint=False,
            output_index=self.output_index,
            failures_index=self.failures_index,
            gate=self._gate,
            history=self.service.history,
            order_for=self.policy.ordering.start_order,
            # Its input is durable (the journal, or the file it named): its files
            # are made durable beside its first rollouts, not before them.
            durable_start=False,
            end=self.service.hop_end,
        )

    @property
    def job_id(self) -> str:
        return self.record.job_id

    @property
    def digest(self) -> str:
        return self.record.digest

    def start(self, failed: str | None = None) -> None:
        """Its task; ``failed``: it opens nothing and ends failed with that reason."""
        if failed is None:
            job = self.job = self._new_job()
            if self._cancelled.is_set():
                job.cancel("job cancelled")
        run = self._run() if failed is None else self._settle(JobState.FAILED, failed)
        self.task = asyncio.create_task(run, name=f"job:{self.job_id}")

    async def _run(self) -> None:
        """The job's task: its hops, then its final state, whatever happens."""
        structlog.contextvars.bind_contextvars(job_id=self.job_id)
        try:
            state, error = await self._hops()
        except Exception as exc:
            # The failure policy of a job's task: the job fails, with the reason.
            # Nothing else awaits this task but shutdown, which must not be the
            # first to hear of it.
            log_crash("job_task_crashed", exc, job_id=self.job_id)
            state, error = JobState.FAILED, self._crash_reason(exc)
            self._release(self.job)
        if self.groups is not None:
            await self.groups.close()
        await self._settle(state, error)

    def _release(self, job: Job | None) -> None:
        """What a hop that crashed half-way through its close still holds: its place
        among the daemon's jobs and its files' lock (releasing twice is harmless)."""
        if job is None:
            return
        self.service.daemon.jobs.discard(job)
        if job.prepared is not None:
            job.prepared.lock.release()

    def _crash_reason(self, exc: Exception) -> str:
        """The first error of the job (a row writer's, say), else the crash itself."""
        if self.job is not None and self.job.fatal is not None:
            self.service.disk_fault(self.job.fatal)
            return str(self.job.fatal)
        self.service.disk_fault(exc)
        return one_line(exc)

    async def _hops(self) -> tuple[JobState, str | None]:
        """Hops until the job is final: failed attempts with attempts left (and
        rollouts of an agent that was down) run again in a next hop, as
        ``dispatcher run``'s job script would rerun it, after a pause when a
        hop made no progress."""
        hop = idle_hops = 0
        while True:
            job = self.job if hop == 0 and self.job is not None else self._next_job()
            state, error = await self._hop(job)
            if state is not JobState.INCOMPLETE or self._stopping() or self.step.satisfied:
                break
            idle_hops = 0 if job.final_this_run else idle_hops + 1
            pause_s = min(HOP_PAUSE_CAP_S, HOP_PAUSE_BASE_S * 2 ** (idle_hops - 1))
            if idle_hops and await self._paused(pause_s):
                break
            hop += 1
        if self.step.satisfied and state is not JobState.FAILED:
            state = JobState.SATISFIED
        elif self._cancelled.is_set() and state is JobState.INCOMPLETE:
            state = JobState.CANCELLED
        return state, error

    def _satisfied(self) -> None:
        """The target is reached: nothing of the job starts again."""
        step = self.step
        log.info("job_satisfied", job_id=self.job_id, groups_kept=step.kept,
                 groups_filtered=step.filtered, on_target=step.on_target)  # fmt: skip
        self._held.clear()
        if self.job is None:
            return
        if step.on_target == "cancel":
            self.job.cancel("job satisfied")
        else:
            self.job.close_starts()

    def _next_job(self) -> Job:
        """The next hop's ``Job``; the last hop's outcomes join the earlier ones."""
        if self.job is not None:
            self.earlier_outcomes.update(self.job.outcomes)
        self._held.clear()  # the new hop reads them again
        self.job = self._new_job()
        return self.job

    async def _opened(self, job: Job) -> tuple[JobState, str | None] | None:
        """Open the hop's files; None when they are open, else the hop's end.

        Running out of file descriptors (or memory) is the dispatcher's own fault
        (contracts §11), not the job's: the hop ends ``incomplete`` and the next
        one opens them again, after the pause of a hop that made no progress."""
        try:
            await job.open(None if self._loaded else self._load_groups)
        except Exception as exc:
            fault = as_local_fault(exc)
            if fault is not None:
                log.warning("job_start_deferred", job_id=self.job_id, fault=fault.kind,
                            error=one_line(exc))  # fmt: skip
                return JobState.INCOMPLETE, None
            if not isinstance(exc, DispatcherError):
                raise
            self.service.disk_fault(exc)
            return JobState.FAILED, str(exc)
        return None

    def _load_groups(self, prepared: PreparedRun) -> None:
        """Its groups as its files hold them (blocking: in the opening hop's thread)."""
        assert self.groups is not None
        paths, state = prepared.paths, prepared.state
        self._missing = self.groups.load(paths.materialized, paths.output, state)

    async def _hop(self, job: Job) -> tuple[JobState, str | None]:
        """Open, dispatch and close one hop; its final state and error."""
        if (ended := await self._opened(job)) is not None:
            return ended
        prepared = job.prepared
        assert prepared is not None and self.groups is not None
        structlog.contextvars.bind_contextvars(run_id=prepared.record.run_id)
        try:
            if not self._loaded:
                # The first hop that opened its files: the earlier ones (deferred
                # by a fault of ours) read nothing.
                self._loaded = True
                self.earlier_outcomes.update(file_outcomes(prepared.state))
                self.step.reopen(self.groups.reopened)
                await self.groups.open(self._missing)
            log.info("job_started", job_id=self.job_id, **job.started_event())
            await job.dispatch()
        except Exception as exc:
            log_crash("job_hop_crashed", exc, job_id=self.job_id)
            job.fail(DispatcherError(f"job {self.job_id} failed: {one_line(exc)}"))
        finally:
            await job.close()
            await self.groups.flush()  # its last groups told: what ends the hop reads the step
            # Its files are closed: the daemon's figures (remaining, the budget's end)
            # are the running jobs'. A run's one job stays: its last scrape shows it.
            job.daemon.jobs.discard(job)
        if job.fatal is None:
            return job.state.state, str(job.daemon.fatal) if job.daemon.fatal else None
        self.service.disk_fault(job.fatal)  # failed, if only by its last groups' fsync
        return JobState.FAILED, str(job.fatal)

    def _groups_failed(self, error: OutputWriteError) -> None:
        """``groups.jsonl`` could not be written or fsynced: the job stops, naming it."""
        if self.job is not None:
            self.job.fail(error)

    def _stopping(self) -> bool:
        return self._cancelled.is_set() or self.service.daemon.stop_requested.is_set()

    async def _paused(self, delay_s: float) -> bool:
        """Wait ``delay_s`` before the next hop, or until an agent comes back; True
        when a cancel or stop came first."""
        log.info("job_hop_paused", job_id=self.job_id, pause_s=round(delay_s, 3))
        stops = {
            asyncio.create_task(self._cancelled.wait()),
            asyncio.create_task(self.service.daemon.stop_requested.wait()),
        }
        back = asyncio.create_task(self.service.daemon.load.agent_back.wait(delay_s))
        done, pending = await asyncio.wait(
            {*stops, back}, timeout=delay_s, return_when="FIRST_COMPLETED"
        )
        await cancel_all(list(pending))
        return bool(done & stops)

    async def _settle(self, state: JobState, error: str | None) -> None:
        """Record the final state and status in ``job.json``, hand the job over to
        the service as final (it keeps nothing of its rows), wake the streams.

        A record that cannot be saved fails the job (its file still says it is
        unfinished, so a restart resumes it), and the streams end all the same."""
        if state is JobState.FAILED and error is None:
            error = "failed without a recorded reason"
        self._record_final(state, error)
        try:
            await self.service.save_final(self.record)
        except OSError as exc:
            log_crash("job_record_not_saved", exc, job_id=self.job_id)
            reason = f"job.json not saved: {one_line(exc)}"
            error = reason if state is not JobState.FAILED else f"{error}; {reason}"
            state = JobState.FAILED
            self._record_final(state, error)
        self.finished = True
        log.info("job_finished", job_id=self.job_id, state=state.value, error=error)
        self.output_index.grew.fire()
        if self.groups is not None:
            self.groups.index.grew.fire()
        self.job = None
        self.groups = None
        self.step.forget_callbacks()
        self.service.finished(self)

    def _record_final(self, state: JobState, error: str | None) -> None:
        """The record of the job as it ends: state, outcomes, step figures and status."""
        record = self.record
        record.state, record.error = state, error
        if self.job is not None:
            record.outcomes = dict(self.earlier_outcomes + self.job.outcomes)
        if self.step.target is not None:
            record.step = self.step.figures()
        status = self._status()
        status = replace(status, state=state, final=True, error=error, in_flight=0, committing=0)
        record.final_status = status.to_json()

    async def _gate(self, rollout: Rollout) -> bool | None:
        """Before each rollout starts: pacing, its window, then step control (``Job``'s gate)."""
        await self._pace()
        await self.window.wait(lambda: self.job)
        while True:
            room = self.step.admits(rollout.task_index, rollout.agent)
            if room is None or room is Room.START:
                return None if room is None else True
            if room is Room.DEFER:
                self._held.add(rollout)
            job = self.job
            if room is not Room.WAIT or job is None or job.idle.is_set():
                # With nothing in flight no room can come in this hop: a next
                # hop runs what the open groups still need first.
                return False
            await self._room_or_idle(job)

    def _room_for(self, agent: str) -> None:
        """A group of ``agent`` was filtered out: offer its first task held aside."""
        for rollout in self._held.take(agent):
            if self.job is not None:
                self.job.start_later(rollout)

    async def _room_or_idle(self, job: Job) -> None:
        """Until a group completes (a filtered one frees room) or nothing is in flight."""
        waits = {
            asyncio.create_task(self.step.changed.wait(HOP_PAUSE_CAP_S)),
            asyncio.create_task(job.idle.wait()),
        }
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_all(list(waits))

    async def _pace(self) -> None:
        """Admission pacing: wait while this job's policy version is more than K ahead."""
        p, k = self.record.spec.policy_version, self.service.max_off_policy_steps
        policy = self.service.daemon.policy
        if p is None or k is None or policy is None or policy.version >= p - k:
            return
        self.paced = True
        log.info("job_paced", job_id=self.job_id, policy_version=p, current=policy.version)
        try:
            await policy.reaches(p - k)
        finally:
            self.paced = False

    def cancel(self) -> None:
        self._cancelled.set()
        if self.job is not None:
            self.job.cancel("job cancelled")

    # ---- what the API reads -----------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The job's ``contracts.JobStatus``, as JSON."""
        return self._status().to_json()

    @property
    def state(self) -> JobState:
        """Its state, final only once the job is (``final`` says the same): a hop
        that ended while the job goes on (to its next hop, to the end of the
        tail of a satisfied job, or to its record) is shown as ``running``."""
        record, job = self.record, self.job
        if job is None or self.finished:
            return record.state or JobState.QUEUED
        state = job.state.state
        if state.final:
            return JobState.RUNNING
        if state is JobState.RUNNING and self.paced:
            return JobState.PACED
        return state

    def _status(self) -> JobStatus:
        spec, record = self.record.spec, self.record
        known: dict[str, Any] = {}
        job = self.job
        state = self.state
        if job is not None:
            outcomes = self.earlier_outcomes + job.outcomes
            eta_s = job.eta_s(job.rollouts_per_hour())
            known.update(job.progress(), outcomes=dict(outcomes), eta_s=eta_s)
            if job.order is not None:
                known["start_order"] = job.order.figures()
        elif not self.finished:  # not started: as its first hop shows before it opens
            known.update(remaining=0, eta_s=0.0)
        elif record.outcomes is not None:
            known["outcomes"] = record.outcomes
        if self.groups is not None:
            known["groups_complete"] = len(self.groups.index)
        if self.step.target is not None or spec.group_filter is not None:
            known.update(self._step_figures())
        if self.step.satisfied:
            # What is left of its tasks will not run.
            known["eta_s"] = None
        return JobStatus(
            job_id=self.job_id,
            state=state,
            final=self.finished,
            priority=spec.priority,
            policy_version=spec.policy_version,
            rows_durable=len(self.output_index),
            output=str(self.output),
            submitted_at=record.submitted_at,
            error=record.error,
            metadata=spec.metadata,
            **known,
        )

    def _step_figures(self) -> dict[str, Any]:
        """The step's figures: live, or as the record kept them (a settled job)."""
        if self.groups is None and self.record.step is not None:
            return dict(self.record.step)
        return self.step.figures()

    async def source(self) -> Source:
        """Where the job's results are: its live indexes (it is final only once it
        is a ``FinalJob``, read from its files)."""
        assert self.groups is not None
        return Source(
            self.output, self.output_index, self.groups_path, self.groups.index, self._end,
            self.groups.completed_at.get, self._end_error, self._satisfied_seq,
            failures_path=OutputPaths.for_output(self.output).failures,
            failures=self.failures_index, attempt_cap=self.settings.attempt_cap,
        )  # fmt: skip

    def _satisfied_seq(self) -> int | None:
        if self.step.satisfied_seq is None and self.record.step is not None:
            seq = self.record.step.get("satisfied_seq")
            return seq if isinstance(seq, int) else None
        return self.step.satisfied_seq

    def _end(self) -> str | None:
        state = self.record.state
        return state.value if self.finished and state is not None else None

    def _end_error(self) -> str | None:
        return self.record.error if self.finished else None
