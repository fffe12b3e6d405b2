"""Step control (contracts §13) through the real CLI: `dispatcher serve` in a subprocess,
an agent on 127.0.0.1 that answers each task when the test says, the jobs API over HTTP.

The agent holds every request of a task until the test releases that task, so
which groups complete, and in which order, is the test's choice; no sleeps.
"""

from __future__ import annotations

import asyncio
import signal
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from tests.helpers import FakeAgent, count_lines, read_jsonl, wait_until
from tests.serve.test_service_e2e import Serve, row_lines, rows

pytestmark = pytest.mark.timeout(180)


class TaskGates:
    """Answers for the agent: each task's requests wait until the test releases it."""

    def __init__(self, reward: Callable[[int, int], float] = lambda task, i: float(i)) -> None:
        self.released: defaultdict[int, asyncio.Event] = defaultdict(asyncio.Event)
        self.reward = reward

    def release(self, *tasks: int) -> None:
        for task in tasks:
            self.released[task].set()

    async def respond(self, body: dict[str, Any]) -> web.StreamResponse:
        task, repeat = body["_ng_task_index"], body["_ng_rollout_index"]
        await self.released[task].wait()
        return web.json_response({"reward": self.reward(task, repeat)})


@pytest.fixture
async def gates() -> TaskGates:
    return TaskGates()


@pytest.fixture
async def agent(gates: TaskGates) -> AsyncIterator[FakeAgent]:
    agent = FakeAgent(gates.respond)
    await agent.start()
    yield agent
    gates.release(*range(100))
    await agent.close()


def tasks_seen(agent: FakeAgent) -> set[int]:
    return set(agent.task_indexes())


def job_dir(tmp_path: Path, job_id: str) -> Path:
    return tmp_path / "state" / "jobs" / job_id


async def test_target_with_cancel_streams_exactly_n_groups_then_cancels_the_rest(
    tmp_path: Path, agent: FakeAgent, gates: TaskGates
) -> None:
    serve = await Serve.start(tmp_path / "state", agent.url, "--concurrency", "16")
    try:
        await serve.submit(job_id="step", rows=rows(6), num_repeats=2, target_groups=2,
                           overprovision=2.0, on_target="cancel")  # fmt: skip
        # ceil(2 x 2.0) = 4 groups may be open at once: tasks 0-3, two repeats each.
        await wait_until(lambda: agent.seen == 8)
        assert tasks_seen(agent) == {0, 1, 2, 3}
        gates.release(0, 1)
        groups = await serve.results("step", group=True, wait=True)
        await wait_until(lambda: agent.disconnects == 4)
        # Satisfied at once; final once the cancelled tail has settled.
        await wait_until(lambda: serve.proc.saw("job_finished"))
        status = await serve.job("step")
        rows_stream = await serve.results("step", wait=True)
    finally:
        assert await serve.stop() == 0
    assert [g["task_index"] for g in row_lines(groups)] == [0, 1]
    assert groups[-1] == {"end": "satisfied"}
    assert rows_stream[-1] == {"end": "satisfied"}
    assert status["final"] is True and status["in_flight"] == 0
    assert status["target_groups"] == 2 and status["groups_kept"] == 2
    assert status["satisfied_at"] is not None and status["satisfied_seq"] == 2
    assert set(status["timeline"]) == {"first_group_s", "p50_s", "p90_s", "p100_s"}
    assert status["timeline"]["p100_s"] >= status["timeline"]["first_group_s"] >= 0
    # The cancelled rollouts wrote nothing, and nothing started after the target.
    folder = job_dir(tmp_path, "step")
    assert count_lines(folder / "rollouts.jsonl") == 4
    assert count_lines(folder / "groups.jsonl") == 2
    assert read_jsonl(folder / "rollouts_failures.jsonl") == []
    assert agent.seen == 8
    assert orjson.loads((folder / "job.json").read_bytes())["state"] == "satisfied"


async def test_target_with_finish_lets_the_tail_land_and_stream_with_after(
    tmp_path: Path, agent: FakeAgent, gates: TaskGates
) -> None:
    serve = await Serve.start(tmp_path / "state", agent.url, "--concurrency", "16")
    try:
        await serve.submit(job_id="step", rows=rows(6), num_repeats=2, target_groups=2,
                           overprovision=1.5, policy_version=0)  # fmt: skip
        # ceil(2 x 1.5) = 3 groups at most: tasks 0-2.
        await wait_until(lambda: agent.seen == 6)
        gates.release(0, 1)
        groups = await serve.results("step", group=True, wait=True)
        satisfied = await serve.job("step")
        await serve.set_policy(1)  # the trainer's update, while the tail runs
        gates.release(2)
        tail = await serve.results("step", group=True, wait=True,
                                   after=satisfied["satisfied_seq"])  # fmt: skip
        final = await serve.job("step")
    finally:
        assert await serve.stop() == 0
    assert [g["task_index"] for g in row_lines(groups)] == [0, 1]
    assert groups[-1] == {"end": "satisfied"}
    # Its tail still runs: running, not yet final, with the target's figures.
    assert satisfied["state"] == "running" and satisfied["final"] is False
    assert satisfied["satisfied_at"] is not None
    assert satisfied["in_flight"] == 2 and satisfied["groups_open"] == 1
    # The tail: task 2's group, after the target's line, tagged with its versions.
    assert [(g["_ng_seq"], g["task_index"]) for g in row_lines(tail)] == [(3, 2)]
    assert tail[-1] == {"end": "satisfied"}
    for row in row_lines(tail)[0]["rows"]:
        assert row["_ng_policy_version_start"] == 0 and row["_ng_policy_version_end"] == 1
    assert final["state"] == "satisfied" and final["final"] is True
    assert final["groups_kept"] == 3 and final["in_flight"] == 0
    # Nothing started past the bound that overprovision sets.
    assert tasks_seen(agent) == {0, 1, 2} and agent.seen == 6


async def test_the_filter_keeps_no_group_of_equal_rewards_and_refills_one_group_at_a_time(
    tmp_path: Path, agent: FakeAgent, gates: TaskGates
) -> None:
    # Tasks 0 and 2 answer the same reward for every repeat: nothing to learn.
    gates.reward = lambda task, repeat: 1.0 if task in (0, 2) else float(repeat)
    serve = await Serve.start(tmp_path / "state", agent.url, "--concurrency", "16")
    try:
        await serve.submit(job_id="step", rows=rows(8), num_repeats=2, target_groups=2,
                           group_filter="nonzero_reward_std")  # fmt: skip
        await wait_until(lambda: agent.seen == 4)
        assert tasks_seen(agent) == {0, 1}
        # Each filtered group frees exactly one place: one new task, never a wave.
        gates.release(0)
        await wait_until(lambda: agent.seen == 6)
        assert tasks_seen(agent) == {0, 1, 2}
        gates.release(2)
        await wait_until(lambda: agent.seen == 8)
        assert tasks_seen(agent) == {0, 1, 2, 3}
        open_groups = await serve.job("step")
        gates.release(1, 3)
        kept = await serve.results("step", group=True, wait=True)
        every = await serve.results("step", group=True, wait=True, filtered=True)
        status = await serve.job("step")
    finally:
        assert await serve.stop() == 0
    assert open_groups["groups_open"] == 2 and open_groups["groups_filtered"] == 2
    assert [g["task_index"] for g in row_lines(kept)] == [1, 3]
    assert [g["_ng_seq"] for g in row_lines(kept)] == [3, 4]
    assert kept[-1] == every[-1] == {"end": "satisfied"}
    for group in row_lines(kept):
        assert len({row["reward"] for row in group["rows"]}) > 1
    assert [(g["task_index"], g.get("filtered", False)) for g in row_lines(every)] == [
        (0, True), (2, True), (1, False), (3, False)
    ]  # fmt: skip
    assert status["groups_kept"] == 2 and status["groups_filtered"] == 2
    assert tasks_seen(agent) == {0, 1, 2, 3} and agent.seen == 8
    lines = read_jsonl(job_dir(tmp_path, "step") / "groups.jsonl")
    assert [line.get("filtered", False) for line in lines] == [True, True, False, False]


def reached_target(serve: Serve, job_id: str) -> Any:
    """A condition: the job reached its target (still running its tail, or final)."""

    async def check() -> bool:
        return (await serve.job(job_id))["satisfied_at"] is not None

    return check


async def test_kill_9_of_a_satisfied_jobs_daemon_then_restart_starts_nothing(
    tmp_path: Path, agent: FakeAgent, gates: TaskGates
) -> None:
    state = tmp_path / "state"
    serve = await Serve.start(state, agent.url, "--concurrency", "16")
    try:
        await serve.submit(job_id="step", rows=rows(6), num_repeats=2, target_groups=1,
                           overprovision=2.0)  # fmt: skip
        await wait_until(lambda: agent.seen == 4)
        gates.release(0)
        # Satisfied, its tail (task 1) still at the agent: job.json says nothing yet.
        await wait_until(reached_target(serve, "step"))
        record = orjson.loads((job_dir(tmp_path, "step") / "job.json").read_bytes())
    finally:
        assert await serve.stop(signal.SIGKILL) == -signal.SIGKILL
    assert record["state"] is None

    again = await Serve.start(state, agent.url, "--concurrency", "16")
    try:
        # Nothing is released: a rollout started now would keep the job from ending.
        await wait_until(again.in_state("step", "satisfied"))
        await wait_until(lambda: again.proc.saw("job_finished"))
        status = await again.job("step")
        groups = await again.results("step", group=True, wait=True)
    finally:
        assert await again.stop() == 0
    assert status["final"] is True and status["groups_kept"] == 1
    assert [g["task_index"] for g in row_lines(groups)] == [0]
    assert groups[-1] == {"end": "satisfied"}
    assert agent.seen == 4
    assert orjson.loads((job_dir(tmp_path, "step") / "job.json").read_bytes())["state"] == (
        "satisfied"
    )


async def test_bad_step_fields_are_400_naming_the_field_and_create_nothing(
    tmp_path: Path, agent: FakeAgent
) -> None:
    state = tmp_path / "state"
    serve = await Serve.start(state, agent.url)
    bad = {
        "target_groups": {"target_groups": 0},
        "target_groups: 4 is more than the job's 3 tasks": {"target_groups": 4},
        "overprovision": {"target_groups": 1, "overprovision": 0.5},
        "on_target": {"target_groups": 1, "on_target": "stop"},
        "group_filter": {"group_filter": "mean_reward"},
        "overprovision: only with target_groups": {"overprovision": 2.0},
    }
    try:
        for field, extra in bad.items():
            body = orjson.dumps({"rows": rows(3), **extra})
            async with serve.http.post(f"{serve.url}/v1/jobs", data=body) as r:
                assert r.status == 400
                assert (await r.json())["error"].startswith(field), field
        for body in ({"paused": True, "ttl_s": 0}, {"paused": True, "ttl_s": 3601}):
            async with serve.http.post(f"{serve.url}/v1/admission", json=body) as r:
                assert r.status == 400
                assert (await r.json())["error"].startswith("ttl_s: ")
        async with serve.http.get(f"{serve.url}/v1/admission") as r:
            assert (await r.json())["paused"] is False
        async with serve.http.get(f"{serve.url}/v1/jobs") as r:
            assert (await r.json())["jobs"] == []
    finally:
        assert await serve.stop() == 0
    assert list((state / "jobs").iterdir()) == []
    assert agent.seen == 0


async def test_pause_holds_every_start_until_resumed_by_request_policy_or_ttl(
    tmp_path: Path, agent: FakeAgent, gates: TaskGates
) -> None:
    serve = await Serve.start(tmp_path / "state", agent.url, "--concurrency", "16")

    async def admission(method: str = "GET", query: str = "", **body: Any) -> dict[str, Any]:
        url = f"{serve.url}/v1/admission{query}"
        async with serve.http.request(method, url, json=body or None) as r:
            assert r.status == 200
            answer: dict[str, Any] = await r.json()
            return answer

    try:
        # Rollouts in flight go on through a pause; wait_idle says when they are done.
        await serve.submit(job_id="before", rows=rows(1))
        await wait_until(lambda: agent.seen == 1)
        assert (await admission("POST", paused=True, reason="weights"))["paused"] is True
        busy = await admission(query="?wait_idle=true&timeout_s=0.05")
        assert busy == {"paused": True, "reason": "weights", "ttl_remaining_s": busy[
            "ttl_remaining_s"], "in_flight": 1, "idle": False, "held": 0}  # fmt: skip
        gates.release(0, 1)
        idle = await admission(query="?wait_idle=true&timeout_s=60")
        assert idle["idle"] is True and idle["in_flight"] == 0
        # No /run reaches the agent while paused: the job waits at the pause.
        await serve.submit(job_id="a", rows=rows(2, job="a"))
        await wait_until(lambda: _held(admission))
        assert agent.seen == 1
        await admission("POST", paused=False)
        await wait_until(lambda: agent.seen == 3)
        # The next policy version ends a pause.
        await admission("POST", paused=True)
        await serve.submit(job_id="b", rows=rows(2, job="b"))
        await wait_until(lambda: _held(admission))
        assert agent.seen == 3
        await serve.set_policy(1)
        await wait_until(lambda: agent.seen == 5)
        # So does its TTL, at warning.
        await admission("POST", paused=True, ttl_s=0.2)
        await serve.submit(job_id="c", rows=rows(2, job="c"))
        await wait_until(lambda: agent.seen == 7)
        assert (await admission())["paused"] is False
        metrics = await serve.metrics()
    finally:
        assert await serve.stop() == 0
    assert "dispatcher_admission_paused 0.0" in metrics
    assert "dispatcher_admission_pauses_total 3.0" in metrics
    assert "dispatcher_admission_paused_seconds_total" in metrics
    expired = [e for e in serve.proc.events() if e["event"] == "admission_pause_expired"]
    assert [e["level"] for e in expired] == ["warning"]
    resumed = [e["by"] for e in serve.proc.events() if e["event"] == "admission_resumed"]
    assert resumed == ["request", "policy_version", "ttl"]


async def _held(admission: Callable[..., Any]) -> bool:
    return bool((await admission())["held"] == 1)


async def test_a_jobs_responses_create_params_override_its_rows_and_jobs_filter_by_state(
    tmp_path: Path, agent: FakeAgent, gates: TaskGates
) -> None:
    gates.release(0)
    serve = await Serve.start(tmp_path / "state", agent.url)
    params = {"input": "hi", "temperature": 1.0, "max_output_tokens": 64}
    try:
        await serve.submit(job_id="cool", rows=rows(1, job="cool", responses_create_params=params),
                           responses_create_params={"temperature": 0.2})  # fmt: skip
        plain = rows(1, job="plain", responses_create_params=params)
        await serve.submit(job_id="plain", rows=plain)
        for job_id in ("cool", "plain"):
            assert (await serve.results(job_id, wait=True))[-1] == {"end": "done"}
        await serve.submit(job_id="held", rows=rows(2, job="held"))  # its task 1 is held
        await wait_until(lambda: agent.seen == 4)
        listings = {}
        for query in ("done", "running", "done,running"):
            async with serve.http.get(f"{serve.url}/v1/jobs", params={"state": query}) as r:
                listings[query] = sorted(job["job_id"] for job in (await r.json())["jobs"])
        async with serve.http.get(f"{serve.url}/v1/jobs", params={"state": "finished"}) as r:
            assert r.status == 400
            assert (await r.json())["error"].startswith("state: 'finished' is not a job state")
        gates.release(1)
        assert (await serve.results("held", wait=True))[-1] == {"end": "done"}
    finally:
        assert await serve.stop() == 0
    sent = {body["job"]: body.get("responses_create_params") for body in agent.bodies}
    assert sent["cool"] == {"input": "hi", "temperature": 0.2, "max_output_tokens": 64}
    assert sent["plain"] == params
    assert listings == {"done": ["cool", "plain"], "running": ["held"],
                        "done,running": ["cool", "held", "plain"]}  # fmt: skip
