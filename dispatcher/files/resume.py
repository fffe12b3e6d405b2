"""What the output files say about a run: the resume contract, in one place.

A rollout is done iff its row is in ``X.jsonl``. The failures sidecar says how
many attempts each unfinished (task, rollout) has spent. Nothing else is
state: no database, no checkpoint, so a kill -9 at any instant leaves files
this module can read back (a torn last line is repaired first, see
``repair_torn_tail``).

A (task, rollout) is *final* when it has a success, a terminal failure, or
``max_attempts`` counted failures. Otherwise it runs again with
``_ng_attempt_index`` = its number of earlier failed attempts. Drained,
cancelled and kill-shaped rollouts wrote no row anywhere, so they run again
without spending an attempt; a rollout that never reached an agent before its
delivery deadline wrote a row marked ``_ng_failure_not_delivered``, which is
listed but spends no attempt either (contracts §11). A row marked
``_ng_omitted_rollout`` (``--record-omitted``, contracts §15) is no failure and
no attempt: it only tells how long the rollout ran before it was cut off.

``RunState`` also keeps what the run's coverage and status files say (§15):
masked and unscored successes, successes per agent, each failing rollout's
agent and latest class, and each rollout's longest earlier attempt (resume
starts those first).
"""

from __future__ import annotations

import collections
import math
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from dispatcher.files.contracts import (
    DISPATCH_KEY,
    FAILURE_CLASS,
    FAILURE_TERMINAL,
    NOT_DELIVERED,
    OMITTED_ROLLOUT,
    is_not_delivered,
    is_omitted,
    is_terminal,
)
from dispatcher.outcome import Outcome
from dispatcher.tasks.keys import (
    AGENT_REF,
    ROLLOUT_INDEX,
    TASK_INDEX,
    FactsReader,
    line_key,
    row_key,
)
from dispatcher.tasks.keys import rollout_key as rollout_key  # tests import it here
from dispatcher.tasks.schema import MASK_SAMPLE, REWARD

_READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class OutputPaths:
    """The file set of one run, named after its ``--output X.jsonl`` (contracts §4)."""

    output: Path
    failures: Path
    materialized: Path
    manifest: Path
    lock: Path
    # NeMo Gym Main's coverage and status files (contracts §15).
    coverage: Path
    status: Path
    # The attempt indices each hop reserved before sending (contracts §5).
    reservations: Path

    @classmethod
    def for_output(cls, output: Path) -> OutputPaths:
        stem = output.with_suffix("")
        return cls(
            output=output,
            failures=Path(f"{stem}_failures.jsonl"),
            materialized=Path(f"{stem}_materialized_inputs.jsonl"),
            manifest=Path(f"{stem}_manifest.json"),
            lock=Path(f"{stem}_run.lock"),
            coverage=Path(f"{stem}_coverage.json"),
            status=Path(f"{stem}_status.json"),
            reservations=Path(f"{stem}_attempt_reservations.jsonl"),
        )

    def all(self) -> tuple[Path, ...]:
        return (
            self.output,
            self.failures,
            self.materialized,
            self.manifest,
            self.lock,
            self.coverage,
            self.status,
            self.reservations,
        )


class Tail(StrEnum):
    """How a JSONL file ends."""

    ABSENT = "absent"
    OK = "ok"
    UNTERMINATED = "unterminated"  # a whole row without its newline: resume keeps it
    TORN = "torn"  # an unparseable last line: resume drops it


class TailRepair(StrEnum):
    NONE = "none"
    TERMINATED = "terminated"
    DROPPED = "dropped"


def _inspect_tail(f: BinaryIO) -> tuple[Tail, int]:
    """How the open file ends, and where its last line starts."""
    size = f.seek(0, os.SEEK_END)
    if size == 0:
        return Tail.OK, 0
    f.seek(size - 1)
    if f.read(1) == b"\n":
        return Tail.OK, size
    start = _last_line_start(f, size)
    f.seek(start)
    return (Tail.UNTERMINATED if _parses_as_object(f.read()) else Tail.TORN), start


def tail_state(path: Path) -> Tail:
    """How ``path`` ends, read-only (``dispatcher status``)."""
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return Tail.ABSENT
    with f:
        return _inspect_tail(f)[0]


def repair_torn_tail(path: Path) -> TailRepair:
    """Make ``path`` end on a whole line before anything is appended to it.

    A hard kill can cut the last row. A tail that parses is a complete row
    missing only its newline, so it is terminated; one that does not parse is
    dropped (it was never acknowledged).
    """
    try:
        f = path.open("rb+")
    except FileNotFoundError:
        return TailRepair.NONE
    with f:
        tail, start = _inspect_tail(f)
        if tail is Tail.OK:
            return TailRepair.NONE
        if tail is Tail.UNTERMINATED:
            f.seek(0, os.SEEK_END)
            f.write(b"\n")
            repair = TailRepair.TERMINATED
        else:
            f.truncate(start)
            repair = TailRepair.DROPPED
        f.flush()
        os.fsync(f.fileno())
    return repair


def _last_line_start(f: BinaryIO, size: int) -> int:
    """Offset just after the last newline before the final byte (0 if none)."""
    pos = size - 1
    while pos > 0:
        step = min(_READ_CHUNK, pos)
        f.seek(pos - step)
        chunk = f.read(step)
        idx = chunk.rfind(b"\n")
        if idx >= 0:
            return pos - step + idx + 1
        pos -= step
    return 0


def _parses_as_object(data: bytes) -> bool:
    try:
        return isinstance(orjson.loads(data), dict)
    except orjson.JSONDecodeError:
        return False


def nonblank_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(line_no, raw)`` per non-blank line, streaming; nothing for a missing file."""
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return
    with f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                yield line_no, line


def iter_lines(
    path: Path, reader: FactsReader
) -> Iterator[tuple[int, bytes, dict[str, Any] | None]]:
    """Yield ``(line_no, raw, facts)`` per non-blank line, streaming: ``facts`` holds
    the line's ``reader.keys`` (those it has), None if it is no JSON object."""
    for line_no, line in nonblank_lines(path):
        yield line_no, line, reader.read(line)


def iter_rows(path: Path, reader: FactsReader) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """Yield ``(line_no, facts)`` for each non-blank line, as ``iter_lines`` reads it."""
    for line_no, _, row in iter_lines(path, reader):
        yield line_no, row


def iter_line_keys(path: Path) -> Iterator[int | None]:
    """``row_key`` of each non-blank line, None when unreadable; only the two
    indices are decoded, so a row of megabytes costs one scan, not its objects."""
    for _, line in nonblank_lines(path):
        yield line_key(line)


# The keys the readers of a run's files decode of a row (each declared in tasks/schema.py).
IDENTITY_FACTS = FactsReader((TASK_INDEX, ROLLOUT_INDEX, AGENT_REF))
# A success row's: its key, agent, reward and ``mask_sample`` (contracts §15).
SUCCESS_FACTS = FactsReader((*IDENTITY_FACTS.keys, REWARD, MASK_SAMPLE))
# A failure row's: what ``RunState.add_failure`` counts.
FAILURE_FACTS = FactsReader(
    (
        *IDENTITY_FACTS.keys,
        DISPATCH_KEY,
        FAILURE_CLASS,
        FAILURE_TERMINAL,
        NOT_DELIVERED,
        OMITTED_ROLLOUT,
    )
)


def success_facts(line: bytes) -> tuple[int, str | None, Any, Any] | None:
    """A success line's key, agent, reward and ``mask_sample``; None when unreadable.
    Only those values are decoded."""
    row = SUCCESS_FACTS.read(line)
    key = row_key(row)
    if key is None or row is None:
        return None
    return key, _agent_of(row) or None, row.get(REWARD), row.get(MASK_SAMPLE)


def spends_attempt(failure_row: dict[str, Any]) -> bool:
    """Whether a failure row counts toward ``max_attempts``: a not-delivered one
    never does, on any attempt (contracts §11)."""
    return not is_not_delivered(failure_row)


def is_final(*, succeeded: bool, terminal: bool, counted_failures: int, max_attempts: int) -> bool:
    """The one finality rule (contracts §5, §11), for the live run, resume, ``status``,
    ``report``, ``merge`` and service mode alike: a (task, rollout) is final when it
    has a success, a terminal failure, or ``max_attempts`` counted failures."""
    return succeeded or terminal or counted_failures >= max_attempts


def final_after_failure(
    failure_row: dict[str, Any], earlier_failures: int, max_attempts: int
) -> bool:
    """Whether a rollout whose ``earlier_failures`` counted attempts came before is
    final once ``failure_row`` is written (the live run's view of the same rule)."""
    counted = spends_attempt(failure_row)
    return is_final(
        succeeded=False,
        terminal=counted and is_terminal(failure_row),
        counted_failures=earlier_failures + counted,
        max_attempts=max_attempts,
    )


@dataclass
class RunState:
    """Successes and failed attempts found in a run's output files."""

    max_attempts: int
    successes: set[int] = field(default_factory=set)
    failed_attempts: Counter[int] = field(default_factory=Counter)
    terminal: set[int] = field(default_factory=set)
    failure_classes: Counter[str] = field(default_factory=Counter)
    unreadable_rows: int = 0
    not_delivered: int = 0
    # Contracts §15: successes that train nothing, and what a status file shows.
    masked: int = 0
    unscored: int = 0
    agent_successes: Counter[str] = field(default_factory=Counter)
    # Each rollout with a failure row: its agent and its latest failure class.
    latest_failure: dict[int, tuple[str, str]] = field(default_factory=dict)
    # Each rollout's longest earlier attempt in seconds, from its failure rows.
    longest_s: dict[int, float] = field(default_factory=dict)

    def is_final(self, key: int) -> bool:
        return is_final(
            succeeded=key in self.successes,
            terminal=key in self.terminal,
            counted_failures=self.failed_attempts[key],
            max_attempts=self.max_attempts,
        )

    def add_success(self, key: int, agent: str | None, reward: Any, mask_sample: Any) -> bool:
        """Count one success row; False for a rollout already counted."""
        if key in self.successes:
            return False
        self.successes.add(key)
        self.agent_successes[agent or ""] += 1
        self.masked += mask_sample is True
        self.unscored += not is_numeric(reward)
        return True

    def add_failure(self, key: int, row: dict[str, Any]) -> str | None:
        """Count one failure row (one spent attempt unless not delivered); returns its
        class, or None for an omitted rollout's row, which counts as nothing."""
        self._note_duration(key, row)
        if is_omitted(row):
            return None
        failure_class = str(row.get(FAILURE_CLASS))
        self.failure_classes[failure_class] += 1
        self.latest_failure[key] = (_agent_of(row), failure_class)
        if not spends_attempt(row):
            self.not_delivered += 1
            return failure_class
        self.failed_attempts[key] += 1
        if is_terminal(row):
            self.terminal.add(key)
        return failure_class

    def _note_duration(self, key: int, row: dict[str, Any]) -> None:
        stamp = row.get(DISPATCH_KEY)
        duration = stamp.get("duration_s") if isinstance(stamp, dict) else None
        if isinstance(duration, int | float) and duration > self.longest_s.get(key, 0.0):
            self.longest_s[key] = float(duration)

    def attempt_index(self, key: int) -> int:
        """The least index the next attempt may have: its earlier counted failures (the
        reservations of files/reservations.py may raise it)."""
        return self.failed_attempts.get(key, 0)

    @property
    def exhausted(self) -> int:
        """Rollouts final only because their failures reached the attempt cap."""
        return sum(
            1
            for key in self.failed_attempts
            if self.is_final(key) and key not in self.successes and key not in self.terminal
        )


def is_numeric(value: Any) -> bool:
    """A reward that scores: a finite JSON number (a bool is not one)."""
    # Once per row: a tuple, not a union made on each call, and no float parsed.
    if type(value) is bool or not isinstance(value, (int, float)):
        return False
    return value == value and value not in _INFINITIES


_INFINITIES = (math.inf, -math.inf)


def _agent_of(row: dict[str, Any]) -> str:
    agent = row.get(AGENT_REF)
    name = agent.get("name") if isinstance(agent, dict) else None
    return name if isinstance(name, str) else ""


def load_run_state(paths: OutputPaths, max_attempts: int) -> RunState:
    """Read successes and failures back (blocking: call it in a thread)."""
    state = RunState(max_attempts=max_attempts)
    for _, line in nonblank_lines(paths.output):
        facts = success_facts(line)
        if facts is None:
            state.unreadable_rows += 1
            continue
        state.add_success(*facts)
    for _, row in iter_rows(paths.failures, FAILURE_FACTS):
        key = row_key(row)
        if row is None or key is None:
            state.unreadable_rows += 1
            continue
        state.add_failure(key, row)
    return state


def nothing_succeeded(state: RunState, expected: int) -> str | None:
    """Why a run whose every rollout is final failed after all, else None (contracts §10).

    Asked once no rollout is left to run, by the live run and by ``status`` alike.
    Failures of several classes may be the tasks' own (hard tasks time out, others
    break a tool), and a failure the agent reported is an outcome it produced; no
    success at all, and one class the dispatcher observed (an HTTP 500, a timeout,
    an answer that is no result) for every rollout, is the agent's or the
    configuration's: a job script must not take it for done.
    """
    if expected == 0 or state.successes:
        return None
    classes = {failure_class for _, failure_class in state.latest_failure.values()}
    if len(classes) != 1 or not classes <= DISPATCHER_OBSERVED:
        return None
    [failure_class] = classes
    return (
        f"no rollout succeeded: every one of the {expected} rollouts failed as "
        f"{failure_class}; once the agent is fixed, rerun with --extend-attempts N "
        "(or --fresh) to run them again"
    )


# The failure classes of contracts §5 the dispatcher itself observes.
DISPATCHER_OBSERVED = frozenset(
    {
        Outcome.AGENT_REQUEST_FAILED.value,
        Outcome.AGENT_RUN_ERROR.value,
        Outcome.TIMEOUT_EXCEEDED.value,
        Outcome.PROTOCOL_VIOLATION.value,
    }
)


def file_outcomes(state: RunState) -> collections.Counter[str]:
    """A job's outcomes as its files tell them: successes and failed attempts by class."""
    outcomes = collections.Counter(state.failure_classes)
    if state.successes:
        outcomes["success"] = len(state.successes)
    return outcomes
