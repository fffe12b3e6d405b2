"""Read-only access to a run's files (contracts §4) for the operator commands.

Nothing here writes, repairs or creates a file: ``status`` and ``report`` may
run beside a live dispatcher or on a copy of a killed run. A torn last line
(see ``dispatcher.files.resume.repair_torn_tail``) is reported, never fixed.
"""

from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from dispatcher.errors import ConfigError
from dispatcher.files.contracts import RunManifest
from dispatcher.files.delivery_history import REPLICA_FIGURES
from dispatcher.files.resume import OutputPaths
from dispatcher.ops.table import format_table
from dispatcher.tasks.keys import AGENT_REF

NO_AGENT = "<none>"
# Slack for file-system timestamps (coarse or set by a file server's clock)
# when comparing them with the manifest's ``last_run.finished_at``.
_MTIME_SLACK_S = 2.0


def is_state_dir(path: Path) -> bool:
    """``path`` is a ``dispatcher serve`` state directory (it has a jobs/ folder), not a run."""
    return (path / "jobs").is_dir()


def require_run(output: Path) -> OutputPaths:
    """The run's paths; a clear error when ``output`` names no run (nothing materialized)."""
    paths = OutputPaths.for_output(output)
    if not paths.materialized.is_file():
        raise ConfigError(
            f"no run at {output}: {paths.materialized.name} not found "
            "(the run has not materialized its inputs yet, or OUTPUT names another file)"
        )
    return paths


def agent_name(row: dict[str, Any]) -> str:
    ref = row.get(AGENT_REF)
    if isinstance(ref, dict) and isinstance(ref.get("name"), str):
        return str(ref["name"])
    return NO_AGENT


@dataclass(frozen=True)
class LockStatus:
    """Whether a dispatcher holds the run lock, and the pid it wrote there."""

    held: bool
    pid: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"held": self.held, "pid": self.pid}


def lock_status(lock_path: Path) -> LockStatus:
    """Probe ``X_run.lock`` without taking it: a shared non-blocking flock, released at once.

    The file is opened read-only and never created. A run holds an exclusive
    flock for its whole life, so the probe fails exactly while one is running.
    """
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return LockStatus(held=False)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            return LockStatus(held=True, pid=_read_pid(fd))
        fcntl.flock(fd, fcntl.LOCK_UN)
        return LockStatus(held=False)
    finally:
        os.close(fd)


def _read_pid(fd: int) -> int | None:
    data = os.pread(fd, 4096, 0).strip()
    if not data:
        return None
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if isinstance(value, dict):
        value = value.get("pid")
    return value if type(value) is int else None


def read_manifest(path: Path) -> RunManifest | None:
    """The manifest, or None when absent or unreadable (status never fails on it).

    A value of the wrong type reads as absent (``RunManifest.lenient``).
    """
    try:
        data = orjson.loads(path.read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return None
    return RunManifest.lenient(data)


@dataclass(frozen=True)
class LastRun:
    """The manifest's ``last_run`` (``contracts.LastRun``) as ``status`` shows it."""

    finished_at: float | None
    exit_code: int | None
    drained: int
    cancelled: int
    kill_shaped: int
    stale: bool  # rows were written after it: a later hop died or is running

    def to_json(self) -> dict[str, Any]:
        return {
            "finished_at": self.finished_at,
            "exit_code": self.exit_code,
            "drained": self.drained,
            "cancelled": self.cancelled,
            "kill_shaped": self.kill_shaped,
            "stale": self.stale,
        }


def last_run(paths: OutputPaths, manifest: RunManifest | None) -> LastRun | None:
    recorded = manifest.last_run if manifest is not None else None
    if recorded is None:
        return None
    finished = timestamp(recorded.finished_at)
    return LastRun(
        finished_at=finished,
        exit_code=recorded.exit_code,
        drained=recorded.drained,
        cancelled=recorded.cancelled,
        kill_shaped=recorded.kill_shaped,
        stale=finished is not None and _written_after(paths, finished),
    )


def _written_after(paths: OutputPaths, when: float) -> bool:
    for path in (paths.output, paths.failures):
        try:
            if path.stat().st_mtime > when + _MTIME_SLACK_S:
                return True
        except FileNotFoundError:
            continue
    return False


def timestamp(value: str | float | None) -> float | None:
    """Unix seconds, or an ISO-8601 time (UTC when it names no zone)."""
    if not isinstance(value, str):
        return None if value is None else float(value)
    try:
        when = datetime.fromisoformat(value.strip())
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def render_delivery(summary: dict[str, Any]) -> str:
    """The delivery section of the human report ("" when no hop recorded one)."""
    if not summary["hops"]:
        return ""
    lines = [f"\ndelivery over {summary['hops']} hop(s)"]
    retry_rows = [
        (agent, reason, n)
        for agent, reasons in summary["retries"].items()
        for reason, n in sorted(reasons.items())
    ]
    if retry_rows:
        lines.append(format_table(("agent", "retried because", "tries"), retry_rows))
    headers = ("agent", "replica", *(REPLICA_FIGURES), "last state")
    rows = [
        (r["agent"], r["replica"], *(r.get(k, 0) for k in REPLICA_FIGURES), r["last_state"])
        for r in summary["replicas"]
    ]
    lines.append(format_table(headers, rows))
    if summary["local_faults"]:
        lines.append(f"  the dispatcher's own faults (requeued): {summary['local_faults']}")
    if summary["agents_down_last_hop"]:
        down = ", ".join(summary["agents_down_last_hop"])
        lines.append(f"  agents down at the end of the last hop: {down}")
    return "\n".join(lines)
