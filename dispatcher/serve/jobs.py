"""The jobs of ``dispatcher serve``: submitted, run on the daemon, cancelled, resumed.

``Service`` owns the jobs of one state directory. Each accepted job is a
``ServedJob``: its record (``registry.py``), a ``Job`` (``job.py``: the same
files, resume contract and exit rules as ``dispatcher run``) driven in a task
of its own, and its ``Groups``. Jobs share the daemon's pool: a free slot goes
to the job of highest priority, then to the earliest submitted (the pool's
rank), so a job waits at most for the same-priority jobs submitted before it.
A job whose ``policy_version`` p is more than K steps ahead of the trainer's
version V starts nothing until V ≥ p − K; nothing in flight is ever cancelled
for staleness (DESIGN A12).

A finished job keeps only its final status in memory: a daemon that lives
for days and runs thousands of jobs stays the same size.
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
from dispatcher.errors import ConfigError, DispatcherError, ExitCode
from dispatcher.files.contracts import JobStatus
from dispatcher.files.writer import LineIndex
from dispatcher.lifecycle import JobState
from dispatcher.run.daemon import Daemon, peak_rss_mb
from dispatcher.run.job import Job
from dispatcher.serve.groups import Groups
from dispatcher.serve.metrics import declare_service_metrics
from dispatcher.serve.registry import SETTLED_STATES, JobRecord, Registry, now_iso
from dispatcher.serve.results import Source
from dispatcher.serve.spec import BadJob, JobSpec, check_tasks, write_rows
from dispatcher.settings.config import RunSettings

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
        self.groups: Groups | None = Groups(self.groups_path)
        self.output_index = LineIndex()
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
        """Hops until the job is final: failed attempts with attempts left (and
        rollouts of an agent that was down) run again in a next hop, as
        ``dispatcher run``'s job script would rerun it, after a pause when a
        hop made no progress."""
        structlog.contextvars.bind_contextvars(job_id=self.job_id)
        hop = idle_hops = 0
        while True:
            job = self.job if hop == 0 and self.job is not None else self._new_job()
            self.job = job
            state, error = await self._hop(job, first=hop == 0)
            if state is not JobState.INCOMPLETE or self._stopping():
                break
            idle_hops = 0 if job.final_this_run else idle_hops + 1
            pause_s = min(HOP_PAUSE_CAP_S, HOP_PAUSE_BASE_S * 2 ** (idle_hops - 1))
            if idle_hops and await self._paused(pause_s):
                break
            hop += 1
        if self._cancelled.is_set() and state is JobState.INCOMPLETE:
            state = JobState.CANCELLED
        assert self.groups is not None
        await self.groups.close()
        await self._settle(state, error)

    async def _hop(self, job: Job, *, first: bool) -> tuple[JobState, str | None]:
        """Open, dispatch and close one hop; its final state and error."""
        try:
            await job.open()
        except DispatcherError as exc:
            return JobState.FAILED, str(exc)
        prepared = job.prepared
        assert prepared is not None and self.groups is not None
        structlog.contextvars.bind_contextvars(run_id=prepared.record.run_id)
        try:
            if first:
                missing = await asyncio.to_thread(
                    self.groups.load,
                    prepared.paths.materialized,
                    prepared.paths.output,
                    prepared.state,
                )
                await self.groups.open(missing)
            log.info("job_started", job_id=self.job_id, **job.started_event())
            await job.dispatch()
        except Exception as exc:
            job.fail(DispatcherError(f"job {self.job_id} failed: {exc!r}"))
        finally:
            await job.close()
            # Its files are closed: the daemon's figures (remaining, the
            # budget's end) are the running jobs'. A run's one job stays, so
            # its last scrape shows what it left.
            job.daemon.jobs.discard(job)
        error = job.fatal or job.daemon.fatal
        return job.state.state, str(error) if error else None

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
        """Record the final state, keep only the final status, wake the streams."""
        self.record.state, self.record.error = state.value, error
        await asyncio.to_thread(self.service.registry.save, self.record)
        self.finished = True
        self.final_status = self.status()
        log.info("job_finished", job_id=self.job_id, state=state.value, error=error)
        self.output_index.grew.fire()
        if self.groups is not None:
            self.groups.index.grew.fire()
        self.job = None
        self.groups = None

    async def _gate(self) -> None:
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
        state = JobState(record.state) if record.state else JobState.QUEUED
        if job is not None and not self.finished:
            state = job.state.state
            if state is JobState.RUNNING and self.paced:
                state = JobState.PACED
        if job is not None:
            known.update(
                job.progress(), outcomes=dict(job.outcomes), eta_s=job.eta_s(self._rate(job))
            )
        if self.groups is not None:
            known["groups_complete"] = len(self.groups.index)
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
            )
        rows = await asyncio.to_thread(LineIndex.scan, self.output)
        group_index = await asyncio.to_thread(LineIndex.scan, self.groups_path)
        return Source(self.output, rows, self.groups_path, group_index, self._end, _unknown)

    def _end(self) -> str | None:
        if not self.finished or self.final_status is None:
            return None
        return str(self.final_status["state"])


def _unknown(task: int) -> float | None:
    return None


class Service:
    """Owns the jobs of one state directory on one daemon."""

    def __init__(
        self,
        daemon: Daemon,
        base: RunSettings,
        registry: Registry,
        max_off_policy_steps: int | None,
    ) -> None:
        self.daemon = daemon
        self.base = base
        self.registry = registry
        self.max_off_policy_steps = max_off_policy_steps
        self.jobs: dict[str, ServedJob] = {}
        # False until the registry is read (the API answers 503 until then).
        self.resumed = False
        self._next_seq = 1
        # Seconds from a row (or a group's last row) being durable to its
        # delivery on a results stream: the last ones, for /status.
        self.delays: deque[float] = deque(maxlen=DELAY_WINDOW)
        self._delay_histogram = declare_service_metrics(
            daemon.metrics.registry, self.job_counts, daemon.policy_version
        )
        # One submission at a time: two racing bodies for one job_id must
        # not both create it.
        self._submitting = asyncio.Lock()

    async def resume(self) -> None:
        """Load the registry; start every job that is not settled (done or cancelled)."""
        for record in await asyncio.to_thread(self.registry.all):
            self._next_seq = max(self._next_seq, record.submitted_seq + 1)
            served = ServedJob(self, record)
            self.jobs[record.job_id] = served
            if record.state in SETTLED_STATES:
                served.finished = True
                served.job = served.groups = None
                served.final_status = served.status()
                continue
            record.state = record.error = None
            served.start()
            log.info("job_resumed", job_id=record.job_id)
        self.resumed = True

    async def submit(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """Accept a job: (201, status) new, (200, status) the same again; raises
        ``BadJob`` (400) or ``Conflict`` (409)."""
        spec = JobSpec.parse(body, self.base.agents)
        async with self._submitting:
            existing = self.jobs.get(spec.job_id) if spec.job_id is not None else None
            if existing is not None:
                if existing.record.digest != spec.digest():
                    raise Conflict(f"job_id: {spec.job_id!r} exists with a different body")
                return 200, existing.status()
            spec = spec.with_id()
            assert spec.job_id is not None
            await asyncio.to_thread(
                check_tasks, spec, self._settings_for(spec), self.registry.scratch
            )
            record = JobRecord(spec, spec.digest(), self._next_seq, now_iso())
            await asyncio.to_thread(self._create, record)
            self._next_seq += 1
            served = ServedJob(self, record)
            self.jobs[spec.job_id] = served
            served.start()
        log.info("job_submitted", job_id=spec.job_id, priority=spec.priority,
                 policy_version=spec.policy_version)  # fmt: skip
        return 201, served.status()

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

    async def set_policy(self, version: int) -> None:
        policy = self.daemon.policy
        assert policy is not None
        policy.set(version)
        await asyncio.to_thread(self.registry.save_policy, version)
        log.info("policy_version_set", version=version)

    async def close(self) -> None:
        """Wait for every job to stop (the daemon's stop request stops them)."""
        tasks = [j.task for j in self.jobs.values() if j.task is not None and not j.task.done()]
        if tasks:
            await asyncio.wait(tasks)

    def exit_code(self) -> ExitCode:
        if self.daemon.fatal is not None:
            raise self.daemon.fatal
        unsettled = [j for j in self.jobs.values() if j.record.state not in SETTLED_STATES]
        return ExitCode.RESUMABLE if unsettled else ExitCode.DONE

    # ---- the daemon's view -------------------------------------------------------------

    def job_counts(self) -> dict[str, int]:
        return dict(Counter(str(j.status()["state"]) for j in self.jobs.values()))

    def status(self) -> dict[str, Any]:
        daemon = self.daemon
        running = [j.job for j in self.jobs.values() if j.job is not None]
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


__all__ = ["BadJob", "Conflict", "ServedJob", "Service"]
