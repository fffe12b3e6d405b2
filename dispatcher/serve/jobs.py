"""The jobs of ``dispatcher serve``: submitted, run on the daemon, cancelled, resumed.

``Service`` owns the jobs of one state directory. Each accepted job is a
``ServedJob``: its record (``registry.py``), a ``Job`` (``job.py``: the same
files, resume contract and exit rules as ``dispatcher run``) driven in a task
of its own, and its ``Groups``. Jobs share the daemon's pool: a free slot goes
to the job of highest priority, then to the earliest submitted (the pool's
rank), so a job waits at most for the same-priority jobs submitted before it.
A job whose ``policy_version`` p is more than K steps ahead of the trainer's
version V starts nothing until V ≥ p − K; nothing in flight is ever cancelled
for staleness (contracts §12).

A job with ``target_groups`` has a ``StepControl`` (``step.py``): its gate
starts a new group only while there is room under the overprovision bound,
and once the target is reached the job starts nothing more (``finish``: what
is in flight runs to its end; ``cancel``: it is cancelled) and ends
``satisfied``. The admission pause (contracts §13) is the pool's, daemon-wide;
the service ends it when the trainer sets a policy version.

A finished job keeps only its final status in memory: a daemon that lives
for days and runs thousands of jobs stays the same size.

Failure policy of a job's task: whatever it raises (a file it cannot write,
a bug) makes the job ``failed`` with a one-line reason, final, and ends its
streams with ``{"end": "failed", "error": ...}``; the daemon and the other
jobs go on. A failed job is not settled: the same ``dispatcher serve``
command resumes it from its files, exactly (the disk full, say, once space
is back). A job whose record cannot be read is a ``BrokenJob``: listed as
failed with the reason, never run.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from dispatcher.aio import cancel_and_wait
from dispatcher.errors import ConfigError, DispatcherError, ExitCode, OutputWriteError
from dispatcher.files.contracts import JobStatus
from dispatcher.files.resume import RunState
from dispatcher.files.writer import LineIndex
from dispatcher.lifecycle import JobState
from dispatcher.run.daemon import Daemon, peak_rss_mb
from dispatcher.run.job import Job
from dispatcher.serve.faults import StateDirHealth, is_disk_fault, log_crash, one_line
from dispatcher.serve.groups import Groups
from dispatcher.serve.metrics import declare_service_metrics
from dispatcher.serve.registry import SETTLED_STATES, JobRecord, Registry, Unreadable, now_iso
from dispatcher.serve.results import Source
from dispatcher.serve.spec import BadJob, JobSpec, check_tasks, write_rows
from dispatcher.serve.step import StepControl, teaches_nothing
from dispatcher.settings.config import RunSettings
from dispatcher.tasks.materialize import Rollout

log = structlog.get_logger("dispatcher.serve")

DELAY_WINDOW = 10_000
# Between hops of a job that made no progress (its agent down, say): 1 s, 2 s ... 60 s.
HOP_PAUSE_BASE_S = 1.0
HOP_PAUSE_CAP_S = 60.0


class Conflict(Exception):
    """A submission that contradicts an existing job: a 409 with this message."""


class ServedJob:
    """One job of the service: its record, its ``Job`` while it runs, its groups."""

    def __init__(self, service: Service, record: JobRecord) -> None:
        self.service = service
        self.record = record
        folder = service.registry.job_dir(record.job_id)
        spec = record.spec
        self.output = folder / "rollouts.jsonl"
        self.groups_path = folder / "groups.jsonl"
        tasks = folder / "rows.jsonl" if spec.rows is not None else Path(str(spec.input))
        self.settings = spec.settings(service.base, tasks, self.output)
        self.paced = False
        self.finished = False
        self.final_status: dict[str, Any] | None = None
        self.task: asyncio.Task[None] | None = None
        self.step = StepControl(spec.target_groups, spec.overprovision, spec.on_target)
        self.step.when_satisfied(self._satisfied)
        self.groups: Groups | None = Groups(
            self.groups_path,
            on_error=self._groups_failed,
            group_filter=teaches_nothing if spec.group_filter is not None else None,
            on_group=self.step.on_group,
        )
        self.output_index = LineIndex()
        # Outcomes of the job's earlier hops (and, after a restart, of its files):
        # its status counts every pass, not only the hop running now.
        self.earlier_outcomes: Counter[str] = Counter()
        self.job: Job | None = self._new_job()
        self._cancelled = asyncio.Event()

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
            gate=self._gate,
        )

    @property
    def job_id(self) -> str:
        return self.record.job_id

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"job:{self.job_id}")

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
            state, error = await self._hop(job, first=hop == 0)
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
        log.info("job_satisfied", job_id=self.job_id, target_groups=step.target,
                 groups_filtered=step.filtered, on_target=step.on_target)  # fmt: skip
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
        self.job = self._new_job()
        return self.job

    async def _hop(self, job: Job, *, first: bool) -> tuple[JobState, str | None]:
        """Open, dispatch and close one hop; its final state and error."""
        try:
            await job.open()
        except DispatcherError as exc:
            self.service.disk_fault(exc)
            return JobState.FAILED, str(exc)
        prepared = job.prepared
        assert prepared is not None and self.groups is not None
        structlog.contextvars.bind_contextvars(run_id=prepared.record.run_id)
        try:
            if first:
                self.earlier_outcomes.update(file_outcomes(prepared.state))
                missing = await asyncio.to_thread(
                    self.groups.load,
                    prepared.paths.materialized,
                    prepared.paths.output,
                    prepared.state,
                )
                self.step.reopen(self.groups.reopened)
                await self.groups.open(missing)
            log.info("job_started", job_id=self.job_id, **job.started_event())
            await job.dispatch()
        except Exception as exc:
            log_crash("job_hop_crashed", exc, job_id=self.job_id)
            job.fail(DispatcherError(f"job {self.job_id} failed: {one_line(exc)}"))
        finally:
            await job.close()
            # Its files are closed: the daemon's figures (remaining, the
            # budget's end) are the running jobs'. A run's one job stays, so
            # its last scrape shows what it left.
            job.daemon.jobs.discard(job)
        error = job.fatal or job.daemon.fatal
        if job.fatal is not None:
            self.service.disk_fault(job.fatal)
        return job.state.state, str(error) if error else None

    def _groups_failed(self, exc: OSError) -> None:
        """``groups.jsonl`` could not be written: the job stops, naming it."""
        error = OutputWriteError(f"{self.groups_path}: write failed: {exc.strerror or exc}")
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
        for task in pending:
            await cancel_and_wait(task)
        return bool(done & stops)

    async def _settle(self, state: JobState, error: str | None) -> None:
        """Record the final state, keep only the final status, wake the streams.

        A record that cannot be saved fails the job (its file still says it is
        unfinished, so a restart resumes it), and the streams end all the same."""
        if state is JobState.FAILED and error is None:
            error = "failed without a recorded reason"
        self.record.state, self.record.error = state, error
        if self.job is not None:
            self.record.outcomes = dict(self.earlier_outcomes + self.job.outcomes)
        if self.step.target is not None:
            self.record.step = self.step.figures()
        try:
            await self.service.write(self.service.registry.save, self.record)
        except OSError as exc:
            log_crash("job_record_not_saved", exc, job_id=self.job_id)
            reason = f"job.json not saved: {one_line(exc)}"
            error = reason if state is not JobState.FAILED else f"{error}; {reason}"
            state = JobState.FAILED
            self.record.state, self.record.error = state, error
        self.finished = True
        try:
            self.final_status = self.status()
        finally:
            log.info("job_finished", job_id=self.job_id, state=state.value, error=error)
            self.output_index.grew.fire()
            if self.groups is not None:
                self.groups.index.grew.fire()
            self.job = None
            self.groups = None

    async def _gate(self, rollout: Rollout) -> bool | None:
        """Before each rollout starts: pacing, then step control (``Job``'s gate)."""
        await self._pace()
        while True:
            start = self.step.admits(rollout.task_index)
            job = self.job
            if start is not False or job is None or job.idle.is_set():
                # With nothing in flight no room can come in this hop: a next
                # hop runs what the open groups still need first.
                return start
            await self._room_or_idle(job)

    async def _room_or_idle(self, job: Job) -> None:
        """Until a group completes (a filtered one frees room) or nothing is in flight."""
        waits = {
            asyncio.create_task(self.step.changed.wait(HOP_PAUSE_CAP_S)),
            asyncio.create_task(job.idle.wait()),
        }
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                await cancel_and_wait(task)

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
        if self.final_status is not None:
            return self.final_status
        return self._status().to_json()

    def _status(self) -> JobStatus:
        spec, record = self.record.spec, self.record
        known: dict[str, Any] = {}
        job = self.job
        state = record.state or JobState.QUEUED
        if job is not None and not self.finished:
            state = job.state.state
            if state is JobState.RUNNING and self.paced:
                state = JobState.PACED
            if self.step.satisfied:
                state = JobState.SATISFIED
        if job is not None:
            outcomes = self.earlier_outcomes + job.outcomes
            known.update(job.progress(), outcomes=dict(outcomes), eta_s=job.eta_s(self._rate(job)))
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

    @staticmethod
    def _rate(job: Job) -> float:
        elapsed_s = job.daemon.dispatch_seconds()
        done = sum(job.outcomes.values())
        return done / elapsed_s * 3600.0 if elapsed_s > 0 else 0.0

    async def source(self) -> Source:
        """Where the job's results are: its live indexes, or its files once finished."""
        job, groups = self.job, self.groups
        if job is not None and groups is not None and job.output_index is not None:
            return Source(
                self.output,
                job.output_index,
                self.groups_path,
                groups.index,
                self._end,
                groups.completed_at.get,
                self._end_error,
                self._satisfied_seq,
            )
        rows = await asyncio.to_thread(LineIndex.scan, self.output)
        group_index = await asyncio.to_thread(LineIndex.scan, self.groups_path)
        return Source(
            self.output, rows, self.groups_path, group_index, self._end, _unknown,
            self._end_error, self._satisfied_seq,
        )  # fmt: skip

    def _satisfied_seq(self) -> int | None:
        if self.step.satisfied_seq is None and self.record.step is not None:
            seq = self.record.step.get("satisfied_seq")
            return seq if isinstance(seq, int) else None
        return self.step.satisfied_seq

    def _end(self) -> str | None:
        return self.record.state if self.finished else None

    def _end_error(self) -> str | None:
        return self.record.error if self.finished else None


def _unknown(task: int) -> float | None:
    return None


class BrokenJob:
    """A job whose record cannot be read: failed with the reason, never run.

    Its id stays taken while its folder is there (a submit of it is a 409
    naming the folder); once the operator moves the folder aside, the id can
    be submitted again."""

    def __init__(self, broken: Unreadable) -> None:
        self.broken = broken
        self.folder = broken.folder
        self.output = broken.folder / "rollouts.jsonl"
        self.groups_path = broken.folder / "groups.jsonl"
        self.task: asyncio.Task[None] | None = None

    @property
    def job_id(self) -> str:
        return self.broken.job_id

    def status(self) -> dict[str, Any]:
        return JobStatus(
            job_id=self.job_id,
            state=JobState.FAILED,
            final=True,
            output=str(self.output),
            error=self.broken.reason,
        ).to_json()

    def cancel(self) -> None:
        """Nothing of it runs."""

    async def source(self) -> Source:
        rows = await asyncio.to_thread(LineIndex.scan, self.output)
        group_index = await asyncio.to_thread(LineIndex.scan, self.groups_path)
        return Source(
            self.output, rows, self.groups_path, group_index,
            lambda: JobState.FAILED.value, _unknown, lambda: self.broken.reason,
        )  # fmt: skip


def file_outcomes(state: RunState) -> Counter[str]:
    """A job's outcomes as its files tell them: successes and failed attempts by class."""
    outcomes = Counter(state.failure_classes)
    if state.successes:
        outcomes["success"] = len(state.successes)
    return outcomes


class Service:
    """Owns the jobs of one state directory on one daemon."""

    def __init__(
        self,
        daemon: Daemon,
        base: RunSettings,
        registry: Registry,
        max_off_policy_steps: int | None,
        input_root: Path,
    ) -> None:
        self.daemon = daemon
        self.base = base
        self.registry = registry
        self.max_off_policy_steps = max_off_policy_steps
        self.input_root = input_root
        self.jobs: dict[str, ServedJob | BrokenJob] = {}
        self.health = StateDirHealth(registry)
        # False until the registry is read (the API answers 503 until then).
        self.resumed = False
        self._next_seq = 1
        # Seconds from a row (or a group's last row) being durable to its
        # delivery on a results stream: the last ones, for /status.
        self.delays: deque[float] = deque(maxlen=DELAY_WINDOW)
        self._delay_histogram = declare_service_metrics(
            daemon.metrics.registry, self.job_counts, daemon.policy_version, daemon.pause
        )
        # One submission at a time: two racing bodies for one job_id must
        # not both create it.
        self._submitting = asyncio.Lock()
        # One policy update at a time: the versions are saved in the order set.
        self._setting_policy = asyncio.Lock()

    async def resume(self) -> None:
        """Load the registry; start every job that is not settled (done, cancelled or
        satisfied)."""
        for record in await asyncio.to_thread(self.registry.all):
            if isinstance(record, Unreadable):
                self.jobs[record.job_id] = BrokenJob(record)
                log.error("job_unreadable", job_id=record.job_id, error=record.reason)
                continue
            self._next_seq = max(self._next_seq, record.submitted_seq + 1)
            served = ServedJob(self, record)
            self.jobs[record.job_id] = served
            if record.state in SETTLED_STATES:
                served.finished = True
                served.job = served.groups = None
                served.final_status = served.status()
                continue
            record.state = record.error = record.outcomes = None
            served.start()
            log.info("job_resumed", job_id=record.job_id)
        self.resumed = True

    async def submit(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """Accept a job: (201, status) new, (200, status) the same again; raises
        ``BadJob`` (400) or ``Conflict`` (409)."""
        spec = JobSpec.parse(body, self.base.agents).rooted(self.input_root, self.registry.root)
        async with self._submitting:
            existing = self.jobs.get(spec.job_id) if spec.job_id is not None else None
            if isinstance(existing, BrokenJob):
                existing = self._still_broken(existing)
            if isinstance(existing, ServedJob):
                if existing.record.digest != spec.digest():
                    raise Conflict(f"job_id: {spec.job_id!r} exists with a different body")
                return 200, existing.status()
            spec = spec.with_id()
            assert spec.job_id is not None
            await self.write(check_tasks, spec, self._settings_for(spec), self.registry.scratch)
            record = JobRecord(spec, spec.digest(), self._next_seq, now_iso())
            await self.write(self._create, record)
            self._next_seq += 1
            served = ServedJob(self, record)
            self.jobs[spec.job_id] = served
            served.start()
        log.info("job_submitted", job_id=spec.job_id, priority=spec.priority,
                 policy_version=spec.policy_version)  # fmt: skip
        return 201, served.status()

    def _still_broken(self, broken: BrokenJob) -> BrokenJob | None:
        """A broken job's id is a 409 while its folder is there; gone, it is free."""
        if broken.folder.exists():
            raise Conflict(
                f"job_id: {broken.job_id!r} is a failed job whose record cannot be read "
                f"({broken.broken.reason}); move {broken.folder} aside to submit it again"
            )
        del self.jobs[broken.job_id]
        return None

    async def write(self, write: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking write to the state directory in a thread, and keep its
        health: a write that fails faults it (``/healthz``), one that works clears it."""
        try:
            result = await asyncio.to_thread(write, *args)
        except OSError as exc:
            self.disk_fault(exc)
            raise
        self.health.wrote()
        return result

    def disk_fault(self, exc: BaseException) -> None:
        """Note ``exc`` against the state directory when it is a write the disk refused."""
        if is_disk_fault(exc):
            self.health.failed(one_line(exc) if isinstance(exc, OSError) else str(exc))

    def _settings_for(self, spec: JobSpec) -> Callable[[Path], RunSettings]:
        """The job's settings for a task file, with its output in the scratch folder."""
        return lambda tasks: spec.settings(self.base, tasks, self.registry.scratch / "x.jsonl")

    def _create(self, record: JobRecord) -> None:
        """The job's folder, record and rows (blocking); a folder already there is a 409."""
        try:
            folder = self.registry.create(record)
        except ConfigError as exc:
            raise Conflict(str(exc)) from None
        if record.spec.rows is not None:
            write_rows(record.spec.rows, folder / "rows.jsonl")

    def cancel(self, job_id: str) -> dict[str, Any] | None:
        served = self.jobs.get(job_id)
        if served is None:
            return None
        served.cancel()
        log.info("job_cancel_requested", job_id=job_id)
        return served.status()

    def delivered(self, born: list[float | None], group: bool) -> None:
        """A stream wrote lines that became durable at ``born``: record their delay."""
        now = time.monotonic()
        for durable_at in born:
            if durable_at is not None:
                self.delays.append(now - durable_at)
                self._delay_histogram.labels("groups" if group else "rows").observe(
                    now - durable_at
                )

    def delay_quantiles(self) -> dict[str, float | None]:
        ordered = sorted(self.delays)
        if not ordered:
            return {"p50": None, "p99": None, "max": None}
        last = len(ordered) - 1
        return {
            "p50": ordered[min(last, int(0.5 * len(ordered)))],
            "p99": ordered[min(last, int(0.99 * len(ordered)))],
            "max": ordered[-1],
        }

    # ---- the admission pause (contracts §13) ------------------------------------------

    def admission(self) -> dict[str, Any]:
        """The pause and what is in flight: the answer of ``/v1/admission``."""
        pause = self.daemon.pause
        remaining_s = pause.remaining_s()
        in_flight = self.daemon.at_agents()
        return {
            "paused": pause.paused,
            "reason": pause.reason,
            "ttl_remaining_s": round(remaining_s, 3) if remaining_s is not None else None,
            "in_flight": in_flight,
            "idle": in_flight == 0,
            # Jobs whose next rollout waits for the pause to end.
            "held": pause.waiting,
        }

    async def wait_idle(self, timeout_s: float) -> None:
        """Until no rollout is at an agent, or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while self.daemon.at_agents() and (left_s := deadline - time.monotonic()) > 0:
            await self.daemon.left_agent.wait(left_s)

    async def set_policy(self, version: int) -> None:
        """Save the version, then move to it: a version counts (releases a paced
        job) only once it is durable, so a restart never goes back on it."""
        policy = self.daemon.policy
        assert policy is not None
        async with self._setting_policy:
            await self.write(self.registry.save_policy, version)
            policy.set(version)
        log.info("policy_version_set", version=version)
        # The weight update is over: a pause around it ends here.
        self.daemon.pause.resume("policy_version")

    async def close(self) -> None:
        """Wait for every job to stop (the daemon's stop request stops them)."""
        tasks = [j.task for j in self.jobs.values() if j.task is not None and not j.task.done()]
        if tasks:
            await asyncio.wait(tasks)

    def exit_code(self) -> ExitCode:
        if self.daemon.fatal is not None:
            raise self.daemon.fatal
        unsettled = [
            j
            for j in self.jobs.values()
            if isinstance(j, BrokenJob) or j.record.state not in SETTLED_STATES
        ]
        return ExitCode.RESUMABLE if unsettled else ExitCode.DONE

    # ---- the daemon's view -------------------------------------------------------------

    def job_counts(self) -> dict[str, int]:
        return dict(Counter(str(j.status()["state"]) for j in self.jobs.values()))

    def status(self) -> dict[str, Any]:
        daemon = self.daemon
        running = [j.job for j in self.jobs.values() if isinstance(j, ServedJob) and j.job]
        progress = Counter[str]()
        for job in running:
            progress.update({k: v or 0 for k, v in job.progress().items()})
        outcomes = Counter[str]()
        for job in running:
            outcomes.update(job.outcomes)
        return {
            "state": str(daemon.phase.state),
            "elapsed_s": round(daemon.elapsed_s(), 3),
            "policy_version": daemon.policy_version(),
            "max_off_policy_steps": self.max_off_policy_steps,
            "jobs": self.job_counts(),
            "progress": dict(progress),
            "outcomes": dict(outcomes),
            "rollouts_per_hour": daemon.metrics.rollouts_per_hour(),
            "latency_s": daemon.latency_quantiles(),
            "drain_margin_s": daemon.drain_margin(),
            "budget_remaining_s": daemon.budget.remaining_s(),
            "in_flight_by_agent": daemon.in_flight_by_agent(),
            "committing": daemon.commit_queue.committing,
            # Jobs whose next rollout waits for a slot of the shared pool.
            "slot_waiters": daemon.slot_waiters(),
            **daemon.delivery_figures(),
            "metrics_url": daemon.metrics_endpoint.url if daemon.metrics_endpoint else None,
            "results_delay_s": self.delay_quantiles(),
            "event_loop_lag_p99_s": daemon.lag.p99_s(),
            "event_loop_lag_max_s": daemon.lag.max_s(),
            "peak_rss_mb": peak_rss_mb(),
        }


__all__ = ["BadJob", "BrokenJob", "Conflict", "ServedJob", "Service"]
