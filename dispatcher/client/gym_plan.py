"""The pure pieces of the Gym drop-in (``client/gym.py``): a job's rows and keys, and
the results Gym's ``run_examples`` resolves to (contracts §15)."""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from dispatcher import jsonx
from dispatcher.client.aio import AsyncClient
from dispatcher.client.wire import DATA_STATUS, INFRASTRUCTURE_STATUS, ClientError, JobStatus
from dispatcher.latency.quantile import quantile
from dispatcher.tasks.keys import (
    FAILURE_CLASS,
    FAILURE_HTTP_STATUS,
    FAILURE_MESSAGE,
    FAILURE_RESPONSE_BODY,
    FAILURE_TYPE,
    NO_PERSIST,
    NOT_DELIVERED,
    STRIPPED_KEYS,
    TASK_INDEX,
)
from dispatcher.tasks.schema import DISPATCH_DRAINED

log = structlog.get_logger(__name__)

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


class RolloutFailed(ClientError):
    """A rollout the daemon gave up on (``route_failures_to_sidecar=False``).

    ``status`` is its last attempt's HTTP error status, else 503 for a failure of
    the infrastructure (never delivered) and 422 for one of the task's data
    (contracts §12), so a trainer's typed retry budgets see the kind; ``failure``
    holds Gym's failure keys. It pickles (Ray carries it between processes).
    """

    def __init__(self, failure: dict[str, Any]) -> None:
        super().__init__(None, str(failure[FAILURE_MESSAGE]))
        self.failure = failure
        self.http_status = _http_status(failure)
        self.status = self.http_status or _status_of_kind(failure)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.failure,))


def _http_status(failure: dict[str, Any]) -> int | None:
    status = failure.get(FAILURE_HTTP_STATUS)
    if not isinstance(status, int) or isinstance(status, bool):
        return None
    # A 2xx with no result in it (a protocol violation) is not the status of a failure.
    return status if status >= 400 else None


def _status_of_kind(failure: dict[str, Any]) -> int:
    infrastructure = (
        failure.get(NOT_DELIVERED) is True or failure.get(FAILURE_CLASS) == "agent_request_failed"
    )
    return INFRASTRUCTURE_STATUS if infrastructure else DATA_STATUS


def agent_result(row: Mapping[str, Any]) -> dict[str, Any]:
    """The agent's answer in a durable row: the row without ``DISPATCHER_KEYS``."""
    return {key: value for key, value in row.items() if key not in DISPATCHER_KEYS}


def drained_result(message: str) -> dict[str, Any]:
    """Gym's result for a row that never ran (``_dispatch_drained_result``)."""
    return {
        FAILURE_CLASS: "cancelled",
        NO_PERSIST: True,
        DISPATCH_DRAINED: True,
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
        FAILURE_CLASS: classes[0] if len(classes) == 1 else "rollout_failed",
        FAILURE_TYPE: "RolloutFailed",
        FAILURE_MESSAGE: (
            f"the rollout ended failed on the dispatcher (job {job.job_id}'s failed attempts: "
            f"{counts}); its failure rows are in the job's rollouts_failures.jsonl"
        ),
        FAILURE_HTTP_STATUS: None,
        FAILURE_RESPONSE_BODY: None,
    }


def streamed_failure(row: Mapping[str, Any]) -> dict[str, Any]:
    """What a rollout whose final failure row the daemon streamed resolves to: that
    row's Gym failure keys (its class, HTTP status and response body as they came)."""
    return {
        FAILURE_CLASS: row.get(FAILURE_CLASS) or "rollout_failed",
        FAILURE_TYPE: row.get(FAILURE_TYPE) or "RolloutFailed",
        FAILURE_MESSAGE: row.get(FAILURE_MESSAGE) or "the rollout ended failed",
        FAILURE_HTTP_STATUS: row.get(FAILURE_HTTP_STATUS),
        FAILURE_RESPONSE_BODY: row.get(FAILURE_RESPONSE_BODY),
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


def cut(
    examples: Sequence[Mapping[str, Any]], positions: list[int], bound: int | None
) -> list[list[int]]:
    """``positions`` in pieces whose rows take at most ``bound`` bytes of a submit's
    body (a row bigger alone is a piece), last piece first."""
    if bound is None:
        return [positions]
    pieces: list[list[int]] = [[]]
    size = 0
    for position in positions:
        row_bytes = bytes_of(examples, [position])
        if pieces[-1] and size + row_bytes > bound:
            pieces.append([])
            size = 0
        pieces[-1].append(position)
        size += row_bytes
    return pieces[::-1]


def bytes_of(examples: Sequence[Mapping[str, Any]], positions: list[int]) -> int:
    """About what the rows at ``positions`` take in a submit's body."""
    return sum(len(jsonx.dumps(examples[p])) + 1 for p in positions)


@dataclass
class Admits:
    """Which examples may start, in order: Gym's resident tasks. ``window`` at first,
    then one more for each result the trainer took; none once ``drained``."""

    total: int
    window: int
    granted: int = 0
    drained: bool = False

    def due(self, taken: int) -> int:
        return min(self.total, self.window + taken)

    def of(self, positions: Sequence[int]) -> int:
        """How many of a job's examples (``positions``, consecutive) are admitted."""
        return max(0, min(self.granted - positions[0], len(positions)))


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


class LatencyTracker(Protocol):
    def record(self, seconds: float) -> None: ...

    def record_drained(self) -> None: ...


@dataclass(frozen=True)
class Options:
    """Gym's keyword arguments that mean something here."""

    failures_as_results: bool = False
    max_attempts: int | None = 1
    max_resident_tasks: int | None = None
    dispatch_budget_s: float | None = None
    drain_margin_s: float | None = None
    latency_tracker: LatencyTracker | None = None


async def cancel_jobs(client: AsyncClient, job_ids: list[str]) -> None:
    for job_id in job_ids:
        try:
            await client.cancel(job_id)
        except ClientError as exc:
            log.warning("gym_job_cancel_failed", job_id=job_id, error=str(exc))


def leaf(error: Exception) -> Exception:
    """The first error inside a task group's ``ExceptionGroup``, or the error itself."""
    while isinstance(error, ExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


Pair = tuple[dict[str, Any], dict[str, Any]]


class Collected(Protocol):
    """What ``Completions`` iterates: a ``run_examples`` call's collection (gym.py)."""

    async def next_completion(self) -> Pair: ...

    async def aclose(self) -> None: ...


class Completions:
    """The iterator ``run_examples`` returns: ``len(examples)`` awaitables, completion order."""

    def __init__(self, collection: Collected, total: int) -> None:
        self._collection = collection
        self._left = total

    def __len__(self) -> int:
        return self._left

    def __iter__(self) -> Iterator[Awaitable[Pair]]:
        return self

    def __next__(self) -> Awaitable[Pair]:
        if self._left <= 0:
            raise StopIteration
        self._left -= 1
        return self._collection.next_completion()

    async def aclose(self) -> None:
        await self._collection.aclose()
