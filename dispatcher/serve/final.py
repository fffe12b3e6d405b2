"""Jobs of ``dispatcher serve`` that do not run: final ones and broken ones.

A ``FinalJob`` is what a job leaves once final, and what a settled job is
after a restart: its id, state, error, submission order, body digest and the
line of its target-th kept group, nothing more. Its status (saved in
``job.json`` as it ended) and its rows are read from its files when asked
for, so a daemon that ran thousands of jobs, or restarts on them, holds
O(1) for each (contracts §12).

A ``BrokenJob`` is a job whose record cannot be read: failed with the
reason, never run. Its id stays taken while its folder is there (a submit of
it is a 409 naming the folder); once the operator moves the folder aside,
the id can be submitted again.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dispatcher.files.atomic import read_manifest
from dispatcher.files.contracts import JobStatus, max_attempts_for
from dispatcher.files.resume import OutputPaths
from dispatcher.files.writer import LineIndex
from dispatcher.lifecycle import JobState
from dispatcher.serve.registry import JobRecord, Registry, Unreadable
from dispatcher.serve.results import Source


@dataclass(slots=True)
class FinalJob:
    """A final job: a few fields in memory, the rest in its folder. A daemon keeps one
    for every job it ran: slotted, its folder derived from the registry's (shared)."""

    job_id: str
    jobs_dir: Path
    state: JobState
    error: str | None
    submitted_seq: int
    digest: str
    satisfied_seq: int | None = None
    # Nothing runs for it.
    task: asyncio.Task[None] | None = None
    # The streams reading it now share one index of its files (gone with the last).
    _shared: weakref.ref[Source] | None = field(default=None, repr=False, compare=False)
    # Called when the last stream reading it ends (its fold may have waited for that).
    unread: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, record: JobRecord, registry: Registry) -> FinalJob:
        assert record.state is not None
        seq = (record.step or {}).get("satisfied_seq")
        return cls(
            job_id=record.job_id,
            jobs_dir=registry.jobs_dir,
            state=record.state,
            error=record.error,
            submitted_seq=record.submitted_seq,
            digest=record.digest,
            satisfied_seq=seq if type(seq) is int else None,
        )

    def read_status(self, registry: Registry) -> dict[str, Any]:
        """Its status from ``job.json`` (blocking); what memory says of its end wins
        (a record that could not be saved says less). A record gone or damaged
        since (its folder moved aside, say) leaves what memory says, and why."""
        record = registry.read(self.folder)
        status = saved_status(record) if isinstance(record, JobRecord) else None
        error = self.error
        if status is None:
            status = JobStatus(self.job_id, self.state, True, output=str(self.output)).to_json()
            if isinstance(record, Unreadable) and error is None:
                error = f"{record.reason}; its status is as the daemon last knew it"
        return {**status, "state": self.state.value, "final": True, "error": error}

    @property
    def folder(self) -> Path:
        return self.jobs_dir / self.job_id

    @property
    def output(self) -> Path:
        return self.folder / "rollouts.jsonl"

    def cancel(self) -> None:
        """Nothing of it runs."""

    def read_by_a_stream(self) -> bool:
        """Whether a results stream reads its files now (it is not archived meanwhile)."""
        return self._shared is not None and self._shared() is not None

    async def source(self) -> Source:
        shared = self._shared() if self._shared is not None else None
        if shared is not None:
            return shared
        source = await _files_source(
            self.folder, lambda: self.state.value, lambda: self.error, lambda: self.satisfied_seq
        )
        # The callback holds the hook alone, not this job: no reference cycle.
        unread = self.unread
        self._shared = weakref.ref(source, None if unread is None else lambda _: unread())
        return source


def saved_status(record: JobRecord) -> dict[str, Any] | None:
    """The status a final record saved; for one of an older daemon, built from it."""
    if record.final_status is not None:
        return record.final_status
    if record.state is None:
        return None
    spec = record.spec
    status = JobStatus(
        job_id=record.job_id,
        state=record.state,
        final=True,
        priority=spec.priority,
        policy_version=spec.policy_version,
        outcomes=dict(record.outcomes or {}),
        submitted_at=record.submitted_at,
        error=record.error,
        metadata=spec.metadata,
    )
    return {**status.to_json(), **(record.step or {})}


class BrokenJob:
    """A job whose record cannot be read: failed with the reason, never run."""

    def __init__(self, broken: Unreadable) -> None:
        self.broken = broken
        self.folder = broken.folder
        self.output = broken.folder / "rollouts.jsonl"
        self.task: asyncio.Task[None] | None = None
        self.state = JobState.FAILED

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
        return await _files_source(
            self.folder, lambda: JobState.FAILED.value, lambda: self.broken.reason, lambda: None
        )


async def _files_source(
    folder: Path,
    final_state: Callable[[], str | None],
    final_error: Callable[[], str | None],
    satisfied_seq: Callable[[], int | None],
) -> Source:
    """A job's results read from its files, for this stream alone."""
    output, groups = folder / "rollouts.jsonl", folder / "groups.jsonl"
    paths = OutputPaths.for_output(output)
    rows = await asyncio.to_thread(LineIndex.scan, output)
    group_index = await asyncio.to_thread(LineIndex.scan, groups)
    failures = await asyncio.to_thread(LineIndex.scan, paths.failures)
    manifest = await asyncio.to_thread(read_manifest, paths.manifest)
    return Source(
        output, rows, groups, group_index, final_state, unknown_completion, final_error,
        satisfied_seq, failures_path=paths.failures, failures=failures,
        attempt_cap=max_attempts_for(None, manifest),
    )  # fmt: skip


def unknown_completion(task: int) -> float | None:
    return None
