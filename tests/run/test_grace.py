"""The shutdown grace (run/grace.py) in-process: a real agent on 127.0.0.1 gated by
the test, the daemon's own commit queue, a stop as SIGTERM makes it."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from dispatcher.errors import ExitCode
from dispatcher.lifecycle import Stage
from dispatcher.run.job import Job
from tests.helpers import FakeAgent, in_process_run, read_jsonl, set_after, wait_until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Set once a job's grace has decided what it cancels."""
    return set_after(monkeypatch, Job, "settle", asyncio.Event())


async def test_an_answered_rollout_is_written_at_shutdown_when_the_commit_queue_is_full(
    tmp_path: Path, settled: asyncio.Event
) -> None:
    # contracts §10: every answered row is written. Its agent has answered; its
    # row waits for room in the commit queue, so it is at no agent any more.
    agent = FakeAgent(gated=True)
    await agent.start()
    dispatcher = in_process_run(tmp_path, agent.url, 1, shutdown_grace_s=5, commit_queue_bytes=1)
    queue = dispatcher.daemon.commit_queue
    run = asyncio.create_task(dispatcher.run())
    try:
        await wait_until(lambda: agent.holding == 1)
        await queue.enter(1)  # the queue is full until the test leaves it
        agent.release_next()
        await wait_until(lambda: queue.waiting == 1)
        dispatcher.daemon._handle_signal(signal.SIGTERM)
        await settled.wait()
        queue.leave(1)
        code = await asyncio.wait_for(run, 30)
    finally:
        await agent.close()
    assert code == ExitCode.DONE
    assert len(read_jsonl(tmp_path / "x.jsonl")) == 1


def test_a_rollouts_stage_goes_back_only_from_its_agent_to_a_retry() -> None:
    assert Stage.AT_AGENT.may_move_to(Stage.WAITING)  # not delivered: it waits to retry
    for stage in (Stage.ANSWERED, Stage.COMMITTING, Stage.DONE):
        assert not stage.may_move_to(Stage.WAITING)
        assert not stage.may_move_to(Stage.AT_AGENT)
    assert Stage.ANSWERED.may_move_to(Stage.DONE)
