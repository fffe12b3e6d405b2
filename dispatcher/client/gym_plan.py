"""The pure pieces of the Gym drop-in (``client/gym.py``): a job's rows and keys, and
the results Gym's ``run_examples`` resolves to (contracts §15)."""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dispatcher.client.wire import JobStatus
from dispatcher.latency.quantile import quantile
from dispatcher.tasks.keys import STRIPPED_KEYS, TASK_INDEX

# Keys of a durable row that are the dispatcher's, not the agent's answer (declared
# in tasks/schema.py): those it writes into every row, and the trajectory it rewrites.
DISPATCHER_KEYS = STRIPPED_KEYS
# Gym's adaptive drain margin: the p75 of durations, once this many are known.
_MARGIN_MIN_SAMPLES = 5
_MARGIN_QUANTILE = 0.75
_FAILURE_CLASSES = frozenset(
    {
        "agent_request_failed",
        "agent_run_error",
        "timeout_exceeded",
        "protocol_violation",
        "agent_reported_failure",
    }
)


def agent_result(row: Mapping[str, Any]) -> dict[str, Any]:
    """The agent's answer in a durable row: the row without ``DISPATCHER_KEYS``."""
    return {key: value for key, value in row.items() if key not in DISPATCHER_KEYS}


def drained_result(message: str) -> dict[str, Any]:
    """Gym's result for a row that never ran (``_dispatch_drained_result``)."""
    return {
        "_ng_failure_class": "cancelled",
        "_ng_no_persist": True,
        "_ng_dispatch_drained": True,
        "error_message": message,
    }


def budget_message(remaining_s: float, margin_s: float | None) -> str:
    if margin_s is None:
        return "not dispatched: dispatch budget exhausted"
    return (
        f"not dispatched: {remaining_s:.0f}s left in dispatch budget, "
        f"below the {margin_s:.0f}s drain margin"
    )


def failure_result(job: JobStatus) -> dict[str, Any]:
    """What a rollout the daemon gave up on resolves to (Gym's failure keys).

    The daemon streams no failure rows: the class is the job's when all its
    failed attempts have one, and the job's attempts by class are named.
    """
    classes = sorted(c for c, n in job.outcomes.items() if n and c in _FAILURE_CLASSES)
    counts = ", ".join(f"{c} {job.outcomes[c]}" for c in classes) or "none counted"
    return {
        "_ng_failure_class": classes[0] if len(classes) == 1 else "rollout_failed",
        "_ng_failure_type": "RolloutFailed",
        "_ng_failure_message": (
            f"the rollout ended failed on the dispatcher (job {job.job_id}'s failed attempts: "
            f"{counts}); its failure rows are in the job's rollouts_failures.jsonl"
        ),
        "_ng_failure_http_status": None,
        "_ng_failure_response_body": None,
    }


@dataclass
class JobPlan:
    """One job's examples: the rows submitted and where each row's result goes back to."""

    positions: list[int]
    rows: list[dict[str, Any]]
    by_key: dict[tuple[int, int], int] = field(default_factory=dict)


def plan_job(examples: Sequence[Mapping[str, Any]], positions: Sequence[int]) -> JobPlan:
    """The rows of a job and their keys, numbered as the daemon will (contracts §1).

    A row keeps its own ``_ng_task_index``; one without gets a fresh one. The
    daemon numbers rollouts 0, 1, ... per task in row order, as done here.
    """
    own = [examples[p].get(TASK_INDEX) for p in positions]
    fresh = max((t for t in own if isinstance(t, int) and not isinstance(t, bool)), default=-1)
    plan = JobPlan(positions=list(positions), rows=[])
    next_rollout: dict[int, int] = defaultdict(int)
    for position, task in zip(positions, own, strict=True):
        row = dict(examples[position])
        if task is None:
            fresh += 1
            task = row[TASK_INDEX] = fresh
        plan.rows.append(row)
        if isinstance(task, int):
            plan.by_key[(task, next_rollout[task])] = position
            next_rollout[task] += 1
    return plan


class Durations:
    """Rollout durations, sorted, for Gym's adaptive drain margin."""

    def __init__(self) -> None:
        self._sorted: list[float] = []

    def add(self, seconds: float) -> None:
        if seconds > 0:
            bisect.insort(self._sorted, seconds)

    def margin(self, configured_s: float | None) -> float | None:
        if configured_s is not None:
            return configured_s
        if len(self._sorted) < _MARGIN_MIN_SAMPLES:
            return None
        return quantile(self._sorted, _MARGIN_QUANTILE)
