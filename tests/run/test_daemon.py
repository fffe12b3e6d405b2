"""The daemon/job split in-process: forward-only lifecycles, a dead row writer,
a startup that fails half-way, and line numbers of durable rows."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dispatcher.delivery.http1_pool import Http1Pool
from dispatcher.errors import DispatcherError, OutputWriteError
from dispatcher.files.atomic import RunLock
from dispatcher.files.resume import OutputPaths
from dispatcher.files.writer import LineIndex, RowWriter
from dispatcher.lifecycle import JobState, Lifecycle, Phase
from dispatcher.run import daemon as daemon_module
from tests.conftest import SimAgentFactory
from tests.helpers import FakeAgent, in_process_run, read_jsonl

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def agent_url(sim_agent: SimAgentFactory) -> AsyncIterator[str]:
    url, _ = await sim_agent()
    yield url


def test_lifecycles_only_move_forward() -> None:
    phase = Lifecycle(Phase.STARTING)
    assert phase.advance(Phase.RUNNING)
    assert phase.advance(Phase.FINISHED)
    # A late signal's "draining" must not undo "finished".
    assert not phase.advance(Phase.DRAINING)
    assert phase.state is Phase.FINISHED
    job = Lifecycle(JobState.QUEUED)
    assert job.advance(JobState.RUNNING)
    assert job.advance(JobState.DONE)
    # A cancel that races the last commit leaves the job done.
    assert not job.advance(JobState.CANCELLED)
    assert job.state is JobState.DONE
    assert JobState.DONE.final and not JobState.RUNNING.final


async def test_a_signal_after_the_run_finished_leaves_it_finished(
    tmp_path: Path, agent_url: str
) -> None:
    dispatcher = in_process_run(tmp_path, agent_url, 5)
    await dispatcher.run()
    assert dispatcher.state == "finished"
    # The daemon removed its signal handlers when it closed.
    assert not asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
    dispatcher.daemon._handle_signal(signal.SIGTERM)
    assert dispatcher.state == "finished"


async def test_a_row_writer_whose_flusher_dies_fails_the_run_instead_of_hanging_it(
    tmp_path: Path, agent_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: RowWriter) -> None:
        raise RuntimeError("a bug in the writer")

    monkeypatch.setattr(RowWriter, "_check_unchanged", broken)
    dispatcher = in_process_run(tmp_path, agent_url, 50, concurrency=8)
    with pytest.raises(OutputWriteError, match="row writer failed"):
        await asyncio.wait_for(dispatcher.run(), 30)
    assert read_jsonl(OutputPaths.for_output(tmp_path / "x.jsonl").output) == []


async def test_a_startup_that_fails_half_way_releases_the_lock_session_and_writers(
    tmp_path: Path, agent_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("telemetry could not start")

    # After the job's files and the session exist, before dispatch.
    monkeypatch.setattr(daemon_module, "declare_run_gauges", broken)
    dispatcher = in_process_run(tmp_path, agent_url, 5)
    with pytest.raises(RuntimeError, match="telemetry could not start"):
        await dispatcher.run()
    lock = RunLock(OutputPaths.for_output(tmp_path / "x.jsonl").lock)
    lock.acquire()  # not held any more
    lock.release()
    assert dispatcher.daemon.agents._pool.closed
    assert all(w._flusher is None for w in dispatcher.job.writers)
    pending = {t.get_name() for t in asyncio.all_tasks()} - {asyncio.current_task().get_name()}  # type: ignore[union-attr]
    assert not [name for name in pending if name.startswith(("writer:", "ticker", "budget"))]


async def test_durable_rows_get_their_line_numbers_and_the_index_finds_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"old": 1}\n{"old": 2}\n')
    index = LineIndex.scan(path)
    assert len(index) == 2
    writer = RowWriter(path, "never", index=index)
    writer.open()
    seqs = await asyncio.gather(*(writer.append_line(b'{"new": %d}\n' % i) for i in range(5)))
    await writer.close()
    assert sorted(s for s in seqs if s is not None) == [3, 4, 5, 6, 7]
    data = path.read_bytes()
    for seq in (1, 3, 7):
        start, end = index.span(seq, seq)
        assert data[start:end].count(b"\n") == 1
    assert LineIndex.scan(path).starts == index.starts
    # A torn tail is never indexed.
    path.write_bytes(data + b'{"torn')
    assert len(LineIndex.scan(path)) == 7


async def test_a_daemon_task_that_dies_ends_the_run_at_once_naming_it(tmp_path: Path) -> None:
    agent = FakeAgent(gated=True)
    await agent.start()
    dispatcher = in_process_run(tmp_path, agent.url, 3, progress_interval_s=0.01)
    calls = 0
    status = dispatcher.status

    def broken_status() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls > 1 and agent.holding:
            raise RuntimeError("a bug in the progress figures")
        return status()

    dispatcher.status = broken_status  # type: ignore[method-assign]
    try:
        # The agent holds every rollout: only the dead ticker can end this run.
        with pytest.raises(DispatcherError, match=r"ticker task died.*a bug in the progress"):
            await asyncio.wait_for(dispatcher.run(), 20)
    finally:
        await agent.close()
    assert read_jsonl(tmp_path / "x.jsonl") == []


async def test_the_agent_connections_of_a_wave_are_all_kept_for_the_next(
    tmp_path: Path, agent_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Kept idle were at most 1,024 per replica: a wave of 10,000 calls in flight
    # then closed 9 in 10 of its connections, and the next wave opened them again.
    pools: list[Http1Pool] = []

    class Recorded(Http1Pool):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            pools.append(self)

    monkeypatch.setattr(daemon_module, "Http1Pool", Recorded)
    dispatcher = in_process_run(tmp_path, agent_url, 2, concurrency=5000)
    await dispatcher.run()
    assert dispatcher.state == "finished"
    concurrency = dispatcher.daemon.concurrency  # below 5,000 where descriptors are few
    assert [pool.max_idle for pool in pools] == [concurrency]
