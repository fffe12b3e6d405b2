"""The jobs of ``dispatcher serve``: submitted, run on the daemon, cancelled, resumed.

``Service`` owns the jobs of one state directory: a ``ServedJob``
(``served.py``) for each job that runs, a ``FinalJob`` (``final.py``) for
each that is final, a ``BrokenJob`` for a record that cannot be read. A job
that ends is handed back here and kept as a ``FinalJob``: a daemon that
lives for days and runs thousands of jobs stays the same size, and after a
restart the settled jobs cost nothing until asked about.

A submission is checked whole (``spec.py``: its body, its rows as ``run``
checks them, its size against the daemon's bounds) before anything of it is
written; its rows then live in the job's own file, never in memory. The
same body again is the same job: the digest of the body is compared, not
its rows. The admission pause (contracts §13) is the pool's, daemon-wide;
the service ends it when the trainer sets a policy version.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from dispatcher.admission.history import HISTORY_FILE, TaskHistory
from dispatcher.admission.pause import MAX_TTL_S
from dispatcher.aio import DEFAULT_EXECUTOR_THREADS, start_threads
from dispatcher.errors import ExitCode
from dispatcher.heap import HeapTrimmer
from dispatcher.run.aggregate import WithoutRoute
from dispatcher.run.daemon import Daemon
from dispatcher.run.job import Job
from dispatcher.run.job_figures import HopEnd
from dispatcher.serve.archive import Archive, ArchivedJob, Compaction
from dispatcher.serve.bodies import BodyBudget
from dispatcher.serve.faults import StateDirHealth, is_disk_fault, one_line
from dispatcher.serve.final import BrokenJob, FinalJob
from dispatcher.serve.journal import Journal
from dispatcher.serve.metrics import (
    StepTotals,
    declare_service_metrics,
    service_status,
    submit_durations,
)
from dispatcher.serve.registry import (
    SETTLED_STATES,
    JobRecord,
    Registry,
    Unreadable,
    in_submission_order,
)
from dispatcher.serve.sending import Slots
from dispatcher.serve.served import ServedJob
from dispatcher.serve.spec import BadJob
from dispatcher.serve.submission import AnyJob, Conflict, FoundJob, Submissions
from dispatcher.settings.config import RunSettings
from dispatcher.settings.serve import ServeLimits

log = structlog.get_logger("dispatcher.serve")


class Service(Submissions):
    """Owns the jobs of one state directory on one daemon."""

    def __init__(
        self,
        daemon: Daemon,
        base: RunSettings,
        registry: Registry,
        max_off_policy_steps: int | None,
        input_root: Path,
        limits: ServeLimits,
    ) -> None:
        self.daemon = daemon
        self.base = base
        self.registry = registry
        self.max_off_policy_steps = max_off_policy_steps
        self.input_root = input_root
        self.limits = limits
        # Results streams open now, against --max-streams.
        self.streams = Slots(limits.max_streams)
        # Bytes of request bodies in hand, against --max-body-bytes-in-flight.
        self.bodies = BodyBudget(limits.max_body_bytes_in_flight)
        self.jobs: dict[str, AnyJob] = {}
        self.heap = HeapTrimmer()
        self.health = StateDirHealth(registry)
        # False until the registry is read (the API answers 503 until then).
        self.resumed = False
        # Settled jobs folded into archives (archive.py); set as the registry is read.
        self.compaction: Compaction | None = None
        self._next_seq = 1
        # Seconds from a row (or a group's last row) being durable to its
        # delivery on a results stream.
        self.delays = declare_service_metrics(
            daemon.metrics.registry,
            self.job_counts,
            daemon.policy_version,
            daemon.pause,
            self.step_totals,
        )
        self.submit_times = submit_durations(daemon.metrics.registry)
        self.journal = Journal(registry)
        self._init_one_at_a_time()
        self.history: TaskHistory | None = None
        # Its jobs' hop ends: files made durable with their final record
        # (``Registry.save_final``), one HTTP session (opened in ``resume``).
        self.hop_end = HopEnd(durable=False)

    def _init_one_at_a_time(self) -> None:
        """The one-thread pools and locks: bodies, index reads, ids, policy one at a time."""
        # Bodies are parsed, checked and written in one thread: the memory of a
        # body's objects is reused by the next, not kept in an allocator arena
        # per worker thread.
        self._bodies_thread = ThreadPoolExecutor(1, thread_name_prefix="serve-bodies")
        self._index_thread = ThreadPoolExecutor(1, thread_name_prefix="serve-index")
        # Ids and submission orders are taken one body at a time: two racing bodies
        # for one job_id must not both create it.
        self._submitting = asyncio.Lock()
        # Jobs being committed, by id: a body of the same id waits for the commit.
        self._accepting: dict[str, asyncio.Future[None]] = {}
        # One policy update at a time: the versions are saved in the order set.
        self._setting_policy = asyncio.Lock()
        # The same for the admission pause's file.
        self._setting_admission = asyncio.Lock()

    async def resume(self) -> None:
        """Load the registry; start every job that is not settled (done, cancelled or
        satisfied). A fold a kill cut is undone first (archive.py)."""
        self.hop_end = HopEnd(
            durable=False, session=aiohttp.ClientSession(), without=WithoutRoute()
        )
        archive = await asyncio.to_thread(self._open_archive)
        self.compaction = Compaction(archive, self.limits.retain_settled_jobs, self.jobs,
                                     self.write)  # fmt: skip
        self.compaction.archived = await asyncio.to_thread(archive.count)
        self.compaction.load_ids()
        # Before the registry is read: a job a kill cut after its commit is made whole.
        await asyncio.to_thread(self.journal.replay, archive.has)
        self._next_seq = await asyncio.to_thread(archive.last_seq) + 1
        if self.base.start_order == "longest":
            # One task history for every job, kept in the state directory (contracts §13).
            path = self.registry.root / HISTORY_FILE
            self.history = await asyncio.to_thread(
                TaskHistory.load, path, self.base.task_history_max_tasks
            )
        for record in await asyncio.to_thread(self._read_registry):
            if isinstance(record, Unreadable):
                self.jobs[record.job_id] = BrokenJob(record)
                log.error("job_unreadable", job_id=record.job_id, error=record.reason)
                continue
            self._next_seq = max(self._next_seq, record.submitted_seq + 1)
            if isinstance(record, FinalJob):
                # Its status and rows are read from its files when asked for.
                self.jobs[record.job_id] = record
                if record.state in SETTLED_STATES:
                    self.compaction.settled(record)
                continue
            record.state = record.error = record.outcomes = record.final_status = None
            served = ServedJob(self, record)
            self.jobs[record.job_id] = served
            served.start()
            log.info("job_resumed", job_id=record.job_id)
        self.resumed = True

    def _open_archive(self) -> Archive:
        archive = Archive(self.registry)
        archive.recover()
        return archive

    async def find(self, job_id: str) -> FoundJob | None:
        """A job by id: one the service holds, else one in an archive, else None."""
        job = self.jobs.get(job_id)
        if job is not None or self.compaction is None:
            return job
        # A thread of its own: lookups never queue behind the jobs' file work.
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._index_thread, self.compaction.archive.find, job_id)

    def _read_registry(self) -> list[JobRecord | FinalJob | Unreadable]:
        """The registry's jobs (blocking), each settled one kept as a ``FinalJob`` as
        soon as it is read: a restart holds one settled record at a time, however
        big their bodies (a job's ``responses_create_params`` may be megabytes)."""
        settled = (
            FinalJob.of(record, self.registry)
            if isinstance(record, JobRecord) and record.state in SETTLED_STATES
            else record
            for record in self.registry.each()
        )
        return in_submission_order(settled)

    def _accepted(self, record: JobRecord) -> None:
        """The job is durable: it is the service's, queued (called by the journal,
        on the loop); it starts once its folder is written (``_written``)."""
        self.jobs[record.job_id] = ServedJob(self, record)
        spec = record.spec
        log.info("job_submitted", job_id=record.job_id, priority=spec.priority,
                 policy_version=spec.policy_version)  # fmt: skip

    def _written(self, record: JobRecord, error: OSError | None) -> None:
        """The job's folder is written: it runs. One whose folder could not be written
        fails with the reason; its journal line stays, so the next start writes its
        folder and resumes it. A daemon stopping starts nothing: ``close`` may have
        taken the tasks it waits for, and the next start resumes the job."""
        failed = None
        if error is not None:
            self.disk_fault(error)
            failed = f"its folder could not be written: {one_line(error)}"
        served = self.jobs.get(record.job_id)
        if self.daemon.stop_requested.is_set() or not isinstance(served, ServedJob):
            return
        if served.record is record:
            served.start(failed)

    def finished(self, served: ServedJob) -> None:
        """A job is final: keep what its status needs, the rest is in its files (and
        the memory its rows took goes back to the system)."""
        if self.jobs.get(served.job_id) is served:
            final = self.jobs[served.job_id] = FinalJob.of(served.record, self.registry)
            if final.state in SETTLED_STATES and self.compaction is not None:
                self.compaction.settled(final)
        self.heap.soon()

    async def status_of(self, job: FoundJob) -> dict[str, Any]:
        """A job's status; a final job's is read from its record."""
        if isinstance(job, FinalJob):
            return await asyncio.to_thread(job.read_status, self.registry)
        if isinstance(job, ArchivedJob):
            return await asyncio.to_thread(job.read_status)
        return job.status()

    async def statuses(self) -> list[dict[str, Any]]:
        """Every job's status: the live ones here on the loop, the final ones read
        from their records in one thread hop."""
        jobs = list(self.jobs.values())
        finals = [job for job in jobs if isinstance(job, FinalJob)]
        read = await asyncio.to_thread(lambda: [job.read_status(self.registry) for job in finals])
        saved = dict(zip((job.job_id for job in finals), read, strict=True))
        return [saved[job.job_id] if isinstance(job, FinalJob) else job.status() for job in jobs]

    async def write(self, write: Callable[..., Any], *args: Any, on_bodies: bool = False) -> Any:
        """Run a blocking write to the state directory in a thread (``on_bodies``: the
        bodies' one thread), and keep its health: a write that fails faults it
        (``/healthz``), one that works clears it."""
        try:
            if on_bodies:
                loop = asyncio.get_running_loop()
                result = await loop.run_in_executor(self._bodies_thread, partial(write, *args))
            else:
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

    async def save_final(self, record: JobRecord) -> None:
        """A job's final record, durably; its journal line is needed no more."""
        await self.write(self.registry.save_final, record)
        self.journal.final_saved(record.job_id)

    async def cancel(self, job_id: str) -> dict[str, Any] | None:
        job = await self.find(job_id)
        if job is None:
            return None
        job.cancel()
        log.info("job_cancel_requested", job_id=job_id)
        return await self.status_of(job)

    def delivered(self, born: list[float | None], group: bool) -> None:
        """A stream wrote lines that became durable at ``born``: record their delay."""
        now = time.monotonic()
        for durable_at in born:
            if durable_at is not None:
                self.delays.observe(now - durable_at, "groups" if group else "rows")

    def delay_quantiles(self) -> dict[str, float | None]:
        return self.delays.quantiles()

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

    async def pause_admission(self, ttl_s: float, reason: str | None) -> None:
        """Pause admission at once, then make the pause durable: a kill -9 in the
        middle of a weight update must not let rollouts start on restart."""
        self.daemon.pause.pause(ttl_s, reason)
        await self._save_admission()

    async def resume_admission(self, by: str) -> None:
        """End the pause (``by`` says what ended it), durably."""
        if self.daemon.pause.resume(by):
            await self._save_admission()

    async def restore_pause(self) -> None:
        """The pause a previous daemon left on, for what is left of it (before any start)."""
        saved = await asyncio.to_thread(self.registry.read_admission)
        if saved is None:
            return
        until_unix, reason = saved
        left_s = min(until_unix - time.time(), MAX_TTL_S)
        if left_s > 0:
            self.daemon.pause.pause(left_s, reason)
            log.info("admission_pause_restored", ttl_s=round(left_s, 3), reason=reason)

    async def _save_admission(self) -> None:
        # What the pause is when the write starts: writes in order, the last
        # one saying how it is now, whatever interleaved.
        async with self._setting_admission:
            pause = self.daemon.pause
            left_s = pause.remaining_s()
            until = time.time() + left_s if pause.paused and left_s is not None else None
            await self.write(self.registry.save_admission, until, pause.reason)

    async def set_policy(self, version: int, *, force: bool = False) -> None:
        """Save the version, then move to it: a version counts (releases a paced
        job) only once it is durable, so a restart never goes back on it. A
        lower one than the current is a ``Conflict`` unless ``force``."""
        policy = self.daemon.policy
        assert policy is not None
        async with self._setting_policy:
            if version < policy.version and not force:
                raise Conflict(
                    f"version: {version} would go back: the current version is "
                    f'{policy.version} (send "force": true to set a lower one)'
                )
            await self.write(self.registry.save_policy, version)
            policy.set(version)
        log.info("policy_version_set", version=version)
        # The weight update is over: a pause around it ends here.
        await self.resume_admission("policy_version")

    async def start_threads(self) -> None:
        """Start every thread a burst of submits and its jobs' starts use, before the
        daemon says it listens: the first burst found none (``aio.start_threads``)."""
        await self.journal.start_threads()
        await start_threads(self._bodies_thread)
        await start_threads(self._index_thread)
        await start_threads(None, DEFAULT_EXECUTOR_THREADS)

    async def close(self) -> None:
        """Wait for every job to stop (the daemon's stop request stops them)."""
        tasks = [j.task for j in self.jobs.values() if j.task is not None and not j.task.done()]
        if tasks:
            await asyncio.wait(tasks)
        await self.heap.close()
        if self.hop_end.session is not None:
            await self.hop_end.session.close()
        await self.journal.close()
        if self.compaction is not None:
            await self.compaction.close()
        self._bodies_thread.shutdown(wait=False, cancel_futures=True)
        self._index_thread.shutdown(wait=False, cancel_futures=True)

    def exit_code(self) -> ExitCode:
        if self.daemon.fatal is not None:
            raise self.daemon.fatal
        unsettled = [
            j
            for j in self.jobs.values()
            if isinstance(j, BrokenJob)
            or not isinstance(j, FinalJob)
            or j.state not in SETTLED_STATES
        ]
        return ExitCode.RESUMABLE if unsettled else ExitCode.DONE

    # ---- the daemon's view -------------------------------------------------------------

    def job_counts(self) -> dict[str, int]:
        return dict(Counter(j.state.value for j in self.jobs.values()))

    def step_totals(self) -> StepTotals:
        """The step targets of the jobs not final, summed (for ``/metrics``)."""
        totals = StepTotals()
        for job in self.jobs.values():
            if isinstance(job, ServedJob) and not job.finished:
                job.step.add_to(totals)
        return totals

    def running(self) -> list[Job]:
        """The hops running now, one per job (held in memory whole)."""
        return [j.job for j in self.jobs.values() if isinstance(j, ServedJob) and j.job]

    def status(self) -> dict[str, Any]:
        """The daemon's ``/status``: its figures and the service's."""
        return service_status(self)


__all__ = ["BadJob", "BrokenJob", "Conflict", "FinalJob", "ServedJob", "Service"]
