"""``dispatcher status OUTPUT``: where a run stands, read from its files alone.

Every materialized row is one expected rollout (contracts §1). Its standing
follows the resume contract of ``dispatcher.files.resume``: succeeded, failed for
good (a terminal failure, or as many failed attempts as ``max_attempts``),
or left to run: *retryable* (it failed, attempts remain) or *no row* (no
trace in any file).

Drained, cancelled, kill-shaped and never-started rollouts all write nothing
(§4), so files alone cannot tell them apart. The manifest's ``last_run``
(the last hop's own summary) says how many the last hop drained, cancelled
or saw kill-shaped; the rest of the no-row rollouts never started. A
``last_run`` older than the newest row (a later hop died, or one is running)
is reported as stale and not used for that split.

Exit code: 0 when every rollout is final, 75 when some are left to run, 1 when
every rollout is final but none succeeded and all failed the same way (the
same meaning as the run's own exit code), 2 when OUTPUT names no run.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from dispatcher.errors import ExitCode
from dispatcher.files import delivery_history as delivery
from dispatcher.files.contracts import (
    DEFAULT_MAX_ATTEMPTS as DEFAULT_MAX_ATTEMPTS,
)
from dispatcher.files.contracts import (
    NOT_DELIVERED,
)
from dispatcher.files.contracts import max_attempts_for as max_attempts_for
from dispatcher.files.resume import (
    FAILURE_FACTS,
    IDENTITY_FACTS,
    OutputPaths,
    RunState,
    Tail,
    iter_rows,
    nothing_succeeded,
    tail_state,
)
from dispatcher.ops.runfiles import (
    LastRun,
    LockStatus,
    agent_name,
    last_run,
    lock_status,
    read_manifest,
    render_delivery,
    require_run,
)
from dispatcher.ops.table import format_table, percent, ratio, utc_time
from dispatcher.settings.args import non_negative_int, positive_int
from dispatcher.tasks.keys import row_key


class Standing(StrEnum):
    """Where one expected rollout stands, in the order the checks apply."""

    SUCCEEDED = "succeeded"
    TERMINAL = "terminal"
    ATTEMPTS_USED_UP = "attempts_used_up"
    RETRYABLE = "retryable"
    NO_ROW = "no_row"


_FINAL = (Standing.SUCCEEDED, Standing.TERMINAL, Standing.ATTEMPTS_USED_UP)
_LEFT = (Standing.RETRYABLE, Standing.NO_ROW)


def standing(state: RunState, key: int) -> Standing:
    if key in state.successes:
        return Standing.SUCCEEDED
    if key in state.terminal:
        return Standing.TERMINAL
    if state.is_final(key):
        return Standing.ATTEMPTS_USED_UP
    return Standing.RETRYABLE if state.failed_attempts[key] else Standing.NO_ROW


@dataclass
class Tally:
    """Counts for all rollouts or for one agent's."""

    expected: int = 0
    standings: Counter[Standing] = field(default_factory=Counter)
    failures_by_class: Counter[str] = field(default_factory=Counter)

    @property
    def final(self) -> int:
        return sum(self.standings[s] for s in _FINAL)

    @property
    def left_to_run(self) -> int:
        return sum(self.standings[s] for s in _LEFT)

    def add(self, other: Tally) -> None:
        self.expected += other.expected
        self.standings.update(other.standings)
        self.failures_by_class.update(other.failures_by_class)

    def to_json(self) -> dict[str, Any]:
        return {
            "expected": self.expected,
            "successes": self.standings[Standing.SUCCEEDED],
            "terminal": self.standings[Standing.TERMINAL],
            "attempts_used_up": self.standings[Standing.ATTEMPTS_USED_UP],
            "retryable": self.standings[Standing.RETRYABLE],
            "no_row": self.standings[Standing.NO_ROW],
            "final": self.final,
            "left_to_run": self.left_to_run,
            "coverage": ratio(self.standings[Standing.SUCCEEDED], self.expected),
            "failed_attempts": sum(self.failures_by_class.values()),
            "failures_by_class": dict(self.failures_by_class.most_common()),
        }


@dataclass
class FileHealth:
    """Rows read from one file, lines resume cannot use, and how the file ends."""

    path: str
    rows: int = 0
    unreadable: int = 0
    tail: Tail = Tail.OK

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "rows": self.rows,
            "unreadable": self.unreadable,
            "tail": str(self.tail),
        }


@dataclass
class RunStatus:
    """Everything ``status`` reports about one run."""

    output: str
    max_attempts: int
    lock: LockStatus
    last_run: LastRun | None
    agents: dict[str, Tally] = field(default_factory=dict)
    files: dict[str, FileHealth] = field(default_factory=dict)
    anomalies: Counter[str] = field(default_factory=Counter)
    delivery: dict[str, Any] = field(default_factory=dict)
    # Per agent, the rollouts with a not-delivered row (§11): no replica took them.
    not_delivered: dict[str, set[int]] = field(default_factory=dict)
    # Every rollout final, none succeeded, one failure class: why that is no success.
    nothing_succeeded: str | None = None

    @property
    def total(self) -> Tally:
        total = Tally()
        for tally in self.agents.values():
            total.add(tally)
        return total

    @property
    def never_started(self) -> int | None:
        """No-row rollouts the last hop did not drain, cancel or see kill-shaped."""
        if self.last_run is None or self.last_run.stale:
            return None
        run = self.last_run
        no_row = self.total.standings[Standing.NO_ROW]
        return max(0, no_row - run.drained - run.cancelled - run.kill_shaped)

    @property
    def exit_code(self) -> ExitCode:
        if self.total.left_to_run:
            return ExitCode.RESUMABLE
        return ExitCode.UNEXPECTED if self.nothing_succeeded else ExitCode.DONE

    def to_json(self) -> dict[str, Any]:
        total = self.total.to_json()
        left = {
            "total": total.pop("left_to_run"),
            "retryable": total.pop("retryable"),
            "no_row": total.pop("no_row"),
            "never_started": self.never_started,
            "last_run": self.last_run.to_json() if self.last_run else None,
        }
        return {
            "output": self.output,
            "running": self.lock.held,
            "lock": self.lock.to_json(),
            "max_attempts": self.max_attempts,
            **total,
            "left_to_run": left,
            "complete": left["total"] == 0,
            "nothing_succeeded": self.nothing_succeeded,
            "per_agent": {name: t.to_json() for name, t in sorted(self.agents.items())},
            "files": {name: h.to_json() for name, h in self.files.items()},
            "anomalies": dict(self.anomalies),
            "delivery": self.delivery,
        }


def collect_status(output: Path, max_attempts: int | None = None) -> RunStatus:
    """Read a run's files (read-only, streaming) into a ``RunStatus``."""
    paths = require_run(output)
    manifest = read_manifest(paths.manifest)
    status = RunStatus(
        output=str(output),
        max_attempts=max_attempts_for(max_attempts, manifest),
        lock=lock_status(paths.lock),
        last_run=last_run(paths, manifest),
        delivery=delivery.summarize(manifest.delivery_history if manifest is not None else None),
    )
    state = RunState(max_attempts=status.max_attempts)
    _scan_successes(paths, state, status)
    _scan_failures(paths, state, status)
    expected = _scan_materialized(paths, state, status)
    status.anomalies["success_rows_not_materialized"] = len(state.successes - expected)
    status.anomalies["failure_rows_not_materialized"] = sum(
        1 for key in state.failed_attempts if key not in expected
    )
    if not status.total.left_to_run:
        status.nothing_succeeded = nothing_succeeded(state, status.total.expected)
    return status


def add_attempt_cap_flags(parser: argparse.ArgumentParser, what: str) -> None:
    """``--max-attempts`` and ``--extend-attempts``, counted as ``run`` counts them."""
    parser.add_argument(
        "--max-attempts",
        type=positive_int,
        default=None,
        help=f"attempt cap of the run, {what} (default: the manifest's, else "
        f"{DEFAULT_MAX_ATTEMPTS})",
    )
    parser.add_argument(
        "--extend-attempts",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="as the hop was run: the cap is --max-attempts + N (the manifest's cap "
        "already holds its hop's N)",
    )


def given_attempt_cap(args: argparse.Namespace) -> int | None:
    """The cap the flags give, as the hop that ran with them counted it; None: the
    manifest's (which records its hop's cap, extension included)."""
    if args.max_attempts is None:
        return None
    return int(args.max_attempts) + int(args.extend_attempts)


def _health(status: RunStatus, name: str, path: Path) -> FileHealth:
    health = FileHealth(path=str(path), tail=tail_state(path))
    status.files[name] = health
    return health


def _settle(health: FileHealth) -> None:
    # The torn last line was counted as unreadable; it is reported as the tail.
    if health.tail is Tail.TORN and health.unreadable:
        health.unreadable -= 1


def _scan_successes(paths: OutputPaths, state: RunState, status: RunStatus) -> None:
    health = _health(status, "output", paths.output)
    for _, row in iter_rows(paths.output, IDENTITY_FACTS):
        key = row_key(row)
        if key is None:
            health.unreadable += 1
            continue
        health.rows += 1
        if key in state.successes:
            status.anomalies["duplicate_success_rows"] += 1
        state.successes.add(key)
    _settle(health)


def _scan_failures(paths: OutputPaths, state: RunState, status: RunStatus) -> None:
    health = _health(status, "failures", paths.failures)
    for _, row in iter_rows(paths.failures, FAILURE_FACTS):
        key = row_key(row)
        if row is None or key is None:
            health.unreadable += 1
            continue
        health.rows += 1
        failure_class = state.add_failure(key, row)
        if failure_class is None:
            continue  # an omitted rollout's row: no failure, no attempt (contracts §15)
        _agent(status, agent_name(row)).failures_by_class[failure_class] += 1
        if row.get(NOT_DELIVERED) is True:
            status.not_delivered.setdefault(agent_name(row), set()).add(key)
    _settle(health)


def _scan_materialized(paths: OutputPaths, state: RunState, status: RunStatus) -> set[int]:
    health = _health(status, "materialized", paths.materialized)
    expected: set[int] = set()
    for _, row in iter_rows(paths.materialized, IDENTITY_FACTS):
        key = row_key(row)
        if row is None or key is None:
            health.unreadable += 1
            continue
        health.rows += 1
        if key in expected:
            status.anomalies["duplicate_materialized_rows"] += 1
            continue
        expected.add(key)
        tally = _agent(status, agent_name(row))
        tally.expected += 1
        tally.standings[standing(state, key)] += 1
    _settle(health)
    return expected


def _agent(status: RunStatus, name: str) -> Tally:
    tally = status.agents.get(name)
    if tally is None:
        tally = status.agents[name] = Tally()
    return tally


# -- output -------------------------------------------------------------------------------


def render_status(status: RunStatus) -> str:
    """The human-readable status report."""
    total = status.total
    sections = [
        _render_header(status, total),
        _render_standings(total),
        _render_why(status, total),
        f"\nfailed: {status.nothing_succeeded}" if status.nothing_succeeded else "",
        _render_not_delivered(status, total),
        _render_failures(total),
        _render_agents(status),
        render_delivery(status.delivery) if status.delivery else "",
        _render_files(status),
        _render_anomalies(status),
    ]
    return "\n".join(s for s in sections if s) + "\n"


def render_brief(status: RunStatus) -> str:
    """The short form ``dispatcher run`` ends with on a terminal: coverage, the
    standings table, failures by class, agents (when more than one), warnings."""
    total = status.total
    succeeded = total.standings[Standing.SUCCEEDED]
    sections = [
        f"{status.output}: {percent(succeeded, total.expected)} covered "
        f"({succeeded} of {total.expected} succeeded); left to run: {total.left_to_run}",
        _render_standings(total),
        _render_why(status, total),
        _render_not_delivered(status, total),
        _render_failures(total),
        _render_agents(status) if len(status.agents) > 1 else "",
        _render_anomalies(status),
    ]
    return "\n".join(s for s in sections if s) + "\n"


def _render_header(status: RunStatus, total: Tally) -> str:
    if status.lock.held:
        pid = f"pid {status.lock.pid}" if status.lock.pid is not None else "pid unknown"
        running = f"running ({pid} holds the run lock; counts are moving)"
    else:
        running = "not running (run lock free)"
    succeeded = total.standings[Standing.SUCCEEDED]
    return "\n".join(
        [
            f"run          {status.output}",
            f"dispatcher   {running}",
            f"expected     {total.expected} rollouts (max attempts {status.max_attempts})",
            f"coverage     {percent(succeeded, total.expected)} ({succeeded} succeeded)",
            f"final        {total.final}; left to run on resume: {total.left_to_run}",
        ]
    )


def _render_standings(total: Tally) -> str:
    labels = {
        Standing.SUCCEEDED: "succeeded",
        Standing.TERMINAL: "failed: terminal",
        Standing.ATTEMPTS_USED_UP: "failed: attempts used up",
        Standing.RETRYABLE: "left: retryable (failed, attempts left)",
        Standing.NO_ROW: "left: no row (never started, drained, cancelled)",
    }
    rows = [
        (label, total.standings[s], percent(total.standings[s], total.expected))
        for s, label in labels.items()
    ]
    return "\n" + format_table(("rollouts", "count", "share"), rows)


def _render_why(status: RunStatus, total: Tally) -> str:
    no_row = total.standings[Standing.NO_ROW]
    run = status.last_run
    if not no_row:
        return ""
    if run is None:
        return (
            f"\nno row ({no_row}): drained, cancelled, kill-shaped and never-started rollouts "
            "write nothing, and the manifest has no summary of the last hop to tell them apart"
        )
    head = f"last hop finished {utc_time(run.finished_at)} with exit {run.exit_code}"
    counts = f"drained {run.drained}, cancelled {run.cancelled}, kill-shaped {run.kill_shaped}"
    if run.stale:
        return f"\n{head}: {counts}; rows were written since (a later hop died or is running)"
    return f"\nno row ({no_row}): {head}: {counts}; never started {status.never_started}"


def _render_not_delivered(status: RunStatus, total: Tally) -> str:
    if not total.left_to_run:
        return ""
    return "".join(
        f"\nnot delivered: agent {agent} unreachable ({len(keys)} rollouts had no replica "
        "answer within the delivery deadline; they run again on resume)"
        for agent, keys in sorted(status.not_delivered.items())
    )


def _render_failures(total: Tally) -> str:
    if not total.failures_by_class:
        return ""
    rows = list(total.failures_by_class.most_common())
    attempts = sum(total.failures_by_class.values())
    return f"\nfailed attempts by class ({attempts})\n" + format_table(("class", "attempts"), rows)


def _render_agents(status: RunStatus) -> str:
    headers = (
        "agent",
        "expected",
        "succeeded",
        "terminal",
        "used up",
        "retryable",
        "no row",
        "coverage",
    )
    rows = [
        (
            name,
            t.expected,
            t.standings[Standing.SUCCEEDED],
            t.standings[Standing.TERMINAL],
            t.standings[Standing.ATTEMPTS_USED_UP],
            t.standings[Standing.RETRYABLE],
            t.standings[Standing.NO_ROW],
            percent(t.standings[Standing.SUCCEEDED], t.expected),
        )
        for name, t in sorted(status.agents.items())
    ]
    return "\nper agent\n" + format_table(headers, rows)


_TAIL_NOTES = {
    Tail.ABSENT: "absent",
    Tail.OK: "",
    Tail.UNTERMINATED: "last row lacks its newline (resume terminates it)",
    Tail.TORN: "torn last line (resume drops it)",
}


def _render_files(status: RunStatus) -> str:
    rows = []
    for health in status.files.values():
        notes = [_TAIL_NOTES[health.tail]]
        if health.unreadable:
            notes.append(f"{health.unreadable} unreadable lines")
        rows.append((Path(health.path).name, health.rows, "; ".join(n for n in notes if n)))
    return "\nfiles\n" + format_table(("file", "rows", "notes"), rows)


def _render_anomalies(status: RunStatus) -> str:
    found = [f"{name.replace('_', ' ')}: {n}" for name, n in status.anomalies.items() if n]
    return "\nwarnings\n" + "\n".join(f"  {line}" for line in found) if found else ""
