"""``dispatcher status STATE_DIR``: the jobs of a ``dispatcher serve`` state directory.

Read from the files alone, as ``status OUTPUT`` reads a run, so it answers
whether the daemon is up or not (after a crash: what will the same command
resume?). Each job is a run of its own (contracts §12), reported with the
figures of ``status`` for its ``rollouts.jsonl``; a job the daemon accepted
but never started has no files yet and shows none.

A job's state is the final one its record holds (``done``, ``cancelled``,
``satisfied``, ``failed``, ``incomplete``), else ``unfinished``: a daemon
started on this directory resumes every job but the done, cancelled and
satisfied ones. A job whose
record cannot be read is ``failed`` with the reason (the daemon lists it the
same way and never runs it). Its counts are its files': every pass of it.

Exit code: 0 when every job is settled (done, cancelled or satisfied), 75 when some
would be resumed, 2 when the directory is not a state directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dispatcher.errors import ConfigError, ExitCode
from dispatcher.ops.runfiles import LockStatus, is_state_dir, lock_status
from dispatcher.ops.status import RunStatus, Standing, collect_status
from dispatcher.ops.table import JOB_HEADERS, format_table
from dispatcher.serve.registry import SETTLED_STATES, JobRecord, Registry, Unreadable

UNFINISHED = "unfinished"


@dataclass
class JobStanding:
    """One job: its record and, once its files exist, its run's status."""

    record: JobRecord | Unreadable
    run: RunStatus | None

    @property
    def job_id(self) -> str:
        return self.record.job_id

    @property
    def state(self) -> str:
        if isinstance(self.record, Unreadable):
            return "failed"
        return self.record.state or UNFINISHED

    @property
    def settled(self) -> bool:
        return isinstance(self.record, JobRecord) and self.record.state in SETTLED_STATES

    @property
    def error(self) -> str | None:
        return self.record.reason if isinstance(self.record, Unreadable) else self.record.error

    def to_json(self) -> dict[str, Any]:
        record = self.record
        spec = record.spec if isinstance(record, JobRecord) else None
        return {
            "job_id": self.job_id,
            "state": self.state,
            "error": self.error,
            "priority": spec.priority if spec is not None else None,
            "policy_version": spec.policy_version if spec is not None else None,
            "submitted_at": record.submitted_at if isinstance(record, JobRecord) else None,
            "outcomes": self.outcomes(),
            "run": self.run.to_json() if self.run is not None else None,
        }

    def outcomes(self) -> dict[str, int]:
        """Successes and failed attempts by class over all the job's passes (as
        ``GET /v1/jobs/ID`` counts them)."""
        if self.run is None:
            return {}
        total = self.run.total
        outcomes = dict(total.failures_by_class)
        if total.standings[Standing.SUCCEEDED]:
            outcomes["success"] = total.standings[Standing.SUCCEEDED]
        return outcomes


@dataclass
class StateDirStatus:
    """Everything ``status STATE_DIR`` reports."""

    state_dir: str
    lock: LockStatus
    policy_version: int
    jobs: list[JobStanding]

    @property
    def exit_code(self) -> ExitCode:
        settled = all(job.settled for job in self.jobs)
        return ExitCode.DONE if settled else ExitCode.RESUMABLE

    def to_json(self) -> dict[str, Any]:
        return {
            "state_dir": self.state_dir,
            "running": self.lock.held,
            "lock": self.lock.to_json(),
            "policy_version": self.policy_version,
            "jobs": [job.to_json() for job in self.jobs],
        }


def collect_state_dir(state_dir: Path) -> StateDirStatus:
    """Read a state directory (read-only) into a ``StateDirStatus``."""
    if not is_state_dir(state_dir):
        raise ConfigError(f"no state directory at {state_dir}: it has no jobs/ folder")
    registry = Registry(state_dir)
    jobs = []
    for record in registry.all():
        output = registry.job_dir(record.job_id) / "rollouts.jsonl"
        try:
            run = collect_status(output)
        except ConfigError:  # accepted, not started: nothing materialized yet
            run = None
        except OSError:  # the job's files are damaged: its state says why
            run = None
        jobs.append(JobStanding(record, run))
    return StateDirStatus(
        state_dir=str(state_dir),
        lock=lock_status(state_dir / "serve.lock"),
        policy_version=registry.read_policy(),
        jobs=jobs,
    )


def render_state_dir(status: StateDirStatus) -> str:
    lock = status.lock
    daemon = f"running (pid {lock.pid})" if lock.held else "not running"
    lines = [
        f"state directory {status.state_dir}: dispatcher serve {daemon}",
        f"policy version {status.policy_version}; {len(status.jobs)} jobs",
    ]
    rows = []
    for job in status.jobs:
        figures: list[object] = ["-"] * 4
        if job.run is not None:
            total = job.run.total
            succeeded = total.standings[Standing.SUCCEEDED]
            figures = [total.expected, succeeded, total.final - succeeded, total.left_to_run]
        rows.append([job.job_id, job.state, *_spec_figures(job.record), *figures])
    if rows:
        lines.append(format_table(JOB_HEADERS, rows))
    lines.extend(f"{job.job_id}: {job.error}" for job in status.jobs if job.state == "failed")
    unreadable = sum(1 for job in status.jobs if isinstance(job.record, Unreadable))
    unfinished = sum(1 for job in status.jobs if not job.settled) - unreadable
    if unfinished:
        lines.append(f"{unfinished} jobs not settled: `dispatcher serve` resumes them")
    if unreadable:
        lines.append(
            f"{unreadable} jobs whose job.json cannot be read: fix it, or move the job's "
            "folder aside to submit it again"
        )
    return "\n".join(lines) + "\n"


def _spec_figures(record: JobRecord | Unreadable) -> list[object]:
    """Priority and policy version, "-" where there is none to tell."""
    if isinstance(record, Unreadable):
        return ["-", "-"]
    spec = record.spec
    return [spec.priority, "-" if spec.policy_version is None else spec.policy_version]
