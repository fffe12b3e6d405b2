"""The submissions' group commit: a job is accepted once its journal line is durable.

Submissions that wait at once are committed together, in one thread hop:
each job's folder claimed (an empty directory), then their lines (each the
job's record, as ``job.json`` holds it, and its rows) appended to
``DIR/journal/NNNNNN.jsonl`` in one write and one fsync; then each submitter
answered, and only then (the GIL is the loop's while it answers) a second
thread writes each job's folder (``Registry.write_job``, without fsync) and
the job starts once it is written. No timer: while one batch is on disk the next gathers, so a lone
submit waits for one fsync and a thousand at once for a few. The journal's
thread takes that next batch itself as the last one ends, with no turn of
the loop between them and without waiting for the folders of the last one: a
busy loop delays a submit's answer, never its commit, and a submit waits for
no job's files.

Crash-safety: a job's folder files are written only once its line is durable,
so after a kill or a power cut every job whose folder holds anything has its
line. At start, ``replay`` writes again (durably) the folder of every job of
the journal whose record is missing or unreadable, or whose rows file is not
its rows, unless the job is archived. A job answered 2xx survives; a job not
answered is whole or absent, never half.

A journal line is needed until its job's final record is saved
(``Registry.save_final``: its rows file and ``job.json`` fsynced). A segment
is closed after ``SEGMENT_JOBS`` jobs and removed, once none of its jobs is
pending, after ``jobs/`` is fsynced (the folders' names are durable then).
Jobs that run across a restart keep their segments until they end; so does
a job whose folder could not be written (a full disk): the next start writes
it from its line.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import structlog

from dispatcher import jsonx
from dispatcher.aio import start_threads
from dispatcher.errors import ConfigError
from dispatcher.files.atomic import fsync_dir, make_dirs, write_fully
from dispatcher.serve.registry import (
    SETTLED_STATES,
    BadRecord,
    JobRecord,
    Registry,
    rows_lines,
)

log = structlog.get_logger("dispatcher.serve")

JOURNAL_DIR = "journal"
# Where ``Journal.step`` is called during a commit: a test stops one there as a kill would.
APPENDED = "appended"
# Jobs per segment: what a restart reads at most of the journal beyond the jobs
# still running.
SEGMENT_JOBS = 1024


class Refused(Exception):
    """A job's folder holds another job's files: the submit is a 409 with this message."""


@dataclass
class Entry:
    """One submission waiting for its commit."""

    record: JobRecord
    rows: list[dict[str, Any]] | None
    # Called on the loop once the job is durable, before its submitter hears of it.
    accepted: Callable[[JobRecord], None]
    # Called on the loop once its folder is written, or with why it could not be.
    written: Callable[[JobRecord, OSError | None], None]
    # Done once the commit has ended, whatever the submitter does.
    done: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    # The submitter's own (its cancel cancels this one alone, never ``done``).
    answer: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    def line(self) -> bytes:
        record = self.record.to_json().rstrip(b"\n")
        rows = jsonx.dumps(self.rows) if self.rows is not None else b"null"
        return b'{"record":' + record + b',"rows":' + rows + b"}\n"


class Journal:
    """The journal of one state directory: commits submissions in groups, replays
    them at start, drops what final jobs no longer need."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.root = registry.root / JOURNAL_DIR
        # Submits append on the loop, the journal's thread takes what waits: both
        # under the lock, with ``_writing`` (the thread has been handed the queue).
        self._lock = threading.Lock()
        self._waiting: list[Entry] = []
        self._writing = False
        # Set while no batch is being written.
        self._quiet = asyncio.Event()
        self._quiet.set()
        # One thread writes the journal: its appends are in commit order.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="serve-journal")
        # Another writes the accepted jobs' folders, in the same order; batches
        # handed to it and not yet called back (under the lock).
        self._folders = ThreadPoolExecutor(1, thread_name_prefix="serve-folders")
        self._unwritten = 0
        # The segment appended to and its jobs so far: the thread's own; and whether
        # an append to it failed (it may end in part of a line).
        self._segment = 1
        self._in_segment = 0
        self._torn = False
        # The segment appended to as the loop knows it (``_settle``): the ones
        # before it are closed, and go once their jobs are final.
        self._current = 1
        # Jobs not final yet -> their segment; segment -> how many of them.
        self._pending: dict[str, int] = {}
        self._open: dict[int, int] = {}
        self._drops: set[asyncio.Task[None]] = set()
        # Batches committed and the largest one.
        self.batches = 0
        self.largest_batch = 0
        # Called in the commit's thread once a batch's lines are durable (a test's hook).
        self.step: Callable[[str], None] = lambda _: None

    # ---- commit -----------------------------------------------------------------------

    def submit(
        self,
        record: JobRecord,
        rows: list[dict[str, Any]] | None,
        accepted: Callable[[JobRecord], None],
        written: Callable[[JobRecord, OSError | None], None] = lambda record, error: None,
    ) -> Entry:
        """Queue the job for the next commit. The entry's ``done`` is done once the
        job is durable and ``accepted`` has been called (or with ``Refused`` or the
        ``OSError`` of the write), and so is its ``answer`` unless the submitter
        cancelled it: a submitter that stops waiting changes nothing, the commit
        and ``accepted`` happen. ``written`` is called once the accepted job's
        folder is written (or could not be), after its answer."""
        entry = Entry(record, rows, accepted, written)
        with self._lock:
            self._waiting.append(entry)
            idle, self._writing = not self._writing, True
        if idle:
            # At the loop's next turn: the submits of this turn join the batch.
            self._quiet.clear()
            asyncio.get_running_loop().call_soon(self._hand_over)
        return entry

    def _hand_over(self) -> None:
        """Hand the queue to the journal's thread, which commits what waits batch
        after batch and calls ``_settle`` back on the loop for each."""
        loop = asyncio.get_running_loop()
        try:
            self._thread.submit(self._drain, loop)
        except RuntimeError as exc:  # the thread is shut down: the daemon is stopping
            with self._lock:
                batch, self._waiting, self._writing = self._waiting, [], False
            self._settle(batch, [exc] * len(batch), self._current, closed=False)
            self._quiet.set()

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """Commit what waits until nothing does (in the journal's thread): the batch
        that gathered while the last one was on disk goes at once."""
        while True:
            with self._lock:
                batch, self._waiting = self._waiting, []
                if not batch:
                    self._writing = False
                    break
            self._commit(loop, batch)
        loop.call_soon_threadsafe(self._maybe_quiet)

    def _commit(self, loop: asyncio.AbstractEventLoop, batch: list[Entry]) -> None:
        """The batch written, its segment closed once full, then the batch settled on
        the loop."""
        segment = self._segment
        results: list[BaseException | None]
        try:
            results = self._write(batch, segment)
        except Exception as exc:
            # The journal itself could not be written: none of them is accepted.
            results = [exc] * len(batch)
        self._in_segment += results.count(None)
        # After a torn line, the next would begin on its line: both unreadable.
        closed, self._torn = self._in_segment >= SEGMENT_JOBS or self._torn, False
        if closed:
            self._segment, self._in_segment = segment + 1, 0
        accepted = [entry for entry, error in zip(batch, results, strict=True) if error is None]
        if accepted:
            # Counted here: ``_maybe_quiet`` must not see the journal idle before
            # ``_settle`` has handed the folders over.
            with self._lock:
                self._unwritten += 1
        loop.call_soon_threadsafe(partial(self._settle, batch, results, segment, closed=closed))

    def _to_folders(self, batch: list[Entry]) -> None:
        # Never refused: the folders thread stops only after ``close`` saw it idle.
        self._folders.submit(self._write_folders, asyncio.get_running_loop(), batch)

    def _write_folders(self, loop: asyncio.AbstractEventLoop, batch: list[Entry]) -> None:
        """The folders of a batch of accepted jobs (in the folders' thread, blocking),
        then each job told, on the loop."""
        errors: list[OSError | None] = []
        for entry in batch:
            try:
                self.registry.write_job(entry.record, entry.rows, durable=False)
            except OSError as exc:
                errors.append(exc)
            else:
                errors.append(None)
        try:
            # The folders' names, claimed in the journal's thread, durable before a job
            # makes a row durable in one: a power cut must not take its rows away.
            fsync_dir(self.registry.jobs_dir)
        except OSError as exc:
            errors = [exc] * len(batch)
        loop.call_soon_threadsafe(self._written, batch, errors)

    def _written(self, batch: list[Entry], errors: list[OSError | None]) -> None:
        for entry, error in zip(batch, errors, strict=True):
            if error is not None:
                # Its line stays until the next start, which writes its folder.
                self._pending.pop(entry.record.job_id, None)
            entry.written(entry.record, error)
        with self._lock:
            self._unwritten -= 1
        self._maybe_quiet()

    def _maybe_quiet(self) -> None:
        # A submit may have handed the queue over again since the thread let it go.
        with self._lock:
            if not self._writing and not self._unwritten:
                self._quiet.set()

    def _settle(
        self,
        batch: list[Entry],
        results: list[BaseException | None],
        segment: int,
        *,
        closed: bool,
    ) -> None:
        accepted = [entry for entry, error in zip(batch, results, strict=True) if error is None]
        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(batch))
        for entry in accepted:
            self._pending[entry.record.job_id] = segment
        self._open[segment] = self._open.get(segment, 0) + len(accepted)
        if closed:
            self._current = segment + 1
            self._drop_if_done(segment)
        for entry, error in zip(batch, results, strict=True):
            if error is None:
                entry.accepted(entry.record)
            for future in (entry.done, entry.answer):
                if future.cancelled():
                    continue
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)
                    # A submitter gone away never reads it: no "never retrieved" warning.
                    future.exception()
        if accepted:
            # After the submitters' answers (their tasks woke before this runs): a
            # burst's answers do not share the GIL with its folders' writes.
            asyncio.get_running_loop().call_soon(self._to_folders, accepted)

    def _write(self, batch: list[Entry], segment: int) -> list[BaseException | None]:
        """The batch's folders claimed and its lines durable in one fsync (blocking)."""
        results: list[BaseException | None] = []
        for entry in batch:
            try:
                self.registry.claim(entry.record.job_id)
            except ConfigError as exc:
                results.append(Refused(str(exc)))
            else:
                results.append(None)
        claimed = [e for e, error in zip(batch, results, strict=True) if error is None]
        try:
            if claimed:
                self._append(segment, b"".join(e.line() for e in claimed))
        except BaseException:
            # Not accepted: the folders claimed for them go (empty, as claimed).
            for entry in claimed:
                with contextlib.suppress(OSError):
                    self.registry.job_dir(entry.record.job_id).rmdir()
            raise
        self.step(APPENDED)
        return results

    def _append(self, segment: int, data: bytes) -> None:
        path = self.segment_path(segment)
        new = not path.exists()
        if new:
            make_dirs(self.root)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            write_fully(fd, data)
            os.fsync(fd)
        except OSError:
            # Part of the lines may be there (a full disk): the segment ends here.
            self._torn = True
            raise
        finally:
            os.close(fd)
        if new:
            fsync_dir(self.root)

    def segment_path(self, segment: int) -> Path:
        return self.root / f"{segment:06d}.jsonl"

    # ---- a job's end --------------------------------------------------------------------

    def final_saved(self, job_id: str) -> None:
        """The job's final record is durable: its line is needed no more."""
        segment = self._pending.pop(job_id, None)
        if segment is None:
            return
        self._open[segment] -= 1
        self._drop_if_done(segment)

    def _drop_if_done(self, segment: int) -> None:
        if segment >= self._current or self._open.get(segment, 0) > 0:
            return
        self._open.pop(segment, None)
        task = asyncio.create_task(asyncio.to_thread(self._drop, segment), name="journal-drop")
        self._drops.add(task)
        task.add_done_callback(self._dropped)

    def _dropped(self, task: asyncio.Task[None]) -> None:
        self._drops.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            # Kept, it is replayed at the next start, which changes nothing.
            log.warning("journal_segment_not_removed", error=str(exc))

    def _drop(self, segment: int) -> None:
        fsync_dir(self.registry.jobs_dir)
        with contextlib.suppress(FileNotFoundError):
            self.segment_path(segment).unlink()
        fsync_dir(self.root)

    async def start_threads(self) -> None:
        """Start the journal's threads (before the first submit: see ``aio.start_threads``)."""
        await start_threads(self._thread)
        await start_threads(self._folders)

    async def close(self) -> None:
        """Let the commits and drops under way end."""
        await self._quiet.wait()
        tasks = [t for t in self._drops if not t.done()]
        if tasks:
            await asyncio.wait(tasks)
        self._thread.shutdown(wait=False)
        self._folders.shutdown(wait=False)

    # ---- start --------------------------------------------------------------------------

    def replay(self, archived: Callable[[str], bool]) -> int:
        """Make whole, durably, every job of the journal a kill cut (blocking, before
        the registry is read); the number repaired. Segments whose jobs are all
        final go; the others stay until their jobs end."""
        segments = self._segments()
        # A job_id submitted again (its folder moved aside): its last line is the job.
        last = {
            record.job_id: (segment, n)
            for segment in segments
            for n, (record, _) in enumerate(_entries(self.segment_path(segment)))
        }
        repaired = 0
        for segment in segments:
            for n, (record, rows) in enumerate(_entries(self.segment_path(segment))):
                job_id = record.job_id
                if last[job_id] != (segment, n) or archived(job_id):
                    continue
                whole = self._whole(record, rows)
                if whole is None:  # final
                    continue
                if not whole:
                    self.registry.write_job(record, rows, durable=True)
                    repaired += 1
                    log.warning("journal_job_restored", job_id=job_id)
                self._pending[job_id] = segment
                self._open[segment] = self._open.get(segment, 0) + 1
        if repaired:
            fsync_dir(self.registry.jobs_dir)
        self._segment = self._current = max(segments, default=0) + 1
        for segment in segments:
            if self._open.get(segment, 0) == 0:
                self._open.pop(segment, None)
                self._drop(segment)
        return repaired

    def _segments(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ConfigError(
                f"{self.root}: the journal of submissions cannot be read: {exc.strerror}; "
                "fix or move it aside (a job it holds that a kill cut is then lost)"
            ) from None
        return sorted(int(n[:-6]) for n in names if n.endswith(".jsonl") and n[:-6].isdigit())

    def _whole(self, record: JobRecord, rows: list[dict[str, Any]] | None) -> bool | None:
        """Whether the job's folder holds its record and rows; None when its record
        there is settled (the journal has nothing more to say of it)."""
        found = self.registry.read(self.registry.job_dir(record.job_id))
        if not isinstance(found, JobRecord) or found.digest != record.digest:
            return False
        if found.state in SETTLED_STATES:
            return None
        if rows is None or record.rows_file is None:
            return True
        try:
            held = (self.registry.job_dir(record.job_id) / record.rows_file).read_bytes()
        except FileNotFoundError:
            return False
        return held == b"".join(rows_lines(rows))


def _entries(path: Path) -> Iterator[tuple[JobRecord, list[dict[str, Any]] | None]]:
    """A segment's whole lines; a torn one (never fsynced, so never answered) is skipped."""
    for line in path.read_bytes().splitlines():
        try:
            data = jsonx.loads(line)
            record = JobRecord.from_json(data["record"])
        except (orjson.JSONDecodeError, BadRecord, KeyError, TypeError):
            log.warning("journal_line_skipped", path=str(path), bytes=len(line))
            continue
        yield record, data["rows"]
