"""The start order through the real CLI (contracts §13, start order): a task's history
survives the run that wrote it, unseen tasks start first, resume stays exactly-once."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from dispatcher.admission.order import start_order_for
from dispatcher.capture.proxy import build_proxy_app
from dispatcher.run.pending import Pending
from dispatcher.run.prepare import prepare_run
from dispatcher.settings.config import load_settings
from tests.capture.test_proxy import Servers, servers
from tests.helpers import (
    FakeAgent,
    audit_outputs,
    count_lines,
    echo_result,
    expected_keys,
    run_args,
    run_cli,
    spawn_cli,
    wait_until,
    write_tasks,
)

__all__ = ["servers"]  # the fixture, imported for these tests


def add_tasks(path: Path, first: int, count: int) -> None:
    with path.open("ab") as f:
        for i in range(first, first + count):
            row = {
                "responses_create_params": {"input": f"question {i}"},
                "agent_ref": {"name": "sim"},
            }
            f.write(orjson.dumps(row) + b"\n")


class HeldByTask:
    """An agent that answers each task when the test says so."""

    def __init__(self) -> None:
        self.release: dict[int, asyncio.Event] = {}

    async def respond(self, body: dict[str, Any]) -> web.StreamResponse:
        task = body["_ng_task_index"]
        await self.release.setdefault(task, asyncio.Event()).wait()
        return echo_result(body)


async def test_history_orders_the_next_run_longest_first_after_unseen_tasks(
    tmp_path: Path,
) -> None:
    tasks = write_tasks(tmp_path / "tasks.jsonl", 6)
    held = HeldByTask()
    agent = FakeAgent(held.respond)
    await agent.start()
    first = tmp_path / "a.jsonl"
    proc = await spawn_cli(*run_args(tasks, first, agent.url, "--concurrency", "6"))
    try:
        await wait_until(lambda: agent.seen == 6 or proc.exited, timeout_s=60)
        # Answered one at a time, each written before the next is released: the
        # later a task is answered, the longer its latency.
        for done, task in enumerate([3, 0, 5, 1, 4, 2], start=1):
            held.release.setdefault(task, asyncio.Event()).set()
            await wait_until(lambda n=done: count_lines(first) >= n or proc.exited, timeout_s=60)
        assert (await proc.wait()).returncode == 0
    finally:
        await proc.kill()
        await agent.close()
    assert (tmp_path / "task_history.jsonl").exists()
    # A new run (a new process) on the same tasks and two more: the unseen ones
    # first, then the longest in the history first.
    add_tasks(tasks, 6, 2)
    second = FakeAgent()
    await second.start()
    try:
        args = run_args(tasks, tmp_path / "b.jsonl", second.url, "--concurrency", "1")
        result = await run_cli(*args)
    finally:
        await second.close()
    assert result.returncode == 0, result.stderr[-2000:]
    assert second.task_indexes() == [6, 7, 2, 4, 1, 5, 0, 3]
    # In input order when asked.
    third = FakeAgent()
    await third.start()
    try:
        args = run_args(
            tasks, tmp_path / "c.jsonl", third.url, "--concurrency", "1", "--start-order", "input"
        )
        assert (await run_cli(*args)).returncode == 0
    finally:
        await third.close()
    assert third.task_indexes() == list(range(8))


async def test_a_killed_ordered_run_resumes_exactly_once(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "tasks.jsonl", 30)
    output = tmp_path / "x.jsonl"
    # A history file cut by a kill in the middle of a line: skipped, never an error.
    with (tmp_path / "task_history.jsonl").open("wb") as f:
        f.write(b'{"t": "torn"')
    agent = FakeAgent(gated=True)
    await agent.start()
    args = run_args(tasks, output, agent.url, "--concurrency", "4", "--num-repeats", "3")
    try:
        proc = await spawn_cli(*args)
        for answered in range(1, 11):
            await wait_until(lambda: agent.holding > 0 or proc.exited, timeout_s=60)
            agent.release_next()
            await wait_until(lambda n=answered: count_lines(output) >= n, timeout_s=60)
        proc.send_signal(signal.SIGKILL)
        await proc.kill()
        agent.open()
        result = await run_cli(*args)
    finally:
        await agent.close()
    assert result.returncode == 0, result.stderr[-2000:]
    audit_outputs(output, expected_keys(30, 3), max_attempts=3)
    # The resumed hop learned from the first: its status has the order's figures.
    summary = [e for e in result.stderr.splitlines() if '"run_summary"' in e]
    assert summary and '"start_order"' in summary[-1]


async def test_a_run_whose_model_calls_are_routed_starts_a_tasks_repeats_together(
    tmp_path: Path, servers: Servers
) -> None:
    # The repeats of a task share a replica's prefix cache only while they run together:
    # unseen tasks' first repeats first (the default order) scattered them over the run.
    proxy = await servers.start(build_proxy_app("http://127.0.0.1:9", tmp_path / "captures"))
    tasks = write_tasks(tmp_path / "tasks.jsonl", 3)
    agent = FakeAgent()
    await agent.start()
    try:
        extra = ("--concurrency", "1", "--num-repeats", "3", "--capture-proxy-url", proxy)
        result = await run_cli(*run_args(tasks, tmp_path / "out.jsonl", agent.url, *extra))
    finally:
        await agent.close()
    assert result.returncode == 0, result.stderr[-2000:]
    assert agent.task_indexes() == [0, 0, 0, 1, 1, 1, 2, 2, 2]


async def test_the_ordered_feed_reads_and_reserves_a_batch_at_a_time(tmp_path: Path) -> None:
    # The window moves on by one rollout at a time; the file is read (and its lines
    # reserved, one fsynced line each) only once the window has room for a batch.
    tasks = write_tasks(tmp_path / "tasks.jsonl", 1000)
    output = tmp_path / "x.jsonl"
    agent = FakeAgent()
    await agent.start()
    try:
        args = run_args(tasks, output, agent.url, "--concurrency", "4")
        result = await run_cli(*args, "--start-order-window", "64")
    finally:
        await agent.close()
    assert result.returncode == 0, result.stderr[-2000:]
    audit_outputs(output, expected_keys(1000, 1), max_attempts=1)
    # Batches of half the window: 1000 / 32 reads, not one every few rollouts.
    assert count_lines(tmp_path / "x_attempt_reservations.jsonl") <= 1000 // 32 + 2


@pytest.mark.parametrize("start_order", ["longest", "input"])
async def test_a_small_job_takes_one_thread_hop_to_read_and_one_to_reserve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, start_order: str
) -> None:
    # A served job of one prompt x 8 repeats: its reservations, the rollouts to
    # start first (none on record) and its rows are read in one thread hop, the end
    # of the file seen with them; reserving them is the second and last.
    tasks = write_tasks(tmp_path / "tasks.jsonl", 1)
    cli = {"input": tasks, "output": tmp_path / "out" / "x.jsonl", "num_repeats": 8,
           "agents": {"sim": ["http://h:1"]}, "start_order": start_order}  # fmt: skip
    settings = load_settings(cli, env={})
    prepared = prepare_run(settings, None)
    try:
        hops: list[str] = []
        real = asyncio.to_thread

        async def counted(func: Any, /, *args: Any, **kwargs: Any) -> Any:
            hops.append(getattr(func, "__name__", repr(func)))
            return await real(func, *args, **kwargs)

        monkeypatch.setattr(asyncio, "to_thread", counted)
        paths = prepared.paths
        order = start_order_for(settings, None, whole_groups=True)
        pending = Pending(paths.materialized, prepared.state, None, None, paths.reservations,
                          order)  # fmt: skip
        started = []
        async for rollout in pending.each(lambda: False):
            await pending.reserve()
            started.append(rollout)
        assert len(started) == 8
        assert len(hops) == 2, hops
        assert count_lines(paths.reservations) == 1
    finally:
        prepared.lock.release()
