"""The state directory of ``dispatcher serve``: its lock, the policy version and the jobs.

Layout (crash-only, like a run's files):

    DIR/serve.lock              flock held by the daemon using DIR (exit 2 if taken)
    DIR/policy.json             the last policy version V a trainer set
    DIR/jobs/<job_id>/job.json  the job's spec, submission order and, once final, state
    DIR/jobs/<job_id>/rows.jsonl        the submitted rows (a job given ``input`` has none)
    DIR/jobs/<job_id>/rollouts.jsonl    the job's output and its §4 sidecars
    DIR/jobs/<job_id>/groups.jsonl      complete groups in completion order (groups.py)

``job.json`` is written (atomically) before the job's first file, so a job
whose record exists is a job the daemon accepted; after a kill -9 every
record not marked done, cancelled or satisfied is resumed.

Damage is named, never a crash: a ``policy.json`` that cannot be read is a
``ConfigError`` (exit 2) naming it; a job folder whose record cannot be read
(not JSON, the wrong shape, a bad spec, or no ``job.json`` beside other
files) is an ``Unreadable`` job, listed as failed with a one-line reason
while the other jobs go on; a stray file in ``jobs/`` is left alone.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import structlog
from pydantic import ValidationError

from dispatcher.errors import ConfigError
from dispatcher.files.writer import RunLock, write_json_atomic
from dispatcher.lifecycle import JobState
from dispatcher.serve.spec import JobSpec, first_error

log = structlog.get_logger("dispatcher.serve")

# Final for good: a restart leaves these jobs alone.
SETTLED_STATES = frozenset({JobState.DONE, JobState.CANCELLED, JobState.SATISFIED})


@dataclass
class JobRecord:
    """What ``job.json`` holds."""

    spec: JobSpec
    digest: str
    submitted_seq: int
    submitted_at: str
    state: JobState | None = None
    error: str | None = None
    # Once final: the job's outcomes over all its passes, for its status after a restart.
    outcomes: dict[str, int] | None = None
    # Once final, a job with a target: its step's figures (``step.StepControl.figures``).
    step: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def job_id(self) -> str:
        assert self.spec.job_id is not None
        return self.spec.job_id

    def to_json(self) -> dict[str, Any]:
        return {
            **self.extra,
            "spec": self.spec.model_dump(mode="json"),
            "digest": self.digest,
            "submitted_seq": self.submitted_seq,
            "submitted_at": self.submitted_at,
            "state": self.state,
            "error": self.error,
            "outcomes": self.outcomes,
            **({"step": self.step} if self.step is not None else {}),
        }

    @classmethod
    def from_json(cls, data: Any) -> JobRecord:
        """The record ``job.json`` holds; ``BadRecord`` naming what is wrong."""
        if not isinstance(data, dict):
            raise BadRecord(f"not a JSON object but {type(data).__name__}")
        try:
            spec = JobSpec.model_validate(data.get("spec"))
        except ValidationError as exc:
            raise BadRecord(f"spec: {first_error(exc)}") from None
        if spec.job_id is None:
            raise BadRecord("spec: no job_id")
        fields: dict[str, Any] = {name: data.get(name) for name in _RECORD_TYPES}
        for name, (kinds, what) in _RECORD_TYPES.items():
            if type(fields[name]) not in kinds:
                raise BadRecord(f"{name}: must be {what}, got {_short(fields[name])}")
        if fields["state"] is not None:
            try:
                fields["state"] = JobState(fields["state"])
            except ValueError:
                states = ", ".join(s.value for s in JobState)
                raise BadRecord(f"state: {_short(fields['state'])} is none of {states}") from None
        known = {"spec", *_RECORD_TYPES}
        return cls(
            spec=spec,
            **fields,
            extra={k: v for k, v in data.items() if k not in known},
        )


# The record's fields besides its spec: the types a field may have (``type`` is
# matched exactly, so a bool is not an int), and how to say it.
_RECORD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "digest": ((str,), "a string"),
    "submitted_seq": ((int,), "an integer"),
    "submitted_at": ((str,), "a string"),
    "state": ((str, type(None)), "a string or null"),
    "error": ((str, type(None)), "a string or null"),
    "outcomes": ((dict, type(None)), "an object or null"),
    "step": ((dict, type(None)), "an object or null"),
}


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
            self.jobs_dir.mkdir(parents=True, exist_ok=True)
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
            data = orjson.loads(path.read_bytes())
        except FileNotFoundError:
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

    def create(self, record: JobRecord) -> Path:
        """Make the job's folder with its record in it; a folder already there is refused."""
        folder = self.job_dir(record.job_id)
        try:
            folder.mkdir()
        except FileExistsError:
            # An empty folder is a submission a kill cut before its record: reused.
            if not folder.is_dir() or _holds_files(folder):
                raise ConfigError(
                    f"{folder}: exists without this job's record; move it aside to submit "
                    "this job_id again"
                ) from None
        try:
            write_json_atomic(folder / "job.json", record.to_json())
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return folder

    def save(self, record: JobRecord) -> None:
        write_json_atomic(self.job_dir(record.job_id) / "job.json", record.to_json())

    def all(self) -> list[JobRecord | Unreadable]:
        """Every job: the records in submission order, then the unreadable ones.
        Stray files and empty folders are left out (and logged)."""
        records: list[JobRecord] = []
        unreadable: list[Unreadable] = []
        for folder in sorted(self.jobs_dir.iterdir()):
            if not folder.is_dir():
                log.warning("state_dir_stray_file", path=str(folder), action="ignored")
                continue
            record = self.read(folder)
            if isinstance(record, JobRecord):
                records.append(record)
            elif record is not None:
                unreadable.append(record)
            else:
                log.warning("state_dir_empty_job_folder", path=str(folder), action="ignored")
        return [*sorted(records, key=lambda r: r.submitted_seq), *unreadable]

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

    def probe(self) -> None:
        """Write a small file to the state directory: raises while it cannot be written."""
        self.scratch.mkdir(exist_ok=True)
        write_json_atomic(self.scratch / "probe.json", {"at": now_iso()})


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _holds_files(folder: Path) -> bool:
    """Whether a job folder holds anything but an interrupted ``job.json`` write."""
    return any(entry.name != ".job.json.tmp" for entry in folder.iterdir())
