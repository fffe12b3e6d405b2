"""A drop-in for trainers that call NeMo Gym's Python API (contracts §15).

NeMo RL drives Gym in-process through ``RolloutCollectionHelper().run_examples(
examples)``; the same loop runs on ``dispatcher serve`` by changing one line::

    from dispatcher.client.gym import RolloutCollectionHelper

    helper = RolloutCollectionHelper()  # DISPATCHER_URL, else a daemon of its own
    for future in helper.run_examples(examples):
        row, result = await future  # in completion order, as Gym's

``run_examples`` (Gym 0.7.0's and Main's signature) returns an iterator of
``len(examples)`` awaitables, each resolving to ``(row, result)`` in
completion order; ``row`` is the caller's example, the same object.
``result`` is what the agent's ``/run`` answered, without the keys the
dispatcher owns or rewrites (``DISPATCHER_KEYS``: the identity keys
``_ng_task_index``, ``_ng_rollout_index``, ``agent_ref`` and the others of
contracts §3, ``_ng_seq``, the policy versions, ``_ng_run_id``, and the
capture view ``ng_trajectory``/``ng_perf``/``ng_model_call_capture``). An agent
that echoes its request has the identity keys in its own answer; they are in
``row``. The full durable row stays in the job's output on the daemon. An
answer carrying ``_ng_failure_class`` is a failure here (contracts §3),
where Gym hands it back as a result.

Behind it, the examples are a job on the daemon (``num_repeats`` 1), streamed
back as rows become durable. The first ``await`` submits it. Rows go to the
agents as the dispatcher sends them (contracts §1, §3): an example without
``_ng_task_index`` gets one of its own; ``_ng_rollout_index`` is the
dispatcher's (0, 1, ... per task within the job). Jobs are submitted with
``max_attempts`` 1 (the helper's ``max_attempts``): Gym's helper never
retries a rollout, its caller does. The daemon resumes as for any job
(contracts §5, §11).

Gym's keyword arguments:

- ``max_resident_tasks``: at most that many examples at agents at once. All
  are one job whose ``max_in_flight`` it is: the daemon starts the next as one
  leaves its agent, and the rows come back on one stream. With a dispatch
  budget, examples are submitted as slots free up (a job of the examples that
  fit), so that each is checked against the budget then. ``ValueError``
  below 1, as Gym.
- ``dispatch_budget_s``, ``drain_margin_s``: an example not submitted when
  less than the margin is left of the budget (counted from this call) never
  runs and resolves to Gym's drained result (``_ng_failure_class``
  ``"cancelled"``, ``_ng_no_persist``, ``_ng_dispatch_drained``). Without a
  margin it adapts to the p75 of the rollouts' durations once five are in,
  as Gym. The check is made where examples are handed to the daemon: with
  ``max_resident_tasks`` as slots free up, without it once for all.
- ``route_failures_to_sidecar``: a rollout that ended failed (its attempts
  spent, or a terminal failure), known as its failure row is durable (the
  daemon streams it), resolves to Gym's failure result (``_ng_failure_class``,
  ``_ng_failure_type``, ``_ng_failure_message``, ``_ng_failure_http_status``,
  ``_ng_failure_response_body``, from that row); without it its awaitable
  raises ``RolloutFailed``, then, with the last attempt's HTTP status.
- ``latency_tracker``: Gym's ``DispatchLatencyTracker`` (anything with
  ``record(seconds)`` and ``record_drained()``) gets each rollout's duration.
- ``head_server_config``: with a URL (or ``DISPATCHER_URL``) not used, the
  daemon's agents come from its own flags; without one, the head server
  whose agents the helper's own daemon runs (None: Gym's default, the
  ``head_server`` of Gym's global config).
- ``semaphore``: not used: the daemon's ``--concurrency`` bounds requests.
- ``environment_server_name``: only None; rows route by ``agent_ref``.

A job refused as bigger than ``--max-body-bytes`` (413) is cut into jobs of
half its bytes, the bound kept; an example too big alone resolves to the 413.

A job that ends cancelled or incomplete resolves its unrun examples to the
drained result; a job that fails raises ``ClientError`` from theirs.
``Completions.aclose()`` stops early: the jobs still running are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import structlog

from dispatcher import jsonx
from dispatcher.client.aio import AsyncClient
from dispatcher.client.embedded import EmbeddedDaemon, head_server_url
from dispatcher.client.gym_plan import (
    DISPATCHER_KEYS,
    Completions,
    Durations,
    JobPlan,
    LatencyTracker,
    Options,
    RolloutFailed,
    agent_result,
    budget_message,
    cancel_jobs,
    drained_result,
    failure_result,
    leaf,
    plan_job,
    streamed_failure,
)
from dispatcher.client.wire import ClientError
from dispatcher.lifecycle import JobState
from dispatcher.tasks.keys import DISPATCH_KEY, ROLLOUT_INDEX, TASK_INDEX

__all__ = [
    "DISPATCHER_KEYS",
    "Completions",
    "RolloutCollectionHelper",
    "RolloutFailed",
    "agent_result",
    "drained_result",
]

log = structlog.get_logger(__name__)

Pair = tuple[dict[str, Any], dict[str, Any]]


class Collection:
    """One ``run_examples`` call: owns its jobs, what is resolved, and the completions queue.

    Everything it learns ends in ``_resolve``, exactly once per example; a
    failure of its own task resolves every example still open with it, so no
    awaitable waits forever.
    """

    def __init__(
        self,
        locate: Callable[[], Awaitable[Callable[[], AsyncClient]]],
        examples: Sequence[dict[str, Any]],
        options: Options,
    ) -> None:
        self._locate = locate
        self._connect: Callable[[], AsyncClient] | None = None
        self._client: AsyncClient | None = None
        self._examples = examples
        self._options = options
        self._completions: asyncio.Queue[Pair | BaseException] = asyncio.Queue()
        self._resolved: set[int] = set()
        self._next = 0  # examples before it are submitted (or drained)
        self._room = asyncio.Event()
        self._durations = Durations()
        self._jobs: list[str] = []
        # The bytes of a job's rows at most, once a 413 (a body over the daemon's
        # --max-body-bytes) has taught one.
        self._body_bytes: int | None = None
        self._prefix = f"gym-{uuid.uuid4().hex[:12]}"
        # Gym counts the budget from the call, not from the first await.
        budget = options.dispatch_budget_s
        self._deadline = None if budget is None else time.monotonic() + budget
        self._task: asyncio.Task[None] | None = None
        self._taken = 0
        # Each job's max_in_flight: the window, when the daemon refills it.
        self._window: int | None = None

    async def next_completion(self) -> Pair:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._collect())
        item = await self._completions.get()
        self._taken += 1
        if self._taken == len(self._examples):
            # The last result: nothing of the collection outlives it (its streams
            # end as their examples resolve, its session closes).
            await asyncio.gather(self._task, return_exceptions=True)
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        """Stop: the jobs still running are cancelled; open examples raise CancelledError."""
        if self._task is None or self._task.done():
            return
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        if self._client is None or self._connect is None or not self._client.reached:
            return  # the daemon never answered: no job was created
        # A fresh client: the cancelled task's is closed, and awaits in it are cut short.
        async with self._connect() as client:
            await cancel_jobs(client, self._jobs)

    # --- the collection task ---

    async def _collect(self) -> None:
        try:
            self._connect = await self._locate()
            self._client = client = self._connect()
            async with client:
                try:
                    await self._feed()
                except Exception:
                    # A collection that fails stops its jobs on the daemon (none
                    # was created if the daemon never answered).
                    if client.reached:
                        await cancel_jobs(client, self._jobs)
                    raise
        except asyncio.CancelledError:
            self._resolve_rest(asyncio.CancelledError())
            raise
        except Exception as exc:
            error = leaf(exc)
            log.warning("gym_collection_failed", error=f"{type(error).__name__}: {error}")
            self._resolve_rest(error)

    async def _feed(self) -> None:
        """Submit the examples as jobs, a window at a time, and follow each job."""
        total = len(self._examples)
        window = self._options.max_resident_tasks or total
        if self._deadline is None and window < total:
            # One job whose window the daemon refills as each rollout leaves its
            # agent, its rows on one stream (its pieces, if cut, one after another).
            self._window, self._next = window, total
            async for job_id, plan in self._hand_over(range(total)):
                await self._follow(job_id, plan)
            return
        async with asyncio.TaskGroup() as jobs:
            while self._next < total:
                count = await self._room_for(window, total)
                drained = self._drain_message()
                if drained is not None:
                    self._drain_rest(drained)
                    return
                positions = range(self._next, self._next + count)
                self._next += count
                async for job_id, plan in self._hand_over(positions):
                    jobs.create_task(self._follow(job_id, plan))

    async def _room_for(self, window: int, total: int) -> int:
        """How many examples to submit next: as many as the window has free, once one is."""
        while True:
            free = window - (self._next - len(self._resolved))
            if free >= 1:
                return min(free, total - self._next)
            self._room.clear()
            await self._room.wait()

    def _drain_message(self) -> str | None:
        if self._deadline is None:
            return None
        remaining = self._deadline - time.monotonic()
        margin = self._durations.margin(self._options.drain_margin_s)
        if remaining <= 0 or (margin is not None and remaining < margin):
            return budget_message(remaining, margin)
        return None

    def _drain_rest(self, message: str) -> None:
        for position in range(self._next, len(self._examples)):
            if self._options.latency_tracker is not None:
                self._options.latency_tracker.record_drained()
            self._resolve(position, drained_result(message))
        self._next = len(self._examples)

    async def _hand_over(self, positions: range) -> AsyncIterator[tuple[str, JobPlan]]:
        """Submit ``positions`` as jobs whose bodies the daemon takes (``--max-body-bytes``).

        A job it refuses as too big (413) sets the bound of a job's rows to half that
        body's bytes, from then on: later windows are cut before they are sent. An
        example too big alone resolves to the daemon's 413.
        """
        pieces = self._cut(list(positions))
        while pieces:
            piece = pieces.pop()
            plan = plan_job(self._examples, piece)
            try:
                yield await self._submit(plan), plan
            except ClientError as exc:
                if exc.status != 413:
                    raise
                if len(piece) == 1:
                    self._resolve(piece[0], exc)
                    continue
                self._body_bytes = self._bytes_of(piece) // 2
                pieces += self._cut(piece)

    def _cut(self, positions: list[int]) -> list[list[int]]:
        """``positions`` in pieces of rows under the learned bound, last piece first."""
        if self._body_bytes is None:
            return [positions]
        pieces: list[list[int]] = [[]]
        size = 0
        for position in positions:
            row_bytes = self._bytes_of([position])
            if pieces[-1] and size + row_bytes > self._body_bytes:
                pieces.append([])
                size = 0
            pieces[-1].append(position)
            size += row_bytes
        return pieces[::-1]

    def _bytes_of(self, positions: list[int]) -> int:
        """About what the rows at ``positions`` take in a submit's body."""
        return sum(len(jsonx.dumps(self._examples[p])) + 1 for p in positions)

    async def _submit(self, plan: JobPlan) -> str:
        job_id = f"{self._prefix}-{len(self._jobs)}"
        self._jobs.append(job_id)
        try:
            # With a job_id the submit is idempotent, so a lost answer is retried.
            await self._api.submit(
                plan.rows, job_id=job_id, num_repeats=1, max_attempts=self._options.max_attempts,
                max_in_flight=self._window,
            )  # fmt: skip
        except ClientError as exc:
            if exc.status == 413:
                # Refused before it was read: no such job (its id is used again).
                self._jobs.pop()
            raise
        return job_id

    async def _follow(self, job_id: str, plan: JobPlan) -> None:
        """Resolve the job's examples: each as its row lands, the rest once the job is final."""
        rows = self._api.results(job_id, failures=True)
        try:
            async with contextlib.aclosing(rows):
                async for row in rows:
                    if "failure" in row:
                        self._failed(plan, row["failure"])
                    else:
                        self._succeed(plan, row)
                    if self._all_resolved(plan):
                        return  # the stream's end line adds nothing: it is closed now
            left = [p for p in plan.positions if p not in self._resolved]
            if left:
                await self._resolve_left(job_id, rows.final_state, left)
        except Exception as exc:
            for position in plan.positions:
                self._resolve(position, exc)

    async def _resolve_left(
        self, job_id: str, state: JobState | None, positions: list[int]
    ) -> None:
        """The examples of a final job that have no row."""
        if state in (JobState.CANCELLED, JobState.INCOMPLETE):
            # Never ran to an end: as Gym's rows the dispatch budget never started.
            for position in positions:
                self._resolve(position, drained_result(f"not run: job {job_id} ended {state}"))
            return
        job = await self._api.status(job_id)
        # Every rollout final: these ended failed. A job is also failed, with none
        # left, when none of its rollouts succeeded and all failed alike.
        if state is JobState.DONE or (state is JobState.FAILED and job.remaining == 0):
            failure = failure_result(job)
            for position in positions:
                self._fail(position, failure)
        else:
            raise ClientError(None, f"job {job_id} ended {state}: {job.error}")

    @property
    def _api(self) -> AsyncClient:
        assert self._client is not None
        return self._client

    def _all_resolved(self, plan: JobPlan) -> bool:
        return all(p in self._resolved for p in plan.positions)

    def _succeed(self, plan: JobPlan, row: dict[str, Any]) -> None:
        position = plan.by_key.get((row[TASK_INDEX], row[ROLLOUT_INDEX]))
        if position is None or position in self._resolved:
            return
        duration = (row.get(DISPATCH_KEY) or {}).get("duration_s")
        if isinstance(duration, int | float):
            self._durations.add(float(duration))
            if self._options.latency_tracker is not None:
                self._options.latency_tracker.record(float(duration))
        self._resolve(position, agent_result(row))

    def _failed(self, plan: JobPlan, row: dict[str, Any]) -> None:
        """A rollout's final failure, streamed as it happened."""
        task, rollout = row.get(TASK_INDEX), row.get(ROLLOUT_INDEX)
        if isinstance(task, int) and isinstance(rollout, int):
            position = plan.by_key.get((task, rollout))
            if position is not None:
                self._fail(position, streamed_failure(row))

    def _fail(self, position: int, failure: dict[str, Any]) -> None:
        if self._options.failures_as_results:
            self._resolve(position, dict(failure))
        else:
            self._resolve(position, RolloutFailed(failure))

    def _resolve(self, position: int, outcome: dict[str, Any] | BaseException) -> None:
        if position in self._resolved:
            return
        self._resolved.add(position)
        if isinstance(outcome, BaseException):
            self._completions.put_nowait(outcome)
        else:
            self._completions.put_nowait((self._examples[position], outcome))
        self._room.set()

    def _resolve_rest(self, error: BaseException) -> None:
        for position in range(len(self._examples)):
            self._resolve(position, error)


class RolloutCollectionHelper:
    """Gym's ``RolloutCollectionHelper`` on ``dispatcher serve`` (see the module).

    ``url``: the daemon's; default ``DISPATCHER_URL``; without either, a daemon of
    the helper's own is started on loopback (``client/embedded.py``): its
    process here, importing, its service at the first ``run_examples``, which
    names the head server; stopped by ``close()`` or at exit.
    ``token``: the daemon's API token (default ``DISPATCHER_API_TOKEN``);
    ``max_attempts``: each job's attempt cap (contracts §12), 1 by default as
    Gym's helper never retries (the trainer's own retry budgets apply); None
    leaves the daemon's ``--max-attempts``; ``client_options`` go to
    ``AsyncClient`` (timeouts, TLS).
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        max_attempts: int | None = 1,
        **client_options: Any,
    ) -> None:
        if max_attempts is not None and max_attempts < 1:
            raise ValueError("max_attempts must be >= 1 (or None for the daemon's)")
        self.url = url or os.environ.get("DISPATCHER_URL") or None
        self._token = token
        self._max_attempts = max_attempts
        self._client_options = client_options
        self._head_server: str | None = None
        self._starting = threading.Lock()
        # Its own daemon starts now, importing while the trainer sets up: the
        # imports are most of its start (client/embedded.py).
        self._daemon = EmbeddedDaemon.spawn() if self.url is None else None

    @property
    def daemon(self) -> EmbeddedDaemon | None:
        """The helper's own daemon, once started (None with a URL)."""
        return self._daemon

    def close(self) -> None:
        """Stop the helper's own daemon, if it started one (blocking; idempotent)."""
        if self._daemon is not None:
            self._daemon.stop()

    def __enter__(self) -> RolloutCollectionHelper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run_examples(
        self,
        examples: list[dict[str, Any]],
        head_server_config: Any = None,
        semaphore: Any = None,
        route_failures_to_sidecar: bool = False,
        environment_server_name: str | None = None,
        *,
        max_resident_tasks: int | None = None,
        dispatch_budget_s: float | None = None,
        drain_margin_s: float | None = None,
        latency_tracker: LatencyTracker | None = None,
    ) -> Completions:
        """An iterator of awaitables, one per example, each ``(row, result)`` (Gym's contract)."""
        if max_resident_tasks is not None and max_resident_tasks < 1:
            raise ValueError("max_resident_tasks must be >= 1")
        if environment_server_name is not None:
            raise ValueError(
                "environment_server_name: the dispatcher routes rows by agent_ref only; "
                "give the agent each row runs on"
            )
        options = Options(
            failures_as_results=route_failures_to_sidecar,
            max_attempts=self._max_attempts,
            max_resident_tasks=max_resident_tasks,
            dispatch_budget_s=dispatch_budget_s,
            drain_margin_s=drain_margin_s,
            latency_tracker=latency_tracker,
        )

        async def locate() -> Callable[[], AsyncClient]:
            url = self.url
            if url is None:
                url = await asyncio.to_thread(self._own_daemon, head_server_config)
            return functools.partial(AsyncClient, url, token=self._token, **self._client_options)

        return Completions(Collection(locate, examples, options), len(examples))

    def _own_daemon(self, head_server_config: Any) -> str:
        """The URL of the helper's own daemon, its service started for
        ``head_server_config``'s agents on the first call (blocking)."""
        with self._starting:
            head = head_server_url(head_server_config)
            if self._daemon is None or self._daemon.process.poll() is not None:
                self._daemon = EmbeddedDaemon.spawn()  # stopped by close(): a new one
            if not self._daemon.configured:
                self._daemon.configure(head)
                self._head_server = head
            elif head != self._head_server:
                raise ValueError(
                    f"head_server_config: {head} is not the head server this helper's "
                    f"daemon serves ({self._head_server}); use one helper per Gym stack"
                )
            return self._daemon.url
