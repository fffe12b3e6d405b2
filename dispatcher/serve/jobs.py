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
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import structlog

from dispatcher.admission.history import HISTORY_FILE, TaskHistory
from dispatcher.admission.pause import MAX_TTL_S
from dispatcher.errors import ExitCode
from dispatcher.heap import HeapTrimmer
from dispatcher.latency.quantile import quantile
from dispatcher.run.daemon import Daemon
from dispatcher.run.job import Job
from dispatcher.serve.archive import Archive, ArchivedJob, Compaction
from dispatcher.serve.bodies import BodyBudget
from dispatcher.serve.faults import StateDirHealth, is_disk_fault, one_line
from dispatcher.serve.final import BrokenJob, FinalJob
from dispatcher.serve.journal import Journal, Refused
from dispatcher.serve.metrics import StepTotals, declare_service_metrics, service_status
from dispatcher.serve.registry import (
    ROWS_FILE,
    SETTLED_STATES,
    JobRecord,
    Registry,
    Unreadable,
    in_submission_order,
    now_iso,
)
from dispatcher.serve.sending import Slots
from dispatcher.serve.served import ServedJob
from dispatcher.serve.spec import STORED, BadJob, JobSpec, check_tasks
from dispatcher.settings.config import RunSettings
from dispatcher.settings.serve import ServeLimits

log = structlog.get_logger("dispatcher.serve")

DELAY_WINDOW = 10_000

AnyJob = ServedJob | FinalJob | BrokenJob
# A job as a request finds it: held by the service, or read from the archive index.
FoundJob = AnyJob | ArchivedJob


class Conflict(Exception):
    """A submission that contradicts an existing job: a 409 with this message."""


class Service:
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
        # delivery on a results stream: the last ones, for /status.
        self.delays: deque[float] = deque(maxlen=DELAY_WINDOW)
        self._delay_histogram = declare_service_metrics(
            daemon.metrics.registry,
            self.job_counts,
            daemon.policy_version,
            daemon.pause,
            self.step_totals,
        )
        # Bodies are parsed, checked and written in one thread: the memory of a
        # body's objects is reused by the next, not kept in an allocator arena
        # per worker thread.
        self._bodies_thread = ThreadPoolExecutor(1, thread_name_prefix="serve-bodies")
        self._index_thread = ThreadPoolExecutor(1, thread_name_prefix="serve-index")
        # Ids and submission orders are taken one body at a time: two racing bodies
        # for one job_id must not both create it.
        self._submitting = asyncio.Lock()
        self.journal = Journal(registry)
        # Jobs being committed, by id: a body of the same id waits for the commit.
        self._accepting: dict[str, asyncio.Future[None]] = {}
        # One policy update at a time: the versions are saved in the order set.
        self._setting_policy = asyncio.Lock()
        # The same for the admission pause's file.
        self._setting_admission = asyncio.Lock()
        self.history: TaskHistory | None = None

    async def resume(self) -> None:
        """Load the registry; start every job that is not settled (done, cancelled or
        satisfied). A fold a kill cut is undone first (archive.py)."""
        archive = await asyncio.to_thread(self._open_archive)
        self.compaction = Compaction(archive, self.limits.retain_settled_jobs, self.jobs,
                                     self.write)  # fmt: skip
        self.compaction.archived = await asyncio.to_thread(archive.count)
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

    async def submit(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """Accept a job: (201, status) new, (200, status) the same again; raises
        ``BadJob`` (400), ``TooBig`` (413) or ``Conflict`` (409). Answered once the
        job is durable (``journal.py``: submissions commit in groups)."""
        loop = asyncio.get_running_loop()
        spec, digest = await loop.run_in_executor(self._bodies_thread, self._parse, body)
        del body
        archived = self._archived()
        if (answer := await self._known(spec, digest)) is not None:
            return answer
        # Checked outside the lock: one job's check never waits for another's commit.
        settings = self._settings_for(spec)
        await self.write(
            check_tasks, spec, settings, self.registry.scratch, self.limits, on_bodies=True
        )
        answer, record = await self._reserve(spec, digest, archived)
        if answer is not None:
            return answer
        assert record is not None
        done = self.journal.submit(record, spec.rows, self._accepted)
        del spec
        self._accepting[record.job_id] = done
        done.add_done_callback(lambda _: self._accepting.pop(record.job_id, None))
        try:
            await asyncio.shield(done)
        except Refused as exc:
            raise Conflict(str(exc)) from None
        except OSError as exc:
            self.disk_fault(exc)
            raise
        return 201, await self.status_of(self.jobs[record.job_id])

    async def _known(
        self, spec: JobSpec, digest: str, *, archived: bool = True
    ) -> tuple[int, dict[str, Any]] | None:
        """The answer for a body whose job exists (200, or a ``Conflict``); None for a
        new one. A job of the same id being committed is waited for; ``archived``:
        the archive is looked in too (only the service's settled jobs go there)."""
        if spec.job_id is None:
            return None
        while (committing := self._accepting.get(spec.job_id)) is not None:
            await asyncio.wait([committing])
        existing = await self.find(spec.job_id) if archived else self.jobs.get(spec.job_id)
        if isinstance(existing, BrokenJob):
            self._still_broken(existing)
            existing = None
        if existing is None:
            return None
        if existing.digest != digest:
            raise Conflict(f"job_id: {spec.job_id!r} exists with a different body")
        return 200, await self.status_of(existing)

    def _archived(self) -> int:
        return self.compaction.committed if self.compaction is not None else 0

    async def _reserve(
        self, spec: JobSpec, digest: str, archived: int
    ) -> tuple[tuple[int, dict[str, Any]] | None, JobRecord | None]:
        """The job's id and submission order, taken for it alone: (None, its record);
        or (the answer, None) when a body of its id came first. The archive is looked
        in again only if a fold ended since ``archived`` (what it held then)."""
        async with self._submitting:
            folded = self._archived() != archived
            if (answer := await self._known(spec, digest, archived=folded)) is not None:
                return answer, None
            spec = spec.with_id()
            assert spec.job_id is not None
            if spec.job_id in self._accepting:  # an id made up twice: 48 random bits
                raise Conflict(f"job_id: {spec.job_id!r} is being submitted")
            # The rows go to the job's own file; its record keeps none of them.
            rows_file = ROWS_FILE if spec.rows is not None else None
            stored = spec.model_copy(update={"rows": None})
            fields = {"spec": stored, "digest": digest, "submitted_seq": self._next_seq,
                      "submitted_at": now_iso(), "rows_file": rows_file}  # fmt: skip
            # Validated as read back: its rows are in its folder.
            record = JobRecord.model_validate(fields, context=STORED)
            self._next_seq += 1
            return None, record

    def _accepted(self, record: JobRecord) -> None:
        """The job is durable: it runs (called by the journal, on the loop)."""
        served = ServedJob(self, record)
        self.jobs[record.job_id] = served
        served.start()
        spec = record.spec
        log.info("job_submitted", job_id=record.job_id, priority=spec.priority,
                 policy_version=spec.policy_version)  # fmt: skip

    def _parse(self, body: bytes) -> tuple[JobSpec, str]:
        """The body's spec, rooted, and its digest (blocking: a big body takes a while)."""
        spec = JobSpec.parse(body, self.base.agents).rooted(self.input_root, self.registry.root)
        return spec, spec.digest()

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

    def _still_broken(self, broken: BrokenJob) -> None:
        """A broken job's id is a 409 while its folder is there; gone, it is free."""
        if broken.folder.exists():
            raise Conflict(
                f"job_id: {broken.job_id!r} is a failed job whose record cannot be read "
                f"({broken.broken.reason}); move {broken.folder} aside to submit it again"
            )
        del self.jobs[broken.job_id]

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

    def _settings_for(self, spec: JobSpec) -> Callable[[Path], RunSettings]:
        """The job's settings for a task file, with its output in the scratch folder."""
        return lambda tasks: spec.settings(self.base, tasks, self.registry.scratch / "x.jsonl")

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
                self.delays.append(now - durable_at)
                self._delay_histogram.labels("groups" if group else "rows").observe(
                    now - durable_at
                )

    def delay_quantiles(self) -> dict[str, float | None]:
        ordered = sorted(self.delays)
        return {
            "p50": quantile(ordered, 0.5),
            "p99": quantile(ordered, 0.99),
            "max": ordered[-1] if ordered else None,
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

    async def close(self) -> None:
        """Wait for every job to stop (the daemon's stop request stops them)."""
        tasks = [j.task for j in self.jobs.values() if j.task is not None and not j.task.done()]
        if tasks:
            await asyncio.wait(tasks)
        await self.heap.close()
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
