"""``--dispatch-budget-s auto``: the dispatch budget from the Slurm job's end time.

budget = job end time - now - reserve. The reserve leaves room for the
rollouts still in flight when the budget runs out, the shutdown grace and
the final writes (contracts §9, §10).

The end time comes from ``SLURM_JOB_END_TIME`` (epoch seconds, set by recent
Slurm versions), else from ``squeue -h -j $SLURM_JOB_ID -o %e``. Without
either, or for a job without a time limit, there is nothing to derive a
budget from: that is a configuration error (exit 2), and the message says to
give a number instead.

A job whose end is nearer than the reserve gets a budget of 0 with a
warning, not an error: such a hop drains everything and exits 75, so the job
chain goes on in the next allocation instead of stopping on exit 2.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping
from datetime import datetime

import structlog

from dispatcher.errors import ConfigError

log = structlog.get_logger("dispatcher.ops.walltime")

DEFAULT_RESERVE_S = 300.0
SQUEUE_TIMEOUT_S = 30.0

# squeue prints these instead of a time for jobs without an end time.
_NO_END_TIME = frozenset({"", "n/a", "none", "unknown", "unlimited", "infinite"})


def squeue_end_time(job_id: str) -> str | None:
    """``squeue -h -j JOB -o %e``: the job's expected end time, or None if squeue failed."""
    try:
        done = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%e"],
            capture_output=True,
            text=True,
            timeout=SQUEUE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("squeue_failed", job_id=job_id, error=str(exc))
        return None
    if done.returncode != 0:
        log.warning("squeue_failed", job_id=job_id, stderr=done.stderr.strip()[:500])
        return None
    return done.stdout


def resolve_budget_auto(
    env: Mapping[str, str],
    *,
    reserve_s: float,
    now: float,
    squeue: Callable[[str], str | None] = squeue_end_time,
) -> float:
    """Seconds from ``now`` until the Slurm job ends, minus ``reserve_s``; 0 if that is negative."""
    if reserve_s < 0:
        raise ConfigError(f"--budget-reserve-s must be >= 0, got {reserve_s}")
    end, source = _job_end_time(env, squeue)
    budget = end - now - reserve_s
    if budget < 0:
        log.warning(
            "dispatch_budget_exhausted",
            job_end_in_s=round(end - now, 1),
            reserve_s=reserve_s,
            source=source,
            note="budget 0: every rollout is drained and runs in the next hop",
        )
        return 0.0
    log.info("dispatch_budget_auto", budget_s=round(budget, 1), reserve_s=reserve_s, source=source)
    return budget


def _job_end_time(env: Mapping[str, str], squeue: Callable[[str], str | None]) -> tuple[float, str]:
    raw = env.get("SLURM_JOB_END_TIME", "").strip()
    if raw:
        try:
            end = float(raw)
        except ValueError:
            raise ConfigError(
                f"--dispatch-budget-s auto: SLURM_JOB_END_TIME={raw!r} is not epoch seconds"
            ) from None
        if end > 0:
            return end, "SLURM_JOB_END_TIME"
    job_id = env.get("SLURM_JOB_ID", "").strip()
    if not job_id:
        raise ConfigError(
            "--dispatch-budget-s auto: not inside a Slurm job (neither SLURM_JOB_END_TIME "
            "nor SLURM_JOB_ID is set); give the budget in seconds instead"
        )
    out = squeue(job_id)
    if out is None:
        raise ConfigError(
            f"--dispatch-budget-s auto: squeue could not report the end time of job {job_id}; "
            "give the budget in seconds instead"
        )
    return _parse_squeue_time(out, job_id), "squeue"


def _parse_squeue_time(out: str, job_id: str) -> float:
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if text.lower() in _NO_END_TIME:
        raise ConfigError(
            f"--dispatch-budget-s auto: job {job_id} has no end time ({text or 'empty'}: "
            "no time limit?); give the budget in seconds instead"
        )
    try:
        # squeue prints local time without a zone; a naive datetime's
        # .timestamp() reads it in the same local zone.
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ConfigError(
            f"--dispatch-budget-s auto: cannot read squeue's end time {text!r} for job {job_id}"
        ) from None
