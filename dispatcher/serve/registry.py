"""The state directory of ``dispatcher serve``: its lock, the policy version and the jobs.

Layout (crash-only, like a run's files):

    DIR/serve.lock              flock held by the daemon using DIR (exit 2 if taken)
    DIR/policy.json             the last policy version V a trainer set
    DIR/admission.json          the admission pause: on until a wall-clock time, or off
    DIR/jobs/<job_id>/job.json  the job's spec (without rows), body digest, submission
                                order and, once final, state and final status: one line
    DIR/jobs/<job_id>/input.jsonl       the submitted rows (a job given ``input`` has none;
                                        older daemons wrote rows.jsonl)
    DIR/jobs/<job_id>/rollouts.jsonl    the job's output and its §4 sidecars
    DIR/jobs/<job_id>/groups.jsonl      complete groups in completion order (groups.py)

A job's rows live in its files only: ``input.jsonl`` is written (atomically)
first, then ``job.json`` (atomically) before any other file of the job, so a
job whose record exists is a job the daemon accepted, with its rows (a
folder with rows but no record is a submission a kill cut, reused); after a kill -9 every
record not marked done, cancelled or satisfied is resumed.

Damage is named, never a crash: a ``policy.json`` that cannot be read is a
``ConfigError`` (exit 2) naming it; a job folder whose record cannot be read
(not JSON, the wrong shape, a bad spec, or no ``job.json`` beside other
files) is an ``Unreadable`` job, listed as failed with a one-line reason
while the other jobs go on; a stray file in ``jobs/`` is left alone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson
import structlog
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from dispatcher import jsonx
from dispatcher.errors import ConfigError
from dispatcher.files.atomic import (
    RunLock,
    fsync_file,
    is_temp_of,
    make_dirs,
    write_atomic,
    write_json_atomic,
)
from dispatcher.lifecycle import JobState
from dispatcher.run.job_figures import end_files
from dispatcher.serve.spec import STORED, JobSpec

log = structlog.get_logger("dispatcher.serve")

# Final for good: a restart leaves these jobs alone.
SETTLED_STATES = frozenset({JobState.DONE, JobState.CANCELLED, JobState.SATISFIED})


class JobRecord(BaseModel):
    """What ``job.json`` holds: the job's spec without its rows (they are in
    ``rows_file``, the job's own task file), its identity and, once final, how
    it ended. Keys it does not know are kept (``extra``), as they were read."""

    model_config = ConfigDict(extra="allow")

    spec: JobSpec
    digest: StrictStr
    submitted_seq: StrictInt
    submitted_at: StrictStr
    state: JobState | None = None
    error: StrictStr | None = None
    # Once final: the job's outcomes over all its passes, for its status after a restart.
    outcomes: dict[StrictStr, StrictInt] | None = None
    # Once final, a job with a target: its step's figures (``step.StepControl.figures``).
    step: dict[str, Any] | None = None
    # A job submitted with inline rows: their file in the job's folder.
    rows_file: StrictStr | None = None
    # Once final: the status the job ended with, served from here from then on.
    final_status: dict[str, Any] | None = None

    @property
    def job_id(self) -> str:
        assert self.spec.job_id is not None
        return self.spec.job_id

    def to_json(self) -> bytes:
        """The record as ``job.json``'s bytes: one compact line, no rows."""
        data = self.model_dump(mode="json", exclude_none=True, exclude={"spec"})
        data["spec"] = self.spec.model_dump(mode="json", exclude={"rows"})
        # Always present, even before the job is final: readers look for them.
        for name in ("state", "error", "outcomes"):
            data.setdefault(name, None)
        return jsonx.dumps(data, option=orjson.OPT_APPEND_NEWLINE)

    @classmethod
    def from_json(cls, data: Any) -> JobRecord:
        """The record ``job.json`` holds; ``BadRecord`` naming what is wrong."""
        if not isinstance(data, dict):
            raise BadRecord(f"not a JSON object but {type(data).__name__}")
        spec = data.get("spec")
        if isinstance(spec, dict) and spec.get("rows") is not None:
            # Written before rows lived in their own file: they are in rows.jsonl.
            spec = {**spec, "rows": None}
            data = {"rows_file": LEGACY_ROWS_FILE, **data, "spec": spec}
        try:
            record = cls.model_validate(data, context=STORED)
        except ValidationError as exc:
            error = exc.errors()[0]
            if error["loc"][:1] == ("spec",):
                where = ".".join(str(part) for part in error["loc"][1:])
                message = str(error["msg"]).removeprefix("Value error, ")
                raise BadRecord(
                    f"spec: {where}: {message}" if where else f"spec: {message}"
                ) from None
            where = ".".join(str(part) for part in error["loc"])
            what = _KINDS.get(error["type"], str(error["msg"]))
            raise BadRecord(f"{where}: {what}, got {_short(error['input'])}") from None
        if record.spec.job_id is None:
            raise BadRecord("spec: no job_id")
        return record


# How a record's wrong field is named, by pydantic's error type.
_KINDS = {
    "int_type": "must be an integer",
    "string_type": "must be a string",
    "dict_type": "must be an object or null",
    "enum": "is not a job state",
    "missing": "missing",
}

# The task file of a job submitted with rows, in its folder; older daemons named it so.
ROWS_FILE = "input.jsonl"
# A job's output, its rows (its sidecars are named after it).
OUTPUT_FILE = "rollouts.jsonl"
LEGACY_ROWS_FILE = "rows.jsonl"


class BadRecord(Exception):
    """A ``job.json`` that cannot be read: the one-line reason."""


@dataclass(frozen=True)
class Unreadable:
    """A job folder whose record cannot be read: listed as a failed job, never run."""

    job_id: str
    folder: Path
    reason: str


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Registry:
    """Reads and writes the state directory (blocking calls: run them in a thread)."""

    def __init__(self, state_dir: Path) -> None:
        self.root = state_dir
        self.jobs_dir = state_dir / "jobs"
        self.scratch = state_dir / "tmp"
        self._lock = RunLock(state_dir / "serve.lock")

    def lock(self) -> None:
        """Take the state directory; another daemon on it is a ``ConfigError`` (exit 2)."""
        try:
            make_dirs(self.jobs_dir)
        except OSError as exc:
            raise ConfigError(
                f"--state-dir {self.root}: cannot create it: {exc.strerror}"
            ) from None
        try:
            self._lock.acquire()
        except ConfigError:
            raise ConfigError(
                f"--state-dir {self.root}: another dispatcher serve is using it "
                f"(lock {self._lock.path})"
            ) from None
        # A scratch left by a kill -9 during a job's validation holds nothing.
        shutil.rmtree(self.scratch, ignore_errors=True)

    def unlock(self) -> None:
        self._lock.release()

    def job_dir(self, job_id: str) -> Path:
        return self.jobs_dir / job_id

    def read(self, folder: Path) -> JobRecord | Unreadable | None:
        """The record of a job's folder; ``Unreadable`` naming the damage; None for an
        empty folder (a submission a kill cut before its record was written)."""
        path = folder / "job.json"
        try:
            data = jsonx.loads(path.read_bytes())
        except FileNotFoundError:
            if not folder.is_dir():
                return Unreadable(folder.name, folder, f"{folder}: the job's folder is gone")
            if not _holds_files(folder):
                return None
            reason = f"{path}: missing (the folder holds other files)"
            return Unreadable(folder.name, folder, reason)
        except orjson.JSONDecodeError as exc:
            return Unreadable(folder.name, folder, f"{path}: not valid JSON ({exc})")
        except OSError as exc:
            return Unreadable(folder.name, folder, f"{path}: cannot be read: {exc.strerror}")
        try:
            record = JobRecord.from_json(data)
        except BadRecord as exc:
            return Unreadable(folder.name, folder, f"{path}: not a job record: {exc}")
        if record.job_id != folder.name:
            reason = f"{path}: not a job record: its job_id is {record.job_id!r}"
            return Unreadable(folder.name, folder, reason)
        return record

    def create(self, record: JobRecord, rows: list[dict[str, Any]] | None) -> Path:
        """Make the job's folder with its rows file (when given rows) and its record in
        it, each written atomically and fsynced, the record last; a folder already
        there is refused (``claim``)."""
        folder = self.claim(record.job_id)
        try:
            self.write_job(record, rows, durable=True)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return folder

    def claim(self, job_id: str) -> Path:
        """The job's folder, made empty (an empty one, a submission a kill cut, is
        reused); a ``ConfigError`` when it holds another job's files."""
        folder = self.job_dir(job_id)
        try:
            folder.mkdir()
        except FileExistsError:
            if not folder.is_dir() or _holds_files(folder):
                raise ConfigError(
                    f"{folder}: exists without this job's record; move it aside to submit "
                    "this job_id again"
                ) from None
        return folder

    def write_job(
        self, record: JobRecord, rows: list[dict[str, Any]] | None, *, durable: bool
    ) -> None:
        """The rows file (when given rows), then the record, each atomically, into the
        job's claimed folder; fsynced when ``durable`` (else the journal of
        submissions holds them, ``journal.py``)."""
        folder = self.job_dir(record.job_id)
        folder.mkdir(exist_ok=True)
        if rows is not None:
            assert record.rows_file is not None
            write_atomic(folder / record.rows_file, rows_lines(rows), durable=durable)
        write_atomic(folder / "job.json", [record.to_json()], durable=durable)

    def save(self, record: JobRecord) -> None:
        write_atomic(self.job_dir(record.job_id) / "job.json", [record.to_json()])

    def save_final(self, record: JobRecord) -> None:
        """A final record, durably, its rows file and the files the end of its last
        hop wrote without fsync (``HopEnd``) fsynced first: from here on the job
        needs nothing of the journal of submissions (``journal.py``), and a final
        record read after a crash has every file of its job whole."""
        files = end_files(self.job_dir(record.job_id) / OUTPUT_FILE)
        if record.rows_file is not None:
            files.append(self.job_dir(record.job_id) / record.rows_file)
        for path in files:
            with contextlib.suppress(FileNotFoundError):
                fsync_file(path)
        # Its folder's fsync (``write_atomic``) makes their names durable too.
        self.save(record)

    def all(self) -> list[JobRecord | Unreadable]:
        """Every job: the records in submission order, then the unreadable ones."""
        return in_submission_order(self.each())

    def each(self) -> Iterator[JobRecord | Unreadable]:
        """Every job's record, one folder at a time (a caller keeps what it needs of
        each, not every record at once). Stray files and empty folders are left out
        (and logged)."""
        for folder in sorted(self.jobs_dir.iterdir()):
            if not folder.is_dir():
                log.warning("state_dir_stray_file", path=str(folder), action="ignored")
                continue
            record = self.read(folder)
            if record is None:
                log.warning("state_dir_empty_job_folder", path=str(folder), action="ignored")
            else:
                yield record

    def read_policy(self) -> int:
        """The policy version last set; 0 without ``policy.json``; a ``ConfigError``
        (exit 2) naming the file when it cannot be read: never a silent 0, which
        would hold every paced job back."""
        path = self.root / "policy.json"
        fix = "fix or remove it to start at version 0"
        try:
            data = orjson.loads(path.read_bytes())
        except FileNotFoundError:
            return 0
        except orjson.JSONDecodeError:
            raise ConfigError(f"{path}: not valid JSON; {fix}") from None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot be read: {exc.strerror}; {fix}") from None
        version = data.get("version") if isinstance(data, dict) else None
        if type(version) is not int or version < 0:
            shown = _short(version) if isinstance(data, dict) else _short(data)
            raise ConfigError(f'{path}: "version" must be an integer >= 0, got {shown}; {fix}')
        return version

    def save_policy(self, version: int) -> None:
        write_json_atomic(self.root / "policy.json", {"version": version})

    def save_admission(self, until_unix: float | None, reason: str | None) -> None:
        """The admission pause: on until ``until_unix`` (wall clock, so a restart
        knows how much of it is left), or off (None)."""
        data = {"paused": until_unix is not None, "until_unix": until_unix, "reason": reason}
        write_json_atomic(self.root / ADMISSION_FILE, data)

    def read_admission(self) -> tuple[float, str | None] | None:
        """The pause the last daemon left on: (its end, wall clock; its reason); None
        without one. A file that cannot be read is a ``ConfigError`` (exit 2)
        naming it: never a silent resume in the middle of a weight update."""
        path = self.root / ADMISSION_FILE
        fix = "fix or remove it to start without an admission pause"
        try:
            data = jsonx.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except orjson.JSONDecodeError:
            raise ConfigError(f"{path}: not valid JSON; {fix}") from None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot be read: {exc.strerror}; {fix}") from None
        if not isinstance(data, dict) or type(data.get("paused")) is not bool:
            raise ConfigError(f'{path}: not an object with "paused": true or false; {fix}')
        if not data["paused"]:
            return None
        until, reason = data.get("until_unix"), data.get("reason")
        if not isinstance(until, int | float) or not isinstance(reason, str | None):
            raise ConfigError(f'{path}: "until_unix" must be a number, "reason" a string; {fix}')
        return float(until), reason

    def missing(self) -> str | None:
        """Why the state directory cannot take a job's files, found without writing
        (a few stat calls, for every ``/healthz``); None when it can."""
        for folder in (self.root, self.jobs_dir):
            if not folder.is_dir():
                return f"{folder}: no such directory (the state directory was removed?)"
            if not os.access(folder, os.W_OK | os.X_OK):
                return f"{folder}: not writable by the daemon"
        return None

    def probe(self) -> None:
        """Write a small file to the state directory: raises while it cannot be written."""
        self.scratch.mkdir(exist_ok=True)
        write_json_atomic(self.scratch / "probe.json", {"at": now_iso()})


_Job = TypeVar("_Job")


def in_submission_order(jobs: Iterable[_Job]) -> list[_Job]:
    """Jobs in submission order, then the unreadable ones (in folder order: the sort
    is stable)."""
    return sorted(
        jobs, key=lambda job: (isinstance(job, Unreadable), getattr(job, "submitted_seq", 0))
    )


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# The admission pause (contracts §13), so that it outlives the daemon.
ADMISSION_FILE = "admission.json"


def _cut_submission(name: str) -> bool:
    """What a submission a kill cut before its record leaves: the folder is reused."""
    return name == ROWS_FILE or any(is_temp_of(name, f) for f in ("job.json", ROWS_FILE))


def _holds_files(folder: Path) -> bool:
    """Whether a job folder holds anything but what a submission cut before its
    record leaves (its rows file, an interrupted write)."""
    return not all(_cut_submission(entry.name) for entry in folder.iterdir())


def rows_lines(rows: list[dict[str, Any]]) -> Iterator[bytes]:
    """The rows file's lines, as the job's folder holds them."""
    for row in rows:
        yield jsonx.dumps(row, option=orjson.OPT_APPEND_NEWLINE)
