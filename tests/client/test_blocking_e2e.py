"""dispatcher.client against a real ``dispatcher serve``, used the way a trainer uses it.

Each test starts simulated agents on this loop and the daemon as a
subprocess; the blocking client runs in a thread so the agents keep serving.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dispatcher.client import AsyncClient, Client, ClientError, JobState
from tests.conftest import SimAgentFactory
from tests.helpers import CliProcess, count_lines, spawn_cli, wait_until

TASKS_PER_STEP = 4
REPEATS = 2


def step_rows(step: int) -> list[dict[str, Any]]:
    return [
        {"agent_ref": {"name": "sim"}, "responses_create_params": {"input": f"s{step} q{i}"}}
        for i in range(TASKS_PER_STEP)
    ]


async def start_daemon(state_dir: Path, agent_url: str, *extra: str) -> tuple[CliProcess, str]:
    daemon = await spawn_cli(
        "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state_dir),
        "--agent", f"sim={agent_url}", "--log-format", "json", "--fsync", "never", *extra,
    )  # fmt: skip
    url: list[str] = []

    def listening() -> bool:
        for line in daemon.stdout:
            match = re.search(rb"listening on (http://\S+)", line)
            if match:
                url.append(match.group(1).decode())
        assert not daemon.exited, b"".join(daemon.stderr).decode()[-2000:]
        return bool(url)

    await wait_until(listening, timeout_s=30)
    return daemon, url[0]


@pytest.fixture
async def daemon(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> AsyncIterator[tuple[CliProcess, str]]:
    agent_url, _ = await sim_agent(latency_s=0.05)
    process, url = await start_daemon(tmp_path / "state", agent_url)
    yield process, url
    await process.kill()


def assert_every_group_once(groups: list[dict[str, Any]]) -> None:
    assert sorted(g["task_index"] for g in groups) == list(range(TASKS_PER_STEP))
    assert [g["_ng_seq"] for g in groups] == list(range(1, TASKS_PER_STEP + 1))
    for g in groups:
        assert g["failures"] == 0
        assert sorted(r["_ng_rollout_index"] for r in g["rows"]) == list(range(REPEATS))
        assert {r["_ng_task_index"] for r in g["rows"]} == {g["task_index"]}


async def test_async_trainer_submits_the_next_step_while_consuming_this_one(
    daemon: tuple[CliProcess, str],
) -> None:
    _, url = daemon
    steps = 3
    async with AsyncClient(url) as client:
        await client.submit(step_rows(0), job_id="step-0", num_repeats=REPEATS, policy_version=0)
        for n in range(steps):
            if n + 1 < steps:
                created = await client.submit(
                    step_rows(n + 1), job_id=f"step-{n + 1}", num_repeats=REPEATS,
                    policy_version=n + 1,
                )  # fmt: skip
                assert created.job_id == f"step-{n + 1}"
            results = client.results(f"step-{n}", group=True)
            groups = [group async for group in results]
            assert results.final_state is JobState.DONE
            assert_every_group_once(groups)
            for row in (r for g in groups for r in g["rows"]):
                assert row["_ng_policy_version_start"] >= n - 1
            assert await client.set_policy_version(n + 1) == n + 1
        assert await client.policy_version() == steps
        jobs = {job.job_id: job for job in await client.jobs()}
        assert set(jobs) == {f"step-{n}" for n in range(steps)}
        assert all(job.state is JobState.DONE and job.final for job in jobs.values())
        assert jobs["step-2"].done == TASKS_PER_STEP * REPEATS


async def test_blocking_trainer_reads_rows_once_and_resumes_with_after(
    daemon: tuple[CliProcess, str],
) -> None:
    _, url = daemon

    def trainer() -> tuple[list[tuple[int, int]], JobState | None]:
        with Client(url) as client:
            client.submit(step_rows(0), job_id="b-0", num_repeats=REPEATS, policy_version=0)
            client.submit(step_rows(1), job_id="b-1", num_repeats=REPEATS, policy_version=1)
            first = client.results("b-0")
            keys = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in (next(first),)]
            first.close()
            rest = client.results("b-0", after=first.last_seq)
            keys += [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rest]
            assert client.wait("b-1").state is JobState.DONE
            return keys, rest.final_state

    keys, final = await asyncio.to_thread(trainer)
    assert final is JobState.DONE
    assert Counter(keys) == Counter((t, r) for t in range(TASKS_PER_STEP) for r in range(REPEATS))


async def test_the_daemons_refusals_arrive_as_client_errors(
    daemon: tuple[CliProcess, str],
) -> None:
    _, url = daemon
    async with AsyncClient(url) as client:
        with pytest.raises(ClientError) as missing:
            await client.status("no-such-job")
        assert missing.value.status == 404
        with pytest.raises(ClientError) as both:
            await client.submit(step_rows(0), input="tasks.jsonl", job_id="bad")
        assert both.value.status == 400
        await client.submit(step_rows(0), job_id="same", num_repeats=1)
        again = await client.submit(step_rows(0), job_id="same", num_repeats=1)
        assert again.job_id == "same"
        with pytest.raises(ClientError) as conflict:
            await client.submit(step_rows(1), job_id="same", num_repeats=1)
        assert conflict.value.status == 409


async def test_a_stream_survives_kill_9_of_the_daemon(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    agent_url, _ = await sim_agent(latency_s=0.2)
    state = tmp_path / "state"
    first, url = await start_daemon(state, agent_url, "--concurrency", "2")
    port = url.rsplit(":", 1)[1]
    rows: list[dict[str, Any]] = []
    second: CliProcess | None = None
    try:
        async with AsyncClient(url, retry_deadline_s=60) as client:
            await client.submit(step_rows(0), job_id="k-0", num_repeats=REPEATS)
            results = client.results("k-0")
            rows.append(await results.__anext__())
            await first.kill()
            durable_at_kill = count_lines(state / "jobs" / "k-0" / "rollouts.jsonl")
            second = await spawn_cli(
                "serve", "--listen", f"127.0.0.1:{port}", "--state-dir", str(state),
                "--agent", f"sim={agent_url}", "--concurrency", "2", "--log-format", "json",
                "--fsync", "never",
            )  # fmt: skip
            rows += [row async for row in results]
            assert results.final_state is JobState.DONE
    finally:
        await first.kill()
        if second is not None:
            await second.kill()
    # The kill came mid-job: the rest of the stream came from the second daemon.
    assert durable_at_kill < TASKS_PER_STEP * REPEATS
    keys = Counter((r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows)
    assert keys == Counter((t, r) for t in range(TASKS_PER_STEP) for r in range(REPEATS))


async def test_blocking_trainer_steers_a_step_and_pauses_around_its_update(
    daemon: tuple[CliProcess, str],
) -> None:
    _, url = daemon

    def trainer() -> dict[str, Any]:
        with Client(url) as client:
            seen: dict[str, Any] = {"paused": client.pause(ttl_s=30, reason="update")}
            client.submit(step_rows(0), job_id="s-0", num_repeats=REPEATS, policy_version=0,
                          target_groups=2, overprovision=1.5, on_target="cancel",
                          responses_create_params={"temperature": 0.5})  # fmt: skip
            seen["held"] = client.wait_idle(timeout_s=5)
            seen["resumed"] = client.resume()
            results = client.results("s-0", group=True)
            seen["groups"] = list(results)
            seen["end"] = results.final_state
            seen["every"] = list(client.results("s-0", group=True, filtered=True))
            seen["status"] = client.wait("s-0")
            seen["satisfied"] = [job.job_id for job in client.jobs("satisfied", "done")]
            client.pause()
            seen["by_policy"] = (client.set_policy_version(1), client.admission())
            return seen

    seen = await asyncio.to_thread(trainer)
    assert seen["paused"].paused is True and seen["paused"].reason == "update"
    assert seen["held"].idle is True and seen["held"].in_flight == 0
    assert seen["resumed"].paused is False
    assert len(seen["groups"]) == 2 and seen["end"] is JobState.SATISFIED
    assert len(seen["every"]) == 2  # no filter: nothing dropped
    status = seen["status"]
    assert status.state is JobState.SATISFIED and status.final
    # An answer already on its way to disk at the target is written (as with DELETE).
    assert status.target_groups == 2 and status.groups_kept >= 2
    assert status.satisfied_seq == 2 and status.timeline is not None
    assert seen["satisfied"] == ["s-0"]
    version, admission = seen["by_policy"]
    assert version == 1 and admission.paused is False
