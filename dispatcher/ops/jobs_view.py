"""What ``dispatcher jobs`` prints for a person: the jobs table, one job's status, the
admission pause, and the exit code a job's final state gives (pure: no I/O)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dispatcher import jsonx
from dispatcher.client.wire import Admission, JobStatus
from dispatcher.errors import ExitCode
from dispatcher.lifecycle import JobState
from dispatcher.ops.table import JOB_HEADERS, format_table

# `submit --wait` and `tail --follow` exit with the job's end: 0 when it did what was
# asked, 75 when rollouts remain that the same daemon command resumes, 1 when it
# failed or was cancelled (its rollouts will not run).
END_EXIT_CODES: dict[JobState, ExitCode] = {
    JobState.DONE: ExitCode.DONE,
    JobState.SATISFIED: ExitCode.DONE,
    JobState.INCOMPLETE: ExitCode.RESUMABLE,
    JobState.FAILED: ExitCode.UNEXPECTED,
    JobState.CANCELLED: ExitCode.UNEXPECTED,
}


def end_exit_code(state: JobState | None) -> int:
    """The exit code of a job that ended in ``state`` (None: no end was seen)."""
    if state is None:
        return int(ExitCode.UNEXPECTED)
    return int(END_EXIT_CODES.get(state, ExitCode.UNEXPECTED))


def succeeded(job: JobStatus) -> int:
    return int(job.outcomes.get("success", 0))


def _final(job: JobStatus) -> int:
    """The rollouts final so far, of a job whose ``expected`` the daemon knows."""
    assert job.expected is not None
    return job.expected - (job.remaining or 0)


def _failed(job: JobStatus) -> int:
    return max(_final(job) - succeeded(job), 0)


def job_row(job: JobStatus) -> list[object]:
    """One line of the jobs table; "-" where the daemon does not know a figure."""
    if job.expected is None:
        figures: list[object] = ["-"] * 4
    else:
        figures = [job.expected, succeeded(job), _failed(job), job.remaining]
    policy = "-" if job.policy_version is None else job.policy_version
    return [job.job_id, job.state.value, job.priority, policy, *figures]


def render_list(url: str, jobs: Sequence[JobStatus], policy: int, admission: Admission) -> str:
    lines = [
        f"daemon at {url}: policy version {policy}, {admission_line(admission)}",
        f"{len(jobs)} jobs",
    ]
    if jobs:
        lines.append(format_table(JOB_HEADERS, [job_row(job) for job in jobs]))
    return "\n".join(lines) + "\n"


def admission_line(admission: Admission) -> str:
    """The pause in a few words, with what is in flight."""
    if admission.paused:
        why = [] if admission.reason is None else [f"reason {admission.reason!r}"]
        if admission.ttl_remaining_s is not None:
            why.append(f"ends by itself in {admission.ttl_remaining_s:.0f} s")
        state = f"admission paused ({', '.join(why)})" if why else "admission paused"
    else:
        state = "admission open"
    return f"{state}; {admission.in_flight} rollouts in flight"


def progress_line(job: JobStatus) -> str:
    """Where a job stands, in one short line (`submit --wait` on a terminal)."""
    parts = [f"job {job.job_id}: {job.state.value}"]
    if job.expected is not None:
        parts.append(f"{_final(job)}/{job.expected} rollouts final")
    parts.append(f"{job.in_flight} in flight")
    if job.target_groups is not None:
        parts.append(f"{job.groups_kept}/{job.target_groups} groups kept")
    if job.eta_s is not None:
        parts.append(f"eta {job.eta_s:.0f} s")
    return ", ".join(parts)


def render_job(job: JobStatus) -> str:
    """One job's status, a field a line."""
    lines = [f"job {job.job_id}: {job.state.value}"]
    fields = [*_run_fields(job), *_step_fields(job), *_about_fields(job)]
    width = max(len(name) for name, _ in fields)
    lines.extend(f"  {name.ljust(width)}  {value}" for name, value in fields)
    return "\n".join(lines) + "\n"


def _run_fields(job: JobStatus) -> list[tuple[str, str]]:
    fields = [
        ("priority", _or_dash(job.priority)),
        ("policy version", _or_dash(job.policy_version)),
    ]
    if job.expected is not None:
        fields.append(
            ("rollouts", f"expected {job.expected}, succeeded {succeeded(job)}, "
             f"failed {_failed(job)}, left {job.remaining}")
        )  # fmt: skip
    if not job.final:
        fields.append(("in flight", f"{job.in_flight} at agents, {job.committing} committing"))
        fields.append(("eta", "-" if job.eta_s is None else f"{job.eta_s:.0f} s"))
    fields.append(("outcomes", _counts(sorted(job.outcomes.items())) or "-"))
    fields.append(("rows durable", str(job.rows_durable)))
    fields.append(("groups complete", str(job.groups_complete)))
    return fields


def _step_fields(job: JobStatus) -> list[tuple[str, str]]:
    """Step control's figures, for a job with a target or a filter (contracts §13)."""
    if job.target_groups is None and not job.groups_filtered:
        return []
    groups = f"kept {job.groups_kept}, filtered {job.groups_filtered}, open {job.groups_open}"
    fields = [("target groups", f"{_or_dash(job.target_groups)} ({groups})")]
    if job.satisfied_seq is not None:
        tail = f"dispatcher jobs tail {job.job_id} --group --after {job.satisfied_seq}"
        fields.append(("satisfied", f"at {job.satisfied_at}; its tail: {tail}"))
    if job.timeline:
        steps = ((name, value) for name, value in job.timeline.items() if value is not None)
        fields.append(("timeline", ", ".join(f"{n} {v:.1f}" for n, v in steps) or "-"))
    return fields


def _about_fields(job: JobStatus) -> list[tuple[str, str]]:
    fields = [("submitted at", _or_dash(job.submitted_at)), ("output", _or_dash(job.output))]
    if job.metadata:
        fields.append(("metadata", jsonx.dumps(job.metadata).decode()))
    if job.error:
        fields.append(("error", job.error))
    return fields


def _counts(items: Iterable[tuple[str, object]]) -> str:
    return ", ".join(f"{name} {value}" for name, value in items)


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)
