"""Settled jobs folded into archives: 100,000 small jobs cost a bounded number of
files, no memory, and nothing at restart (contracts §12).

Every ``--retain-settled-jobs`` N settled jobs (done, cancelled, satisfied), in
the order they settled, are folded into one archive: their folders' files go
into one tar file, their identity into the archive index, and their folders
are removed. ``jobs/`` thus holds the running jobs, the failed or incomplete
ones and fewer than N settled ones; ``archive/`` one tar per N settled jobs
and the index. An archived job keeps its rows and status: it answers its
status and its results stream, read from the tar by offset, as before.

    DIR/archive/index.sqlite    job_id -> its archive, submission order, digest,
                                state, error, satisfied line, and where each of
                                its files is in the tar (offset, size)
    DIR/archive/NNNNNN.tar      the files of one window of settled jobs, as
                                ``<job_id>/<file>`` members (``tar tf`` lists them)

A fold, in three steps, crash-safe at any instant (the index's transaction is
the commit point):

1. the tar is written as ``NNNNNN.tar.part``, fsynced, renamed, its folder fsynced;
2. one transaction puts the window's jobs in the index;
3. the jobs' folders are removed.

At start, before the registry is read (``recover``): a ``.part``, or a tar the
index does not name, is a fold cut in step 1 or 2 (the folders are whole): it
is removed; a folder whose job the index holds is a fold cut in step 3: it is
removed. So a job is in its folder or in an archive, never both, never neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import structlog

from dispatcher import jsonx
from dispatcher.errors import ConfigError
from dispatcher.files.atomic import fsync_dir, make_dirs, remove_folder, remove_folders
from dispatcher.files.contracts import JobStatus, RunManifest, max_attempts_for
from dispatcher.files.resume import OutputPaths
from dispatcher.files.writer import LineIndex
from dispatcher.lifecycle import JobState
from dispatcher.serve.archived_ids import ArchivedIds, Bits, bits_of
from dispatcher.serve.final import FinalJob, saved_status, unknown_completion
from dispatcher.serve.registry import BadRecord, JobRecord, Registry
from dispatcher.serve.results import Source
from dispatcher.serve.tarpack import write_tar

log = structlog.get_logger("dispatcher.serve")

INDEX_FILE = "index.sqlite"
PART = ".part"
# The index's page cache, KiB.
CACHE_KIB = 256
# Lines of a member indexed per read.
READ_BYTES = 1 << 20

_SCHEMA = """
CREATE TABLE IF NOT EXISTS archives (number INTEGER PRIMARY KEY, jobs INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, archive INTEGER NOT NULL, submitted_seq INTEGER NOT NULL,
    digest TEXT NOT NULL, state TEXT NOT NULL, error TEXT, satisfied_seq INTEGER,
    members TEXT NOT NULL
);
"""

# The steps of a fold a test may stop after (as a kill would); the third is ``remove``.
STEPS = ("tar_written", "indexed")


# A job's files in its folder, as an archive member names them.
_FILES = OutputPaths.for_output(Path("rollouts.jsonl"))


@dataclass(frozen=True, slots=True)
class Folded:
    """What the index keeps of one settled job (``FinalJob``'s fields)."""

    job_id: str
    submitted_seq: int
    digest: str
    state: JobState
    error: str | None
    satisfied_seq: int | None


@dataclass(frozen=True, slots=True)
class ArchivedJob:
    """A settled job read from the index: where its files are in its archive."""

    job_id: str
    tar: Path
    state: JobState
    error: str | None
    submitted_seq: int
    digest: str
    satisfied_seq: int | None
    # file name in its folder -> (offset of its bytes in the tar, size)
    members: dict[str, tuple[int, int]]

    def read(self, name: str) -> bytes | None:
        """One of its files, whole (blocking); None when it had none of that name."""
        where = self.members.get(name)
        if where is None:
            return None
        with self.tar.open("rb") as f:
            f.seek(where[0])
            return f.read(where[1])

    def record(self) -> JobRecord:
        """Its ``job.json`` (blocking)."""
        data = self.read("job.json")
        assert data is not None
        return JobRecord.from_json(jsonx.loads(data))

    @property
    def task(self) -> None:
        """Nothing runs for it."""
        return None

    def cancel(self) -> None:
        """Nothing of it runs."""

    def read_status(self) -> dict[str, Any]:
        """Its status from its archived ``job.json`` (blocking), as a final job's."""
        error = self.error
        try:
            status = saved_status(self.record())
        except (OSError, BadRecord, orjson.JSONDecodeError) as exc:
            status, error = None, error or f"{self.tar}: its record cannot be read: {exc}"
        if status is None:
            status = JobStatus(self.job_id, self.state, True).to_json()
        output = f"{self.tar}:{self.job_id}/rollouts.jsonl"
        return {
            **status,
            "state": self.state.value,
            "final": True,
            "error": error,
            "output": output,
            "archive": str(self.tar),
        }

    async def source(self) -> Source:
        """Its results read from its archive, for this stream alone."""
        rows = await asyncio.to_thread(self.index, "rollouts.jsonl")
        groups = await asyncio.to_thread(self.index, "groups.jsonl")
        failures = await asyncio.to_thread(self.index, _FILES.failures.name)
        manifest = await asyncio.to_thread(self._manifest)
        return Source(
            self.tar, rows, self.tar, groups, lambda: self.state.value, unknown_completion,
            lambda: self.error, lambda: self.satisfied_seq,
            failures_path=self.tar, failures=failures,
            attempt_cap=max_attempts_for(None, manifest),
        )  # fmt: skip

    def _manifest(self) -> RunManifest | None:
        """Its run manifest (blocking): its attempt cap says which failure lines are final."""
        data = self.read(_FILES.manifest.name)
        return None if data is None else RunManifest.parse(orjson.loads(data))

    def index(self, name: str) -> LineIndex:
        """A line index of one of its files, at its offsets in the tar (blocking)."""
        index = LineIndex()
        where = self.members.get(name)
        if where is not None:
            _index_member(index, self.tar, *where)
        return index


def _index_member(index: LineIndex, tar: Path, offset: int, size: int) -> None:
    """Index the whole lines of ``size`` bytes at ``offset`` of ``tar``, a chunk at a time
    (a torn tail is never indexed)."""
    line_start = chunk_start = offset
    with tar.open("rb") as f:
        f.seek(offset)
        left = size
        while left > 0 and (chunk := f.read(min(READ_BYTES, left))):
            left -= len(chunk)
            at = 0
            while (newline := chunk.find(b"\n", at)) >= 0:
                index.starts.append(line_start)
                line_start = chunk_start + newline + 1
                at = newline + 1
            chunk_start += len(chunk)
    index.end = line_start


class Archive:
    """The archives of one state directory and their index (blocking calls: run them in
    a thread; one connection, used under a lock)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.root = registry.root / "archive"
        make_dirs(self.root)
        path = self.root / INDEX_FILE
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            self._db.execute("PRAGMA synchronous=FULL")
            # The index grows ~540 bytes a job; sqlite's page cache (2 MB by default)
            # filled with it over the first ~5,000 jobs. A lookup by id reads a few
            # pages, a fold's inserts read theirs back from the OS's cache.
            self._db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
            self._db.executescript(_SCHEMA)
            self._db.execute("SELECT COUNT(*) FROM jobs").fetchall()
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise ConfigError(
                f"{path}: not an archive index ({exc}); restore it from a backup (the "
                "archives' jobs are unknown without it)"
            ) from None
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def tar_path(self, number: int) -> Path:
        return self.root / f"{number:06d}.tar"

    # ---- start ----------------------------------------------------------------------

    def recover(self) -> None:
        """Undo what a fold cut by a kill left (see the module's docstring)."""
        known = {n for (n,) in self._query("SELECT number FROM archives")}
        for path in self.root.iterdir():
            name = path.name
            if name.endswith(PART) or (name.endswith(".tar") and _number(name) not in known):
                path.unlink()
                log.warning("archive_cut_removed", path=str(path))
        for folder in self.registry.jobs_dir.iterdir():
            if folder.is_dir() and self._has(folder.name):
                remove_folder(folder)
                log.warning("archived_folder_removed", path=str(folder))
        fsync_dir(self.registry.jobs_dir)

    def last_seq(self) -> int:
        """The highest submission order of an archived job (0 without one)."""
        ((seq,),) = self._query("SELECT COALESCE(MAX(submitted_seq), 0) FROM jobs")
        return int(seq)

    def count(self) -> int:
        ((n,),) = self._query("SELECT COUNT(*) FROM jobs")
        return int(n)

    def ids(self) -> Bits:
        """Every archived job's id in a filter (blocking: a walk of the index)."""
        with self._lock:
            ((count,),) = self._db.execute("SELECT COUNT(*) FROM jobs").fetchall()
            cursor = self._db.execute("SELECT job_id FROM jobs")
            return bits_of((job_id for (job_id,) in cursor), count)

    # ---- lookups --------------------------------------------------------------------

    def find(self, job_id: str) -> ArchivedJob | None:
        """An archived job by id (blocking: one index lookup)."""
        rows = self._query(
            "SELECT archive, state, error, submitted_seq, digest, satisfied_seq, members "
            "FROM jobs WHERE job_id = ?",
            (job_id,),
        )
        if not rows:
            return None
        number, state, error, seq, digest, satisfied, members = rows[0]
        where = {name: (int(at[0]), int(at[1])) for name, at in orjson.loads(members).items()}
        return ArchivedJob(
            job_id, self.tar_path(number), JobState(state), error, seq, digest, satisfied, where
        )

    def has(self, job_id: str) -> bool:
        """Whether the job is archived (blocking: one index lookup)."""
        return self._has(job_id)

    def _has(self, job_id: str) -> bool:
        return bool(self._query("SELECT 1 FROM jobs WHERE job_id = ?", (job_id,)))

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # ---- a fold ---------------------------------------------------------------------

    def commit(self, jobs: list[Folded], step: Callable[[str], None] = lambda _: None) -> int:
        """Steps 1 and 2 of a fold: the jobs' files in a new archive, the jobs in the
        index; its number (blocking). ``step`` is called after each step (``STEPS``): a
        test stops a fold there as a kill would. The folders are still there."""
        ((last,),) = self._query("SELECT COALESCE(MAX(number), 0) FROM archives")
        number = int(last) + 1
        members = self._write_tar(number, jobs)
        step(STEPS[0])
        self._index(number, jobs, members)
        step(STEPS[1])
        return number

    def remove(self, jobs: list[Folded]) -> None:
        """Step 3 of a fold, once no one reads the jobs from their folders: the folders
        go (blocking)."""
        remove_folders([self.registry.job_dir(job.job_id) for job in jobs])
        fsync_dir(self.registry.jobs_dir)

    def _write_tar(self, number: int, jobs: list[Folded]) -> list[dict[str, list[int]]]:
        """Step 1: the jobs' files in ``NNNNNN.tar``, durable; where each file is."""
        path = self.tar_path(number)
        part = path.with_name(path.name + PART)
        out = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            folders = ((job.job_id, self.registry.job_dir(job.job_id)) for job in jobs)
            where = write_tar(out, folders)
            os.fsync(out)
        finally:
            os.close(out)
        part.rename(path)
        fsync_dir(self.root)
        return where

    def _index(self, number: int, jobs: list[Folded], members: list[dict[str, list[int]]]) -> None:
        """Step 2, the commit point: the jobs in the index, in one transaction."""
        rows = [
            (
                job.job_id,
                number,
                job.submitted_seq,
                job.digest,
                job.state.value,
                job.error,
                job.satisfied_seq,
                orjson.dumps(where).decode(),
            )
            for job, where in zip(jobs, members, strict=True)
        ]
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("INSERT INTO archives VALUES (?, ?)", (number, len(jobs)))
                db.executemany("INSERT INTO jobs VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")


def _number(name: str) -> int | None:
    stem = name.removesuffix(".tar")
    return int(stem) if stem.isdigit() else None


class Compaction:
    """Owns the folds of one service: settled jobs wait here in the order they settled,
    and every ``window`` of them go to an archive, one fold at a time. A job that a
    results stream reads from its folder waits for the next fold, which the end of
    that stream starts when no job settles meanwhile."""

    def __init__(
        self,
        archive: Archive,
        window: int,
        jobs: dict[str, Any],
        write: Callable[..., Awaitable[Any]],
    ) -> None:
        self.archive = archive
        self.window = window
        # The service's jobs: a folded job leaves them (it is found in the index).
        self.jobs = jobs
        self.write = write
        self.waiting: dict[str, FinalJob] = {}
        self.archived = 0
        # Folds whose jobs left ``jobs`` (for the index): a lookup since the last one
        # that missed a job in ``jobs`` must look in the index again.
        self.committed = 0
        # Archived jobs whose folders a stream still reads.
        self._read: list[tuple[Folded, FinalJob]] = []
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        # The ids the archive may hold; the ones of the start come from ``load_ids``.
        self.ids = ArchivedIds()
        self._loading: asyncio.Task[None] | None = None

    def load_ids(self) -> None:
        """Read the ids archived so far into ``ids``, in a thread, after the start."""
        self._loading = asyncio.create_task(self._load_ids(), name="archive-ids")

    async def _load_ids(self) -> None:
        try:
            self.ids.load(await asyncio.to_thread(self.archive.ids))
        except Exception as exc:
            # Every id stays a "maybe": each submit looks in the index, as before.
            log.warning("archive_ids_not_loaded", error=str(exc))

    def settled(self, job: FinalJob) -> None:
        """A job is settled (or was, before a restart): it waits for its fold."""
        self.waiting[job.job_id] = job
        job.unread = self._unread
        self._start()

    def _start(self) -> None:
        if self._closed:
            return
        if len(self.waiting) >= self.window and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._folds(), name="archive-folds")
            self._loop = self._task.get_loop()

    def _unread(self) -> None:
        """The last stream reading a waiting job ended (on whatever thread let its index
        go): a fold that waited for it starts, whether or not another job settles."""
        if len(self.waiting) >= self.window and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the next start folds
                self._loop.call_soon_threadsafe(self._start)

    async def _folds(self) -> None:
        # A fold that fails (a full disk) is logged and tried again at the next job
        # that settles; nothing is lost: the folders stay until the index has them.
        while len(ready := self._ready()) == self.window:
            try:
                await self._fold(ready)
            except Exception as exc:
                log.error("archive_fold_failed", error=str(exc), exc_info=exc)
                return

    def _ready(self) -> list[FinalJob]:
        """The oldest ``window`` waiting jobs no stream reads (fewer if there are not)."""
        ready: list[FinalJob] = []
        for job in self.waiting.values():
            if not job.read_by_a_stream():
                ready.append(job)
                if len(ready) == self.window:
                    break
        return ready

    async def _fold(self, ready: list[FinalJob]) -> None:
        folded = [
            Folded(
                job.job_id, job.submitted_seq, job.digest, job.state, job.error, job.satisfied_seq
            )
            for job in ready
        ]
        await self.write(self.archive.commit, folded)
        # Committed: from here on the index answers for them, before their folders go.
        for job in ready:
            self.ids.add(job.job_id)
            del self.waiting[job.job_id]
            if self.jobs.get(job.job_id) is job:
                del self.jobs[job.job_id]
        self.committed += 1
        # A folder a stream began to read during the fold stays until a later fold
        # (or the next start) finds no stream on it.
        pairs = [*zip(folded, ready, strict=True), *self._read]
        read = [job.read_by_a_stream() for _, job in pairs]
        self._read = [pair for pair, busy in zip(pairs, read, strict=True) if busy]
        gone = [done for (done, _), busy in zip(pairs, read, strict=True) if not busy]
        await self.write(self.archive.remove, gone)
        self.archived += len(ready)

    async def close(self) -> None:
        """Let a fold under way end (it is crash-safe, but a whole one saves a redo)."""
        self._closed = True
        tasks = [task for task in (self._task, self._loading) if task is not None]
        if tasks:
            await asyncio.wait(tasks)
        await asyncio.to_thread(self.archive.close)
