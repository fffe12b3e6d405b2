"""What ``dispatcher run`` prints last on a terminal: the ``status`` table, then what to do.

A run's ``run_summary`` event is for machines (every figure, nested); a
person at the terminal wants where the run stands and the next step, which
the exit code decides: 75 rerun the same command, 0 the rows are ready,
1 or 2 fix what the error (printed after this) says, then rerun (or, when
every rollout is final, do what the error says: nothing succeeded). The table
is ``dispatcher status``'s own (``render_brief``), read from the run's files
as that command reads them, so the two always agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from dispatcher.errors import ExitCode
from dispatcher.files.resume import OutputPaths
from dispatcher.ops.status import RunStatus, Standing, collect_status, render_brief


class Ending(NamedTuple):
    table: str  # lines, each ending in a newline
    step: str  # one line, without its newline


def run_ending(output: Path, max_attempts: int, exit_code: int) -> Ending:
    """The ending of a run whose files exist (blocking: it reads them)."""
    status = collect_status(output, max_attempts)
    return Ending(render_brief(status), next_step(status, exit_code))


def next_step(status: RunStatus, exit_code: int) -> str:
    """One line: the exit code and what it asks of the person who ran the command."""
    total = status.total
    left = total.left_to_run
    if exit_code == ExitCode.RESUMABLE:
        return (
            f"exit 75: rerun the same command to finish {left:,} rollouts (finished ones are kept)"
        )
    if exit_code == ExitCode.DONE:
        return f"exit 0: every rollout is final; {_where_rows_are(status)}"
    if not left:  # every rollout is final: only the error can say what would run them again
        return f"exit {exit_code}: the run stopped on the error below, which says what to do"
    return (
        f"exit {exit_code}: the run stopped on the error below; once it is fixed, "
        f"rerun the same command to finish {left:,} rollouts"
    )


def _where_rows_are(status: RunStatus) -> str:
    paths = OutputPaths.for_output(Path(status.output))
    succeeded = status.total.standings[Standing.SUCCEEDED]
    failed = status.total.final - succeeded
    rows = f"the rows are in {paths.output} ({succeeded:,} succeeded)"
    if failed:
        rows += f", the {failed:,} failed for good in {paths.failures}"
    return rows + f"; `dispatcher report {paths.output}` tells more"
