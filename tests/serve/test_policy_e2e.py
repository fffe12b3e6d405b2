"""Per-agent quotas and the token target (contracts §13) through the real CLI: `dispatcher
serve` in a subprocess, two agents on 127.0.0.1 (a fast one that answers at once, a slow
one that holds each task until the test releases it), the jobs API over HTTP. Which groups
complete, and when, is the test's choice; no sleeps."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.helpers import FakeAgent, wait_until
from tests.serve.test_service_e2e import Serve, row_lines
from tests.serve.test_step_e2e import TaskGates

pytestmark = pytest.mark.timeout(180)


def rows_of(agent: str, count: int) -> list[dict[str, Any]]:
    return [{"agent_ref": {"name": agent}, "question": f"{agent}{i}"} for i in range(count)]


async def fast_answer(body: dict[str, Any]) -> web.StreamResponse:
    """At once; task 0's group teaches nothing (equal rewards), the others do."""
    reward = 1.0 if body["_ng_task_index"] == 0 else float(body["_ng_rollout_index"])
    usage = {"output_tokens": 10}
    return web.json_response({"reward": reward, "response": {"id": "r", "usage": usage}})


class TokenGates(TaskGates):
    """Each task held until released; each row reports 10 generated tokens."""

    async def respond(self, body: dict[str, Any]) -> web.StreamResponse:
        await self.released[body["_ng_task_index"]].wait()
        usage = {"output_tokens": 10}
        reward = float(body["_ng_rollout_index"])
        return web.json_response({"reward": reward, "response": {"id": "r", "usage": usage}})


@pytest.fixture
async def pair() -> AsyncIterator[tuple[FakeAgent, FakeAgent, TaskGates]]:
    gates = TokenGates()
    fast, slow = FakeAgent(fast_answer), FakeAgent(gates.respond)
    await fast.start()
    await slow.start()
    yield fast, slow, gates
    gates.release(*range(100))
    await fast.close()
    await slow.close()


async def start(state: Path, fast: FakeAgent, slow: FakeAgent) -> Serve:
    return await Serve.spawn(
        "--listen", "127.0.0.1:0", "--state-dir", str(state), "--agent", f"fast={fast.url}",
        "--agent", f"slow={slow.url}", "--log-format", "json", "--fsync", "never",
        "--concurrency", "16",
    )  # fmt: skip


def kept_by_agent(groups: list[dict[str, Any]]) -> Counter[str]:
    return Counter(g["rows"][0]["agent_ref"]["name"] for g in row_lines(groups))


async def test_quotas_keep_exactly_n_of_each_agent_while_the_slow_one_lags(
    tmp_path: Path, pair: tuple[FakeAgent, FakeAgent, TaskGates]
) -> None:
    """Fast tasks come first in the file: once the fast agent has its two groups open
    its other tasks are held aside and the slow agent's start; a filtered fast group
    brings one held task back; the fast agent never runs past its quota."""
    fast, slow, gates = pair
    serve = await start(tmp_path / "state", fast, slow)
    try:
        await serve.submit(job_id="mix", rows=rows_of("fast", 6) + rows_of("slow", 3),
                           num_repeats=2, target_groups_by_agent={"fast": 2, "slow": 2},
                           group_filter="nonzero_reward_std")  # fmt: skip
        # Fast: task 0 (filtered), 1, and 2 in 0's place. Slow: tasks 6 and 7, held.
        await wait_until(lambda: fast.seen == 6 and slow.seen == 4)
        await wait_until(lambda: kept_in_status(serve, "mix", {"fast": 2, "slow": 0}))
        midway = await serve.job("mix")
        metrics = await serve.metrics()
        gates.release(6, 7)
        groups = await serve.results("mix", group=True, wait=True)
        await wait_until(lambda: serve.proc.saw("job_finished"))
        final = await serve.job("mix")
    finally:
        assert await serve.stop() == 0
    assert set(fast.task_indexes()) == {0, 1, 2} and set(slow.task_indexes()) == {6, 7}
    assert midway["groups_kept_by_agent"] == {"fast": 2, "slow": 0}
    assert midway["state"] == "running" and midway["groups_open"] == 2
    assert 'dispatcher_step_groups_kept{agent="fast"} 2.0' in metrics
    assert 'dispatcher_step_groups_quota{agent="slow"} 2.0' in metrics
    assert groups[-1] == {"end": "satisfied"}
    assert kept_by_agent(groups) == {"fast": 2, "slow": 2}
    assert final["state"] == "satisfied" and final["groups_filtered"] == 1
    assert final["groups_kept_by_agent"] == {"fast": 2, "slow": 2}
    assert final["target_groups_by_agent"] == {"fast": 2, "slow": 2}
    assert final["groups_surplus"] == 0


async def test_with_overprovision_a_group_past_its_agents_quota_is_surplus_left_out(
    tmp_path: Path, pair: tuple[FakeAgent, FakeAgent, TaskGates]
) -> None:
    """Quotas of one, overprovision 2: the fast agent runs two groups, the second past
    its quota is marked surplus and left out of the stream, which holds one of each."""
    fast, slow, gates = pair
    serve = await start(tmp_path / "state", fast, slow)
    try:
        await serve.submit(job_id="over", rows=rows_of("fast", 3) + rows_of("slow", 2),
                           num_repeats=2, target_groups_by_agent={"fast": 1, "slow": 1},
                           overprovision=2.0, on_target="cancel")  # fmt: skip
        await wait_until(lambda: fast.seen == 4 and slow.seen == 4)
        await wait_until(lambda: field_is(serve, "over", "groups_surplus", 1))
        gates.release(3)
        groups = await serve.results("over", group=True, wait=True)
        every = await serve.results("over", group=True, filtered=True)
        await wait_until(lambda: serve.proc.saw("job_finished"))
        final = await serve.job("over")
    finally:
        assert await serve.stop() == 0
    assert set(fast.task_indexes()) == {0, 1}
    assert kept_by_agent(groups) == {"fast": 1, "slow": 1}
    assert [g.get("surplus", False) for g in row_lines(every)] == [False, True, False]
    assert final["groups_kept_by_agent"] == {"fast": 1, "slow": 1}
    assert final["groups_surplus"] == 1 and final["state"] == "satisfied"


async def test_a_plain_target_over_the_same_tasks_takes_whatever_finishes_first(
    tmp_path: Path, pair: tuple[FakeAgent, FakeAgent, TaskGates]
) -> None:
    """The skew the quotas remove: target_groups=4 fills up with the fast agent's groups."""
    fast, slow, _ = pair
    serve = await start(tmp_path / "state", fast, slow)
    try:
        await serve.submit(job_id="plain", rows=rows_of("fast", 6) + rows_of("slow", 3),
                           num_repeats=2, target_groups=4)  # fmt: skip
        groups = await serve.results("plain", group=True, wait=True)
    finally:
        assert await serve.stop() == 0
    assert kept_by_agent(groups) == {"fast": 4}


async def test_the_token_target_stops_within_one_group(
    tmp_path: Path, pair: tuple[FakeAgent, FakeAgent, TaskGates]
) -> None:
    """Each row reports 10 generated tokens (its usage), a group of two 20: a target of
    50 is met by the third kept group (60), and the stream ends there."""
    fast, slow, gates = pair
    serve = await start(tmp_path / "state", fast, slow)
    try:
        body = {"rows": [{"agent_ref": {"name": "slow"}, "q": i} for i in range(6)]}
        await serve.submit(job_id="tok", num_repeats=2, target_tokens=50, **body)
        await wait_until(lambda: slow.seen == 12)
        gates.release(0, 1)
        await wait_until(lambda: field_is(serve, "tok", "tokens_kept", 40))
        metrics = await serve.metrics()
        gates.release(2)
        groups = await serve.results("tok", group=True, wait=True)
        status = await serve.job("tok")
    finally:
        gates.release(*range(6))
        assert await serve.stop() == 0
    assert "dispatcher_step_tokens_target 50.0" in metrics
    assert [g["task_index"] for g in row_lines(groups)] == [0, 1, 2]
    assert groups[-1] == {"end": "satisfied"}
    assert status["tokens_kept"] == 60 and status["target_tokens"] == 50


async def field_is(serve: Serve, job_id: str, name: str, value: Any) -> bool:
    return bool((await serve.job(job_id)).get(name) == value)


def kept_in_status(serve: Serve, job_id: str, kept: dict[str, int]) -> Any:
    return field_is(serve, job_id, "groups_kept_by_agent", kept)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"target_groups_by_agent": {"fast": 2}},
            "target_groups_by_agent: no quota for agent 'slow'",
        ),
        ({"target_groups_by_agent": {"fast": 1, "slow": 4}}, "target_groups_by_agent.slow: 4 is"),
        ({"target_groups_by_agent": {"fast": 1, "x": 1}}, "target_groups_by_agent.x: unknown"),
        ({"target_groups_by_agent": {"fast": -1, "slow": 1}}, "target_groups_by_agent.fast:"),
        ({"target_tokens": 10, "target_groups": 1}, "target_tokens: not with target_groups"),
        ({"target_tokens": "many"}, "target_tokens:"),
    ],
)
async def test_bad_step_fields_are_a_400_naming_the_field(
    tmp_path: Path,
    pair: tuple[FakeAgent, FakeAgent, TaskGates],
    fields: dict[str, Any],
    message: str,
) -> None:
    fast, slow, _ = pair
    serve = await start(tmp_path / "state", fast, slow)
    try:
        rows = rows_of("fast", 2) + rows_of("slow", 3)
        answer = await serve.submit(expect=400, rows=rows, **fields)
    finally:
        assert await serve.stop() == 0
    assert answer["error"].startswith(message) and "\n" not in answer["error"]
    assert fast.seen == slow.seen == 0
