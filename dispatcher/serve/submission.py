"""The submission of a job to ``dispatcher serve``, mixed into ``Service`` (``jobs.py``).

A body is parsed, its job_id looked up in the archive, its rows checked as
``run`` checks them (``Submissions._check``): on the loop for a small body of
rows whose check touches no disk and whose job_id the archive cannot hold
(``archived_ids.py``), a fraction of a millisecond; else in one thread hop, on
the bodies' thread. A hop costs a submit two turns of the loop, and each turn
of a busy loop is the time it takes to serve every rollout that was ready.
Then, on the loop: the same body again is the same job (200),
another body of an existing id a ``Conflict``; a new job takes its id and
submission order under a lock (``_reserve``) and is committed by the journal
of submissions (``journal.py``, a thread of its own): answered once its line
is durable, started once its folder is written. The submit never waits for
the default executor, where the jobs' starts and ends do their file work, nor
for its job's folder.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from dispatcher.serve.archive import ArchivedJob, Compaction
from dispatcher.serve.faults import StateDirHealth
from dispatcher.serve.final import BrokenJob, FinalJob
from dispatcher.serve.journal import Journal, Refused
from dispatcher.serve.metrics import Durations
from dispatcher.serve.registry import ROWS_FILE, JobRecord, Registry, now_iso
from dispatcher.serve.served import ServedJob
from dispatcher.serve.spec import STORED, BadJob, JobSpec, check_tasks
from dispatcher.settings.config import RunSettings
from dispatcher.settings.serve import ServeLimits

# A job the service holds; and a job as a request finds it: held, or read from
# the archive index.
AnyJob = ServedJob | FinalJob | BrokenJob
FoundJob = AnyJob | ArchivedJob

log = structlog.get_logger("dispatcher.serve")


# A body of rows this small is checked on the loop (``_checks_here``): a job of a
# few rows takes a fraction of a millisecond of CPU.
INLINE_BODY_BYTES = 16 * 1024


class Conflict(Exception):
    """A submission that contradicts an existing job: a 409 with this message."""


class NotLooked:
    """The archive was not looked in for a job (``Service._known``)."""


NOT_LOOKED = NotLooked()


@dataclass
class Checked:
    """A body as its one thread hop left it (``Service._check``)."""

    spec: JobSpec
    digest: str
    # What the archive held of its job_id (before the hop's end).
    archived: ArchivedJob | None
    # Why its rows are refused (raised only for a new job).
    refused: BadJob | None


class Submissions:
    """``Service.submit`` and what it needs; see the module docstring."""

    base: RunSettings
    registry: Registry
    input_root: Path
    limits: ServeLimits
    jobs: dict[str, AnyJob]
    health: StateDirHealth
    compaction: Compaction | None
    journal: Journal
    submit_times: Durations
    _next_seq: int
    _bodies_thread: ThreadPoolExecutor
    _submitting: asyncio.Lock
    _accepting: dict[str, asyncio.Future[None]]

    if TYPE_CHECKING:
        # The service's own (``jobs.py``).
        async def find(self, job_id: str) -> FoundJob | None: ...

        async def status_of(self, job: FoundJob) -> dict[str, Any]: ...

        def disk_fault(self, exc: BaseException) -> None: ...

        def _accepted(self, record: JobRecord) -> None: ...

        def _written(self, record: JobRecord, error: OSError | None) -> None: ...

    async def submit(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """Accept a job: (201, status) new, (200, status) the same again; raises
        ``BadJob`` (400), ``TooBig`` (413) or ``Conflict`` (409). Answered once the
        job is durable (``journal.py``: submissions commit in groups); the time an
        answer took is kept (``submit_times``)."""
        started = time.perf_counter()
        answer = await self._submit(body)
        self.submit_times.observe(time.perf_counter() - started)
        return answer

    async def _submit(self, body: bytes) -> tuple[int, dict[str, Any]]:
        # What the archive held before the body's lookup in it (``_reserve``).
        archived = self._archived()
        parsed = self._parsed_here(body)
        if parsed is not None and self._checks_here(parsed):
            checked = self._checked(parsed.rooted(self.input_root, self.registry.root), None)
        else:
            loop = asyncio.get_running_loop()
            try:
                checked = await loop.run_in_executor(self._bodies_thread, self._check, body, parsed)
            except OSError as exc:
                self.disk_fault(exc)
                raise
        del body
        spec, digest = checked.spec, checked.digest
        if (answer := await self._known(spec, digest, looked_up=checked.archived)) is not None:
            return answer
        if checked.refused is not None:
            raise checked.refused
        self.health.wrote()
        answer, record = await self._reserve(spec, digest, archived)
        if answer is not None:
            return answer
        assert record is not None
        entry = self.journal.submit(record, spec.rows, self._accepted, self._written)
        del spec
        self._accepting[record.job_id] = entry.done
        entry.done.add_done_callback(lambda _: self._accepting.pop(record.job_id, None))
        try:
            await entry.answer
        except Refused as exc:
            raise Conflict(str(exc)) from None
        except OSError as exc:
            self.disk_fault(exc)
            raise
        return 201, await self.status_of(self.jobs[record.job_id])

    async def _known(
        self,
        spec: JobSpec,
        digest: str,
        *,
        archived: bool = True,
        looked_up: ArchivedJob | NotLooked | None = NOT_LOOKED,
    ) -> tuple[int, dict[str, Any]] | None:
        """The answer for a body whose job exists (200, or a ``Conflict``); None for a
        new one. A job of the same id being committed is waited for; ``archived``:
        the archive is looked in too (only the service's settled jobs go there), or
        what ``looked_up`` found in it is taken."""
        if spec.job_id is None:
            return None
        while (committing := self._accepting.get(spec.job_id)) is not None:
            await asyncio.wait([committing])
        existing: FoundJob | None = self.jobs.get(spec.job_id)
        if existing is None and archived:
            if isinstance(looked_up, NotLooked):
                existing = await self.find(spec.job_id)
            else:
                existing = looked_up
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

    def _parsed_here(self, body: bytes) -> JobSpec | None:
        """A body of at most ``INLINE_BODY_BYTES`` parsed on the loop (its rows are
        checked in memory); None for a larger one, parsed in the bodies' thread."""
        if len(body) > INLINE_BODY_BYTES:
            return None
        return JobSpec.parse(body, self.base.agents)

    def _checks_here(self, spec: JobSpec) -> bool:
        """Whether ``spec``'s check runs on the loop: rows without quotas (checked in
        memory; a check of quotas writes a file), whose job_id the archive cannot
        hold; any other takes the thread."""
        if spec.rows is None or spec.target_groups_by_agent is not None:
            return False
        compaction, job_id = self.compaction, spec.job_id
        return job_id is None or compaction is None or not compaction.ids.may_hold(job_id)

    def _check(self, body: bytes, parsed: JobSpec | None = None) -> Checked:
        """The body parsed (unless ``parsed`` already is), its job looked up in the
        archive and its rows checked, in one thread hop (blocking). A body that cannot
        be parsed raises ``BadJob``; a refusal of its rows is kept for after the
        lookup: the same body again is the same job, whatever its rows."""
        spec = parsed if parsed is not None else JobSpec.parse(body, self.base.agents)
        spec = spec.rooted(self.input_root, self.registry.root)
        archived = None
        if spec.job_id is not None and self.compaction is not None:
            archived = self.compaction.archive.find(spec.job_id)
        return self._checked(spec, archived)

    def _checked(self, spec: JobSpec, archived: ArchivedJob | None) -> Checked:
        digest = spec.digest()
        refused = None
        try:
            # Checked outside the lock: one job's check never waits for another's commit.
            check_tasks(spec, self._settings_for(spec), self.registry.scratch, self.limits)
        except BadJob as exc:
            refused = exc
        return Checked(spec, digest, archived, refused)

    def _still_broken(self, broken: BrokenJob) -> None:
        """A broken job's id is a 409 while its folder is there; gone, it is free."""
        if broken.folder.exists():
            raise Conflict(
                f"job_id: {broken.job_id!r} is a failed job whose record cannot be read "
                f"({broken.broken.reason}); move {broken.folder} aside to submit it again"
            )
        del self.jobs[broken.job_id]

    def _settings_for(self, spec: JobSpec) -> Callable[[Path], RunSettings]:
        """The job's settings for a task file, with its output in the scratch folder."""
        return lambda tasks: spec.settings(self.base, tasks, self.registry.scratch / "x.jsonl")
