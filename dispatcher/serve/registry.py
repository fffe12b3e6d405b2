"""The state directory of ``dispatcher serve``: its lock, the policy version and the jobs.

Layout (crash-only, like a run's files):

    DIR/serve.lock              flock held by the daemon using DIR (exit 2 if taken)
    DIR/policy.json             the last policy version V a trainer set
    DIR/jobs/<job_id>/job.json  the job's spec, submission order and, once final, state
    DIR/jobs/<job_id>/rows.jsonl        the submitted rows (a job given ``input`` has none)
    DIR/jobs/<job_id>/rollouts.jsonl    the job's output and its A4 sidecars
    DIR/jobs/<job_id>/groups.jsonl      complete groups in completion order (groups.py)

``job.json`` is written (atomically) before the job's first file, so a job
whose record exists is a job the daemon accepted; after a kill -9 every
record not marked done or cancelled is resumed.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from dispatcher.errors import ConfigError
from dispatcher.files.writer import RunLock, write_json_atomic
from dispatcher.serve.spec import JobSpec

# Final for good: a restart leaves these jobs alone.
SETTLED_STATES = ("done", "cancelled")


@dataclass
class JobRecord:
    """What ``job.json`` holds."""

    spec: JobSpec
    digest: str
    submitted_seq: int
    submitted_at: str
    state: str | None = None
    error: str | None = None
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
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobRecord:
        known = {"spec", "digest", "submitted_seq", "submitted_at", "state", "error"}
        return cls(
            spec=JobSpec.model_validate(data["spec"]),
            digest=data["digest"],
            submitted_seq=data["submitted_seq"],
            submitted_at=data["submitted_at"],
            state=data.get("state"),
            error=data.get("error"),
            extra={k: v for k, v in data.items() if k not in known},
        )


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

    def read(self, job_id: str) -> JobRecord | None:
        """The job's record; None when there is none."""
        path = self.job_dir(job_id) / "job.json"
        try:
            return JobRecord.from_json(orjson.loads(path.read_bytes()))
        except FileNotFoundError:
            return None
        except (orjson.JSONDecodeError, KeyError, ValueError) as exc:
            raise ConfigError(f"{path}: not a job record ({exc})") from None

    def create(self, record: JobRecord) -> Path:
        """Make the job's folder with its record in it; a folder already there is refused."""
        folder = self.job_dir(record.job_id)
        try:
            folder.mkdir()
        except FileExistsError:
            raise ConfigError(f"{folder}: exists without this job's record") from None
        try:
            write_json_atomic(folder / "job.json", record.to_json())
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return folder

    def save(self, record: JobRecord) -> None:
        write_json_atomic(self.job_dir(record.job_id) / "job.json", record.to_json())

    def all(self) -> list[JobRecord]:
        """Every job's record, in submission order."""
        records = []
        for folder in sorted(self.jobs_dir.iterdir()):
            record = self.read(folder.name)
            if record is not None:
                records.append(record)
        return sorted(records, key=lambda r: r.submitted_seq)

    def read_policy(self) -> int:
        with contextlib.suppress(FileNotFoundError, orjson.JSONDecodeError, KeyError, TypeError):
            return int(orjson.loads((self.root / "policy.json").read_bytes())["version"])
        return 0

    def save_policy(self, version: int) -> None:
        write_json_atomic(self.root / "policy.json", {"version": version})


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
