"""One ``run_examples`` call of the Gym drop-in (``client/gym.py``, contracts §15):
its job on the daemon, what may start (Gym's resident tasks, its budget), and
each example resolved once, in completion order."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import structlog

from dispatcher.client.admits import AdmitChannel
from dispatcher.client.aio import AsyncClient
from dispatcher.client.gym_plan import (
    Admits,
    Durations,
    JobPlan,
    Options,
    RolloutFailed,
    agent_result,
    budget_message,
    bytes_of,
    cancel_jobs,
    cut,
    drained_result,
    failure_result,
    leaf,
    plan_job,
    streamed_failure,
)
from dispatcher.client.wire import ClientError
from dispatcher.lifecycle import JobState
from dispatcher.tasks.keys import DISPATCH_KEY, ROLLOUT_INDEX, TASK_INDEX

log = structlog.get_logger("dispatcher.client.gym")

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
        self._durations = Durations()
        self._jobs: list[str] = []
        self._current: tuple[str, JobPlan] | None = None  # the job being followed
        # The bytes of a job's rows at most, once a 413 (a body over the daemon's
        # --max-body-bytes) has taught one.
        self._body_bytes: int | None = None
        self._prefix = f"gym-{uuid.uuid4().hex[:12]}"
        # Gym counts the budget from the call, not from the first await.
        budget = options.dispatch_budget_s
        self._deadline = None if budget is None else time.monotonic() + budget
        self._task: asyncio.Task[None] | None = None
        self._taken = 0
        # What may start (a window, a budget); None: everything at once.
        self._admits: Admits | None = None
        self._admitted_more = asyncio.Event()

    async def next_completion(self) -> Pair:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._collect())
        item = await self._completions.get()
        self._taken += 1
        if self._admits is not None:
            self._admit()  # a resident task freed: Gym starts the next now
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
        """Submit the examples as one job (in pieces, one after another, if cut) and
        follow it. With a window or a budget the job starts only what is admitted:
        the window, then one more example as the trainer takes each result, while
        the budget lasts (``_admit``)."""
        total = len(self._examples)
        window = self._options.max_resident_tasks
        if self._deadline is not None or (window is not None and window < total):
            self._admits = Admits(total, min(window or total, total))
            self._admit()
        # The sender is the collection's: if it fails, the collection fails with it
        # (a job whose admissions stopped would wait for them for ever).
        async with asyncio.TaskGroup() as tasks:
            sender = tasks.create_task(self._send_admits()) if self._admits else None
            async for job_id, plan in self._hand_over(range(total)):
                self._current = (job_id, plan)
                self._admitted_more.set()  # the sender opens the job's admit channel now
                await self._follow(job_id, plan)
                if self._admits is not None and self._admits.drained:
                    await cancel_jobs(self._api, [job_id])  # its rows never admitted
            if sender is not None:
                sender.cancel()

    def _admit(self) -> None:
        """Admit examples up to the window above what the trainer took, each checked
        against the budget as Gym checks a task it starts; once the budget is spent,
        the rest resolve to Gym's drained result."""
        admits = self._admits
        assert admits is not None
        while not admits.drained and admits.granted < admits.due(self._taken):
            drained = self._drain_message()
            if drained is not None:
                admits.drained = True
                self._drain_rest(admits.granted, drained)
                break
            admits.granted += 1
        self._admitted_more.set()

    async def _send_admits(self) -> None:
        """Tell the daemon what its job may start (the latest total, on the job's admit
        channel); once drained, cancel the job when nothing admitted is left open."""
        admits = _Admitter(self._api)
        try:
            while True:
                await self._admitted_more.wait()
                self._admitted_more.clear()
                if self._current is None or self._admits is None:
                    continue
                job_id, plan = self._current
                if self._admits.drained and self._all_resolved(plan):
                    await cancel_jobs(self._api, [job_id])  # ends its stream: nothing runs
                    return
                await admits.send(job_id, self._admits.of(plan.positions))
        finally:
            await admits.aclose()

    def _drain_message(self) -> str | None:
        if self._deadline is None:
            return None
        remaining = self._deadline - time.monotonic()
        margin = self._durations.margin(self._options.drain_margin_s)
        if remaining <= 0 or (margin is not None and remaining < margin):
            return budget_message(remaining, margin)
        return None

    def _drain_rest(self, first: int, message: str) -> None:
        for position in range(first, len(self._examples)):
            if self._options.latency_tracker is not None:
                self._options.latency_tracker.record_drained()
            self._resolve(position, drained_result(message))

    async def _hand_over(self, positions: range) -> AsyncIterator[tuple[str, JobPlan]]:
        """Submit ``positions`` as jobs whose bodies the daemon takes (``--max-body-bytes``).

        A job it refuses as too big (413) sets the bound of a job's rows to half that
        body's bytes, from then on: later windows are cut before they are sent. An
        example too big alone resolves to the daemon's 413.
        """
        pieces = cut(self._examples, list(positions), self._body_bytes)
        while pieces:
            piece = pieces.pop()
            if all(p in self._resolved for p in piece):
                continue  # drained before it was sent
            plan = plan_job(self._examples, piece)
            try:
                yield await self._submit(plan), plan
            except ClientError as exc:
                if exc.status != 413:
                    raise
                if len(piece) == 1:
                    self._resolve(piece[0], exc)
                    continue
                self._body_bytes = bytes_of(self._examples, piece) // 2
                pieces += cut(self._examples, piece, self._body_bytes)

    async def _submit(self, plan: JobPlan) -> str:
        job_id = f"{self._prefix}-{len(self._jobs)}"
        self._jobs.append(job_id)
        try:
            # With a job_id the submit is idempotent, so a lost answer is retried.
            admit = None if self._admits is None else self._admits.of(plan.positions)
            await self._api.submit(
                plan.rows, job_id=job_id, num_repeats=1, max_attempts=self._options.max_attempts,
                admit=admit,
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
        if self._admits is not None and self._admits.drained:
            self._admitted_more.set()  # the sender cancels the job once all are in

    def _resolve_rest(self, error: BaseException) -> None:
        for position in range(len(self._examples)):
            self._resolve(position, error)


class _Admitter:
    """The admissions sent for a collection's job, as they rise: on the job's admit
    channel (a message each, no answer awaited), else, when the channel cannot open
    or was lost, by ``POST /v1/jobs/<id>/admit``."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._job: str | None = None
        self._channel: AdmitChannel | None = None
        self._sent = 0

    async def send(self, job_id: str, count: int) -> None:
        """The job may start ``count`` in all; a new job's channel opens at its first send."""
        if job_id != self._job:
            await self.aclose()
            self._job, self._sent = job_id, 0
            self._channel = await self._open(job_id)
        if count <= self._sent:
            return
        if self._channel is not None:
            try:
                await self._channel.send(count)
                self._sent = count
                return
            except ClientError as exc:
                log.info("gym_admit_channel_lost", job_id=job_id, error=str(exc))
                await self.aclose()
        await self._client.admit(job_id, count)
        self._sent = count

    async def _open(self, job_id: str) -> AdmitChannel | None:
        try:
            return await self._client.admit_channel(job_id)
        except ClientError as exc:
            # A daemon without channels (405), or one restarting: requests then.
            log.info("gym_admit_channel_unavailable", job_id=job_id, error=str(exc))
            return None

    async def aclose(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.aclose()
