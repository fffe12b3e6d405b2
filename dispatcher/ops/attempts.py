"""A run's attempts as ``dispatcher report`` reads them: one streaming pass, few keys.

Each success or failure row is one attempt. Of a row only the keys a report
needs are decoded (``_ng_dispatch``, the identity, agent, reward, ``ng_perf``
and the failure keys): the rest of a row, megabytes or not, is skipped and
never turned into objects (``FactsReader``). What is kept per
attempt fits in a few compact arrays, so millions of rows stay cheap.
"""

from __future__ import annotations

import math
from array import array
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dispatcher.files.contracts import DISPATCH_KEY as DISPATCH
from dispatcher.files.contracts import RunManifest
from dispatcher.files.delivery_history import HopDelivery
from dispatcher.files.resume import OutputPaths, RunState, nonblank_lines
from dispatcher.ops.runfiles import agent_name
from dispatcher.ops.status import Standing, standing
from dispatcher.outcome import Outcome
from dispatcher.tasks.keys import (
    AGENT_REF,
    FAILURE_CLASS,
    FAILURE_TERMINAL,
    NOT_DELIVERED,
    OMITTED_ROLLOUT,
    ROLLOUT_INDEX,
    TASK_INDEX,
    FactsReader,
    row_key,
    task_of,
)
from dispatcher.tasks.schema import PERF, REWARD

SUCCESS, FAILURE = 0, 1
SUCCESS_OUTCOME = Outcome.SUCCESS.value
NO_REPLICA = "<none>"

_IDENTITY = (TASK_INDEX, ROLLOUT_INDEX, AGENT_REF)
_SUCCESS_KEYS = (*_IDENTITY, REWARD, DISPATCH, PERF)
# A failure row's keys for RunState.add_failure, and its timing.
_FAILURE_KEYS = (
    *_IDENTITY,
    DISPATCH,
    FAILURE_CLASS,
    FAILURE_TERMINAL,
    NOT_DELIVERED,
    OMITTED_ROLLOUT,
    PERF,
)
_FINAL = frozenset({Standing.SUCCEEDED, Standing.TERMINAL, Standing.ATTEMPTS_USED_UP})
_NAN = math.nan


class Names:
    """Strings numbered in order of first sight: an attempt keeps a small int, not the name."""

    def __init__(self, *first: str) -> None:
        self._index = {name: i for i, name in enumerate(first)}

    def number(self, name: str) -> int:
        return self._index.setdefault(name, len(self._index))

    @property
    def names(self) -> list[str]:
        return list(self._index)


@dataclass
class Attempts:
    """One entry per row; NaN where the row carried no timing. Compact for millions of rows."""

    starts: array[float] = field(default_factory=lambda: array("d"))
    durations: array[float] = field(default_factory=lambda: array("d"))
    kinds: bytearray = field(default_factory=bytearray)
    timeouts: bytearray = field(default_factory=bytearray)
    # For the timeline: each attempt's agent, replica and outcome, numbered in the Names below.
    agents: array[int] = field(default_factory=lambda: array("I"))
    replicas: array[int] = field(default_factory=lambda: array("I"))
    outcomes: array[int] = field(default_factory=lambda: array("I"))
    agent_names: Names = field(default_factory=Names)
    replica_names: Names = field(default_factory=Names)
    outcome_names: Names = field(default_factory=lambda: Names(SUCCESS_OUTCOME))

    def add(self, row: dict[str, Any], outcome: str, agent: str | None = None) -> None:
        """One attempt; ``agent``: the row's ``agent_name`` when the caller has it already."""
        started, duration = row_timing(row)
        self.starts.append(_NAN if started is None else started)
        self.durations.append(_NAN if duration is None else duration)
        self.kinds.append(SUCCESS if outcome == SUCCESS_OUTCOME else FAILURE)
        self.timeouts.append(outcome == Outcome.TIMEOUT_EXCEEDED)
        self.agents.append(self.agent_names.number(agent or agent_name(row)))
        self.replicas.append(self.replica_names.number(_replica(row)))
        self.outcomes.append(self.outcome_names.number(outcome))


@dataclass
class RewardTally:
    successes: int = 0
    rewarded: int = 0
    total: float = 0.0
    positive: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "successes": self.successes,
            "with_reward": self.rewarded,
            "mean": self.total / self.rewarded if self.rewarded else None,
            "positive_share": self.positive / self.rewarded if self.rewarded else None,
        }


@dataclass
class ReportData:
    """What one streaming pass over the three files collects."""

    attempts: Attempts = field(default_factory=Attempts)
    rewards: dict[str, RewardTally] = field(default_factory=lambda: defaultdict(RewardTally))
    passed: set[int] = field(default_factory=set)
    # (agent, task) -> [rollouts with a final outcome, of them passed]
    tasks: dict[tuple[str, int], list[int]] = field(default_factory=lambda: defaultdict(_pair))


def _pair() -> list[int]:
    return [0, 0]


def iter_facts(path: Path, reader: FactsReader) -> Iterator[dict[str, Any] | None]:
    for _, line in nonblank_lines(path):
        yield reader.read(line)


def row_timing(row: dict[str, Any]) -> tuple[float | None, float | None]:
    """``(started_at, duration_s)`` of a row, each None when the row does not say."""
    started = duration = None
    stamp = row.get(DISPATCH)
    if isinstance(stamp, dict):
        started = _number(stamp.get("started_at"))
        duration = _number(stamp.get("duration_s"))
    if duration is None:
        perf = row.get(PERF)
        latency_ms = _number(perf.get("total_latency_ms")) if isinstance(perf, dict) else None
        duration = latency_ms / 1000.0 if latency_ms is not None else None
    return started, duration


def _replica(row: dict[str, Any]) -> str:
    stamp = row.get(DISPATCH)
    replica = stamp.get("replica") if isinstance(stamp, dict) else None
    return replica if isinstance(replica, str) and replica else NO_REPLICA


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


_SUCCESSES = FactsReader(_SUCCESS_KEYS)
_FAILURES = FactsReader(_FAILURE_KEYS)
_INPUTS = FactsReader(_IDENTITY)


def collect(paths: OutputPaths, max_attempts: int) -> ReportData:
    """One streaming read of successes, failures, then materialized rows."""
    data = ReportData()
    state = RunState(max_attempts=max_attempts)
    for row in iter_facts(paths.output, _SUCCESSES):
        key = row_key(row)
        if row is None or key is None or key in state.successes:
            continue
        state.successes.add(key)
        agent = agent_name(row)
        data.attempts.add(row, SUCCESS_OUTCOME, agent)
        _note_reward(data, key, row, agent)
    for row in iter_facts(paths.failures, _FAILURES):
        key = row_key(row)
        if row is None or key is None:
            continue
        failure_class = state.add_failure(key, row)
        if failure_class is None:
            continue  # an omitted rollout's row: no attempt (contracts §15)
        data.attempts.add(row, failure_class)
    _collect_tasks(paths, state, data)
    return data


def _note_reward(data: ReportData, key: int, row: dict[str, Any], agent: str) -> None:
    tally = data.rewards[agent]
    tally.successes += 1
    reward = row.get("reward")
    value = float(reward) if isinstance(reward, int | float) else None
    if value is None or not math.isfinite(value):
        return
    tally.rewarded += 1
    tally.total += value
    if value > 0:
        tally.positive += 1
        data.passed.add(key)


def _collect_tasks(paths: OutputPaths, state: RunState, data: ReportData) -> None:
    seen: set[int] = set()
    for row in iter_facts(paths.materialized, _INPUTS):
        key = row_key(row)
        if row is None or key is None or key in seen:
            continue
        seen.add(key)
        if standing(state, key) not in _FINAL:
            continue
        counts = data.tasks[(agent_name(row), task_of(key))]
        counts[0] += 1
        counts[1] += key in data.passed


@dataclass(frozen=True)
class RunRead:
    """What one pass over a run's files gives the text report and its pictures."""

    output: Path
    manifest: RunManifest | None
    data: ReportData

    @property
    def hops(self) -> list[HopDelivery]:
        return list(self.manifest.delivery_history or []) if self.manifest is not None else []
