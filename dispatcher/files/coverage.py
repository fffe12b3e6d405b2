"""NeMo Gym Main's coverage and status files, as pure functions of a run's state (contracts §15).

- ``X_coverage.json``, written at the end of every hop: how much of the input
  the run's rows cover. ``expected`` rollouts are ``successful`` (of which
  ``masked``: ``mask_sample: true``, and ``unscored``: no finite numeric
  reward), ``failed`` (final without a success), or not final yet: left
  without a result by this hop on purpose (``intentionally_omitted``: drained,
  cancelled, kill-shaped), never sent to an agent in any hop
  (``never_dispatched``), or waiting to be retried (``retry_pending``).
  ``attempts`` are the success and failure rows, ``counted_failures`` those
  that spend an attempt, ``attempts_exhausted`` the rollouts final by the
  attempt cap alone.
- ``X_status.json``, refreshed during the run: per agent its expected,
  completed (final) and remaining rollouts, its failing rollouts by their
  latest failure class and its aggregation status (Gym's ``batch_status``
  names).

Both are written whole and atomically (``write_json_atomic``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from dispatcher.files.resume import RunState

SCHEMA_VERSION: Final = "1"


@dataclass(frozen=True, slots=True)
class Omissions:
    """Rollouts this hop left without a result on purpose, and how many of those had
    no attempt on record before (so they are not counted as never dispatched too)."""

    total: int = 0
    without_attempts: int = 0


def final_count(state: RunState) -> int:
    """Rollouts with a final outcome (the one finality rule, contracts §5)."""
    failed = sum(
        1 for key in state.latest_failure if key not in state.successes and state.is_final(key)
    )
    return len(state.successes) + failed


def coverage(state: RunState, expected: int, omitted: Omissions) -> dict[str, Any]:
    """The body of ``X_coverage.json`` at the end of a hop."""
    successful = len(state.successes)
    failed = final_count(state) - successful
    retry_pending = sum(1 for key in state.latest_failure if not state.is_final(key))
    not_final = max(0, expected - successful - failed)
    counted = sum(state.failed_attempts.values())
    return {
        "schema_version": SCHEMA_VERSION,
        "expected": expected,
        "successful": successful,
        "failed": failed,
        "masked": state.masked,
        "unscored": state.unscored,
        "intentionally_omitted": omitted.total,
        "never_dispatched": max(0, not_final - retry_pending - omitted.without_attempts),
        "retry_pending": retry_pending,
        "attempts": successful + sum(state.failure_classes.values()),
        "counted_failures": counted,
        "attempts_exhausted": state.exhausted,
        "completion_fraction": round((successful + failed) / expected, 6) if expected else 1.0,
        "complete": not_final == 0,
    }


def status(
    state: RunState,
    run_id: str | None,
    expected_by_agent: Mapping[str, int],
    aggregation: Mapping[str, str],
) -> dict[str, Any]:
    """The body of ``X_status.json``: per agent progress, failures and aggregation."""
    final_failures: Counter[str] = Counter()
    failing: dict[str, Counter[str]] = {}
    for key, (agent, failure_class) in state.latest_failure.items():
        if key in state.successes:
            continue
        failing.setdefault(agent, Counter())[failure_class] += 1
        final_failures[agent] += state.is_final(key)
    agents = {}
    for agent, expected in sorted(expected_by_agent.items()):
        completed = state.agent_successes[agent] + final_failures[agent]
        agents[agent] = {
            "expected_rollout_count": expected,
            "completed_rollout_count": completed,
            "remaining_rollout_count": max(0, expected - completed),
            "failures_by_class": dict(sorted(failing.get(agent, Counter()).items())),
            **_aggregation(aggregation.get(agent, "pending")),
        }
    return {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id,
        "updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "agents": agents,
    }


def _aggregation(state: str) -> dict[str, Any]:
    if state == "error":
        # The run is complete and the agent gave no metrics (no /aggregate_metrics).
        return {
            "aggregation_status": "error",
            "aggregation_error": {"type": "MissingAggregateMetricsEntry"},
        }
    return {"aggregation_status": state}
