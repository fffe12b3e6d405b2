"""dispatcher.client.gym.RolloutCollectionHelper against a real ``dispatcher serve``.

The daemon is a subprocess; the agent runs on this loop and answers as Gym's
``simple_agent`` does: its request echoed, plus a response and a reward, each
question when the test lets it. The helper's results must be those answers,
without the dispatcher's keys, in completion order.
"""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from dispatcher.client import AsyncClient, ClientError, JobState
from dispatcher.client.gym import (
    DISPATCHER_KEYS,
    RolloutCollectionHelper,
    RolloutFailed,
    agent_result,
)
from dispatcher.client.gym_plan import Durations, failure_result, plan_job
from dispatcher.client.wire import JobStatus
from tests.client.test_blocking_e2e import start_daemon
from tests.helpers import CliProcess, serve, wait_until


def gym_answer(body: dict[str, Any]) -> dict[str, Any]:
    """What Gym's simple_agent answers: the request echoed, the response, a reward."""
    question = body["responses_create_params"]["input"]
    return {**body, "response": {"output_text": f"answer to {question}"}, "reward": 1.0}


class HeldAgent:
    """A Gym-like agent whose answer to each question waits for ``release(question)``
    (unless ``held`` is off); questions in ``failing`` answer 500."""

    def __init__(self, *, held: bool = True, failing: frozenset[str] = frozenset()) -> None:
        self.held = held
        self.failing = failing
        self.bodies: dict[str, dict[str, Any]] = {}
        self.gates: dict[str, asyncio.Future[None]] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/run", self._run)
        self._runner, self.url = await serve(app)
        return self.url

    def gate(self, question: str) -> asyncio.Future[None]:
        if question not in self.gates:
            self.gates[question] = asyncio.get_running_loop().create_future()
        return self.gates[question]

    def release(self, question: str) -> None:
        self.gate(question).set_result(None)

    def waiting(self) -> set[str]:
        return {q for q, gate in self.gates.items() if q in self.bodies and not gate.done()}

    async def close(self) -> None:
        for gate in self.gates.values():
            if not gate.done():
                gate.set_result(None)
        if self._runner is not None:
            await self._runner.cleanup()

    async def _run(self, request: web.Request) -> web.StreamResponse:
        body = await request.json(loads=orjson.loads)
        question = body["responses_create_params"]["input"]
        self.bodies[question] = body
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.held:
                await self.gate(question)
            if question in self.failing:
                return web.json_response({"detail": "boom"}, status=500)
            return web.json_response(gym_answer(body))
        finally:
            self.in_flight -= 1


def examples(count: int) -> list[dict[str, Any]]:
    return [
        {
            "agent_ref": {"name": "sim"},
            "responses_create_params": {"input": f"q{i}"},
            "_ng_task_index": 100 + i,
        }
        for i in range(count)
    ]


class Stack:
    def __init__(self, agent: HeldAgent, daemon: CliProcess, url: str) -> None:
        self.agent, self.daemon, self.url = agent, daemon, url

    async def jobs(self) -> list[JobStatus]:
        async with AsyncClient(self.url) as client:
            return await client.jobs()


@pytest.fixture
async def start_stack(tmp_path: Path) -> AsyncIterator[Any]:
    stacks: list[Stack] = []

    async def start(agent: HeldAgent, *flags: str) -> Stack:
        daemon, url = await start_daemon(tmp_path / "state", await agent.start(), *flags)
        stacks.append(Stack(agent, daemon, url))
        return stacks[-1]

    yield start
    for stack in stacks:
        await stack.daemon.kill()
        await stack.agent.close()


def expected_result(agent: HeldAgent, example: dict[str, Any]) -> dict[str, Any]:
    """The agent's own answer for this example, without the dispatcher's keys."""
    body = agent.bodies[example["responses_create_params"]["input"]]
    return {k: v for k, v in gym_answer(body).items() if k not in DISPATCHER_KEYS}


async def test_each_result_is_the_agents_answer_in_completion_order(start_stack: Any) -> None:
    stack = await start_stack(HeldAgent())
    rows = examples(4)
    del rows[3]["_ng_task_index"]  # the helper gives it one of its own
    futures = list(RolloutCollectionHelper(stack.url).run_examples(rows))
    assert len(futures) == 4
    pending = [asyncio.ensure_future(f) for f in futures]
    await wait_until(lambda: len(stack.agent.waiting()) == 4, timeout_s=30)
    got = []
    for index in (2, 0, 3, 1):
        stack.agent.release(f"q{index}")
        got.append(await pending[len(got)])
    assert [rows.index(row) for row, _ in got] == [2, 0, 3, 1]
    for row, result in got:
        assert any(row is example for example in rows)  # the caller's own example
        assert result == expected_result(stack.agent, row)
        assert result["response"] == {
            "output_text": f"answer to {row['responses_create_params']['input']}"
        }
    assert stack.agent.bodies["q1"]["_ng_task_index"] == 101  # an example's own index goes as is
    assert "_ng_task_index" not in rows[3]  # the caller's examples are not changed


async def test_a_failed_rollout_raises_or_is_routed_as_a_failure_result(start_stack: Any) -> None:
    agent = HeldAgent(held=False, failing=frozenset({"q1"}))
    stack = await start_stack(agent, "--max-attempts", "2")
    # Gym's helper never retries: each job has max_attempts 1, the trainer retries.
    helper = RolloutCollectionHelper(stack.url)
    outcomes = await asyncio.gather(*helper.run_examples(examples(2)), return_exceptions=True)
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(failed) == 1 and isinstance(failed[0], RolloutFailed), outcomes
    assert str(failed[0]) == "agent answered HTTP 500" and failed[0].status == 500
    # max_attempts=None: the daemon's --max-attempts.
    daemons = RolloutCollectionHelper(stack.url, max_attempts=None)
    outcomes = await asyncio.gather(*daemons.run_examples(examples(2)), return_exceptions=True)
    assert sum(isinstance(o, RolloutFailed) for o in outcomes) == 1
    jobs = {job.job_id: job for job in await stack.jobs()}
    assert sorted(job.outcomes.get("agent_run_error", 0) for job in jobs.values()) == [1, 2]

    routed = await asyncio.gather(*helper.run_examples(examples(2), route_failures_to_sidecar=True))
    by_question = {row["responses_create_params"]["input"]: result for row, result in routed}
    assert by_question["q0"]["reward"] == 1.0
    failure = by_question["q1"]
    assert failure["_ng_failure_class"] == "agent_run_error"
    assert set(failure) == {
        "_ng_failure_class", "_ng_failure_type", "_ng_failure_message",
        "_ng_failure_http_status", "_ng_failure_response_body",
    }  # fmt: skip


async def test_max_resident_tasks_bounds_what_is_at_the_agents(start_stack: Any) -> None:
    stack = await start_stack(HeldAgent())
    futures = RolloutCollectionHelper(stack.url).run_examples(examples(6), max_resident_tasks=2)
    pending = [asyncio.ensure_future(f) for f in futures]
    for left in range(6, 0, -1):
        # Each free slot is refilled at once: the window is full whenever it can be.
        full = min(2, left)
        await wait_until(lambda: len(stack.agent.waiting()) == full, timeout_s=30)  # noqa: B023
        stack.agent.release(sorted(stack.agent.waiting())[0])
    results = await asyncio.gather(*pending)
    assert len(results) == 6 and stack.agent.max_in_flight <= 2
    # One job the daemon refills as slots free (it was a job per slot freed: 5).
    assert len(await stack.jobs()) == 1


async def test_a_resident_task_is_freed_when_the_trainer_takes_its_result(
    start_stack: Any,
) -> None:
    """As Gym counts ``max_resident_tasks``: a result not yet taken holds its slot, so a
    trainer that stops taking stops the starts (the slot was freed as the rollout
    left its agent, and the next one started while the trainer took nothing)."""
    stack = await start_stack(HeldAgent())
    futures = iter(
        RolloutCollectionHelper(stack.url).run_examples(examples(4), max_resident_tasks=2)
    )
    first = asyncio.ensure_future(next(futures))
    await wait_until(lambda: stack.agent.waiting() == {"q0", "q1"}, timeout_s=30)
    stack.agent.release("q0")
    stack.agent.release("q1")
    await first  # one result taken: one more starts; the other waits to be taken
    await wait_until(lambda: stack.agent.waiting() == {"q2"}, timeout_s=30)

    async def both_durable() -> bool:
        (job,) = await stack.jobs()
        return job.rows_durable == 2

    await wait_until(both_durable, timeout_s=30)
    (job,) = await stack.jobs()
    assert job.in_flight == 1 and set(stack.agent.bodies) == {"q0", "q1", "q2"}
    await next(futures)  # taken: its slot starts q3
    await wait_until(lambda: stack.agent.waiting() == {"q2", "q3"}, timeout_s=30)
    stack.agent.release("q2")
    stack.agent.release("q3")
    assert len([await f for f in futures]) == 2 and len(await stack.jobs()) == 1


async def test_a_window_with_a_budget_is_one_job(start_stack: Any) -> None:
    """Each example is checked against the budget as it is admitted, in one job (it
    was a job per freed slot)."""
    stack = await start_stack(HeldAgent(held=False))
    futures = RolloutCollectionHelper(stack.url).run_examples(
        examples(5), max_resident_tasks=2, dispatch_budget_s=3600
    )
    pairs = [await f for f in futures]
    assert all(result["reward"] == 1.0 for _, result in pairs)
    assert len(await stack.jobs()) == 1 and stack.agent.max_in_flight <= 2


class Clock:
    """``time`` for the collection's module: its monotonic seconds are the test's."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


async def test_a_budget_spent_mid_window_drains_the_rest_and_lets_the_started_finish(
    start_stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gym's drain: what started runs to its end, what is not admitted resolves to the
    drained result, and the job (its rows never admitted) is cancelled after."""
    from dispatcher.client import gym_collection

    clock = Clock()
    monkeypatch.setattr(gym_collection, "time", clock)
    stack = await start_stack(HeldAgent())
    tracker = Tracker()
    futures = iter(
        RolloutCollectionHelper(stack.url).run_examples(
            examples(4), max_resident_tasks=2, dispatch_budget_s=100, latency_tracker=tracker
        )
    )
    first = asyncio.ensure_future(next(futures))
    await wait_until(lambda: stack.agent.waiting() == {"q0", "q1"}, timeout_s=30)
    clock.now += 200  # the budget is spent
    stack.agent.release("q0")
    row, result = await first
    assert row["responses_create_params"]["input"] == "q0" and result["reward"] == 1.0
    drained = [await next(futures), await next(futures)]
    assert all(r["_ng_dispatch_drained"] is True for _, r in drained) and tracker.drained == 2
    assert stack.agent.waiting() == {"q1"}  # still running: not cancelled
    stack.agent.release("q1")
    row, result = await next(futures)
    assert row["responses_create_params"]["input"] == "q1" and result["reward"] == 1.0
    assert set(stack.agent.bodies) == {"q0", "q1"}

    async def cancelled() -> bool:
        (job,) = await stack.jobs()
        return job.state is JobState.CANCELLED

    await wait_until(cancelled, timeout_s=30)  # cancelled, not left waiting for admits
    (job,) = await stack.jobs()
    assert job.rows_durable == 2


async def test_a_window_bigger_than_the_daemons_body_bound_is_split_and_succeeds(
    start_stack: Any,
) -> None:
    # Every example of a window over --max-body-bytes failed with the 413; an
    # example too big alone fails by itself, with the daemon's reason.
    stack = await start_stack(HeldAgent(held=False), "--max-body-bytes", "4096")
    rows = examples(40)
    for row in rows:
        row["pad"] = "p" * 200
    rows[7]["pad"] = "p" * 5000
    outcomes = await asyncio.gather(
        *RolloutCollectionHelper(stack.url).run_examples(rows), return_exceptions=True
    )
    [failed] = [o for o in outcomes if isinstance(o, BaseException)]
    assert isinstance(failed, ClientError) and failed.status == 413
    assert "--max-body-bytes 4096" in str(failed)
    # In completion order: the one that failed is q7, the one never sent.
    assert set(stack.agent.bodies) == {f"q{i}" for i in range(40)} - {"q7"}
    # Learned once: later windows are cut before they are sent.
    jobs = await stack.jobs()
    assert 4 <= len(jobs) <= 16, len(jobs)


async def test_a_spent_budget_drains_what_was_not_handed_over(start_stack: Any) -> None:
    stack = await start_stack(HeldAgent(held=False))
    helper = RolloutCollectionHelper(stack.url)
    tracker = Tracker()
    pairs = await asyncio.gather(
        *helper.run_examples(examples(3), dispatch_budget_s=0.0, latency_tracker=tracker)
    )
    for _, result in pairs:
        assert result["_ng_failure_class"] == "cancelled"
        assert result["_ng_no_persist"] is True and result["_ng_dispatch_drained"] is True
        assert result["error_message"] == "not dispatched: dispatch budget exhausted"
    assert tracker.drained == 3 and not stack.agent.bodies and not await stack.jobs()

    # A margin longer than the budget: nothing worth starting.
    pairs = await asyncio.gather(
        *helper.run_examples(examples(2), dispatch_budget_s=3600, drain_margin_s=7200)
    )
    assert all("below the 7200s drain margin" in r["error_message"] for _, r in pairs)

    pairs = await asyncio.gather(
        *helper.run_examples(examples(2), dispatch_budget_s=3600, latency_tracker=tracker)
    )
    assert all(r["reward"] == 1.0 for _, r in pairs) and len(tracker.durations) == 2


class Tracker:
    """Gym's DispatchLatencyTracker, as far as the helper uses it."""

    def __init__(self) -> None:
        self.durations: list[float] = []
        self.drained = 0

    def record(self, seconds: float) -> None:
        self.durations.append(seconds)

    def record_drained(self) -> None:
        self.drained += 1


async def test_a_bad_example_raises_from_every_awaitable(start_stack: Any) -> None:
    stack = await start_stack(HeldAgent(held=False))
    rows = examples(2)
    del rows[1]["agent_ref"]
    outcomes = await asyncio.gather(
        *RolloutCollectionHelper(stack.url).run_examples(rows), return_exceptions=True
    )
    assert all(isinstance(o, ClientError) and o.status == 400 for o in outcomes), outcomes
    assert "rows[1]" in str(outcomes[0]) and not stack.agent.bodies


async def test_aclose_cancels_the_job_and_its_awaitables(start_stack: Any) -> None:
    stack = await start_stack(HeldAgent())
    completions = RolloutCollectionHelper(stack.url).run_examples(examples(2))
    pending = [asyncio.ensure_future(f) for f in completions]
    await wait_until(lambda: len(stack.agent.waiting()) == 2, timeout_s=30)
    await completions.aclose()
    outcomes = await asyncio.gather(*pending, return_exceptions=True)
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes

    async def cancelled() -> bool:
        return [job.state for job in await stack.jobs()] == [JobState.CANCELLED]

    await wait_until(cancelled, timeout_s=30)


def test_gym_arguments_are_checked_as_gym_checks_them() -> None:
    helper = RolloutCollectionHelper("http://127.0.0.1:9")
    with pytest.raises(ValueError, match="max_resident_tasks must be >= 1"):
        helper.run_examples(examples(1), max_resident_tasks=0)
    with pytest.raises(ValueError, match="environment_server_name"):
        helper.run_examples(examples(1), environment_server_name="env")
    # Accepted and not used: the daemon's own agents and concurrency apply.
    completions = helper.run_examples(examples(2), head_server_config=object(), semaphore=object())
    assert len(completions) == 2


# -- the pure pieces ------------------------------------------------------------------


def test_a_job_numbers_rollouts_as_the_daemon_does() -> None:
    rows = [
        {"_ng_task_index": 7},
        {"_ng_task_index": 7},
        {"q": "no index"},
        {"_ng_task_index": 3},
        {"q": "no index either"},
    ]
    plan = plan_job(rows, range(5))
    # Own indices kept; fresh ones above them; rollouts 0, 1, ... per task in row order.
    assert [r["_ng_task_index"] for r in plan.rows] == [7, 7, 8, 3, 9]
    assert plan.by_key == {(7, 0): 0, (7, 1): 1, (8, 0): 2, (3, 0): 3, (9, 0): 4}
    assert "_ng_task_index" not in rows[2]


def test_the_adaptive_margin_is_gyms_p75_after_five() -> None:
    durations = Durations()
    for seconds in (10.0, 20.0, 30.0, 40.0):
        durations.add(seconds)
    assert durations.margin(None) is None and durations.margin(5.0) == 5.0
    durations.add(50.0)
    assert durations.margin(None) == 40.0


def test_a_failure_names_the_jobs_class_when_it_has_one() -> None:
    job = JobStatus(job_id="j", state=JobState.DONE, final=True, outcomes={"success": 3})
    one = JobStatus(**{**vars(job), "outcomes": {"success": 1, "timeout_exceeded": 2}})
    two = JobStatus(**{**vars(job), "outcomes": {"agent_run_error": 1, "timeout_exceeded": 2}})
    assert failure_result(one)["_ng_failure_class"] == "timeout_exceeded"
    assert failure_result(two)["_ng_failure_class"] == "rollout_failed"
    assert "agent_run_error 1, timeout_exceeded 2" in failure_result(two)["_ng_failure_message"]


def test_the_agents_answer_is_the_row_without_the_dispatchers_keys() -> None:
    row = {
        "_ng_seq": 1, "response": {"id": "r"}, "reward": 0.5, "_ng_task_index": 0,
        "_ng_rollout_index": 0, "agent_ref": {"name": "a"}, "_ng_dispatch": {},
        "ng_trajectory": {}, "_ng_policy_version_start": 0, "_ng_run_id": "x",
    }  # fmt: skip
    assert agent_result(row) == {"response": {"id": "r"}, "reward": 0.5}


async def test_a_job_none_of_whose_rollouts_succeeded_still_hands_back_each_failure(
    start_stack: Any,
) -> None:
    # One prompt group, as NeMo RL submits it: every rollout fails the same way, so
    # the job ends failed (contracts §10), and each example still gets its failure.
    agent = HeldAgent(held=False, failing=frozenset({"q0", "q1"}))
    stack = await start_stack(agent, "--max-attempts", "1")
    helper = RolloutCollectionHelper(stack.url)
    outcomes = await asyncio.gather(*helper.run_examples(examples(2)), return_exceptions=True)
    assert [type(o) for o in outcomes] == [RolloutFailed, RolloutFailed], outcomes
    routed = await asyncio.gather(*helper.run_examples(examples(2), route_failures_to_sidecar=True))
    assert [result["_ng_failure_class"] for _, result in routed] == ["agent_run_error"] * 2


async def test_nothing_of_a_collection_is_left_after_its_last_result(start_stack: Any) -> None:
    """A trainer's persistent loop (NeMo RL's): once the last awaitable resolved, no task
    or stream of the helper is pending there, and a GC pass finds nothing to warn of.
    """
    stack = await start_stack(HeldAgent(held=False))
    helper = RolloutCollectionHelper(stack.url)

    def trainer() -> tuple[int, list[Any], list[str]]:
        loop = asyncio.new_event_loop()
        errors: list[Any] = []
        loop.set_exception_handler(lambda _, context: errors.append(context))

        async def collect() -> int:
            pairs = [await f for f in helper.run_examples(examples(6), max_resident_tasks=2)]
            return len(pairs)

        try:
            count = loop.run_until_complete(collect())
            left = [repr(task) for task in asyncio.all_tasks(loop)]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                gc.collect()
            errors += [str(w.message) for w in caught]
            return count, errors, left
        finally:
            loop.close()

    count, errors, left = await asyncio.to_thread(trainer)
    assert count == 6
    assert left == [] and errors == []


@pytest.mark.parametrize("routed", [False, True])
async def test_a_failed_rollout_is_known_as_it_fails_not_when_its_job_ends(
    start_stack: Any, routed: bool
) -> None:
    """One failing prompt among 4: its awaitable resolves while the others are held
    at the agent (their job is running), with the agent's HTTP status."""
    stack = await start_stack(HeldAgent(failing=frozenset({"q1"})))
    futures = RolloutCollectionHelper(stack.url).run_examples(
        examples(4), route_failures_to_sidecar=routed
    )
    first = asyncio.ensure_future(next(futures))
    await wait_until(lambda: len(stack.agent.waiting()) == 4, timeout_s=30)
    stack.agent.release("q1")
    if routed:
        row, failure = await first
        assert row["responses_create_params"]["input"] == "q1"
        assert failure["_ng_failure_class"] == "agent_run_error"
        assert failure["_ng_failure_http_status"] == 500
    else:
        with pytest.raises(RolloutFailed) as raised:
            await first
        assert raised.value.status == 500
        assert raised.value.failure["_ng_failure_class"] == "agent_run_error"
    assert stack.agent.waiting() == {"q0", "q2", "q3"}
    (job,) = await stack.jobs()
    assert not job.final
    for question in ("q0", "q2", "q3"):
        stack.agent.release(question)
    rest = [await f for f in futures]
    assert len(rest) == 3
