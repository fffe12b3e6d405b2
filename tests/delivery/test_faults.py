"""The dispatcher's own faults (contracts §11): requeued, never a failure row; persistent → exit 1.

These drive the daemon in-process (``Dispatcher.run``) so the test can take
this very process's file descriptors away mid-run, or make our own row
building fail, while a real agent answers from its own process.
"""

from __future__ import annotations

import os
import resource
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dispatcher.delivery import answers as agents
from dispatcher.delivery.faults import FaultPersisted
from dispatcher.errors import ExitCode
from dispatcher.files.resume import OutputPaths
from dispatcher.rows import finalize as finalizer
from dispatcher.run import daemon
from tests.helpers import in_process_run, read_jsonl, sim_agent_process


@pytest.fixture
async def agent_url() -> AsyncIterator[str]:
    """A sim agent in its own process: our descriptor limit must not be its limit."""
    async with sim_agent_process("--latency-s", "0.2") as url:
        yield url


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_running_out_of_descriptors_mid_run_requeues_and_shrinks_the_pool(
    tmp_path: Path, agent_url: str, no_signal_handlers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without the start-up cap, 200 rollouts want 200 sockets and get about 40.
    monkeypatch.setattr(daemon, "FD_RESERVE", -10_000)
    dispatcher = in_process_run(tmp_path, agent_url, 300, concurrency=200)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_fds() + 48, hard))
    try:
        code = await dispatcher.run()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    assert code is ExitCode.DONE
    paths = OutputPaths.for_output(tmp_path / "x.jsonl")
    assert len(read_jsonl(paths.output)) == 300
    assert read_jsonl(paths.failures) == []
    summary = dispatcher.summary()
    assert summary["local_faults"] > 0
    assert summary["outcomes"]["requeued"] == summary["local_faults"]
    assert summary["outcomes"]["success"] == 300


async def test_a_bug_while_handling_an_answer_requeues_the_rollout(
    tmp_path: Path, agent_url: str, no_signal_handlers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_build_row = finalizer.build_row
    calls = 0

    def flaky_build_row(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls <= 3:
            raise RuntimeError("a bug of ours")
        return real_build_row(*args)

    monkeypatch.setattr(finalizer, "build_row", flaky_build_row)
    dispatcher = in_process_run(tmp_path, agent_url, 10, concurrency=4)

    assert await dispatcher.run() is ExitCode.DONE

    paths = OutputPaths.for_output(tmp_path / "x.jsonl")
    assert len(read_jsonl(paths.output)) == 10
    assert read_jsonl(paths.failures) == []
    assert dispatcher.summary()["outcomes"] == {"success": 10, "requeued": 3}


async def test_a_bug_that_persists_ends_the_run_naming_it(
    tmp_path: Path, agent_url: str, no_signal_handlers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_build_row(*args: Any) -> Any:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(finalizer, "build_row", broken_build_row)
    dispatcher = in_process_run(tmp_path, agent_url, 10, concurrency=2, local_fault_persist_s=0.5)

    with pytest.raises(FaultPersisted, match="a bug of ours"):
        await dispatcher.run()

    paths = OutputPaths.for_output(tmp_path / "x.jsonl")
    assert read_jsonl(paths.output) == [] and read_jsonl(paths.failures) == []


async def test_running_out_of_memory_reading_an_answer_is_not_a_protocol_violation(
    tmp_path: Path, agent_url: str, no_signal_handlers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_classify = agents.classify_response
    calls = 0

    def short_of_memory(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise MemoryError
        return real_classify(*args)

    monkeypatch.setattr(agents, "classify_response", short_of_memory)
    dispatcher = in_process_run(tmp_path, agent_url, 6, concurrency=2)

    assert await dispatcher.run() is ExitCode.DONE

    paths = OutputPaths.for_output(tmp_path / "x.jsonl")
    assert len(read_jsonl(paths.output)) == 6
    assert read_jsonl(paths.failures) == []
    assert dispatcher.summary()["outcomes"] == {"success": 6, "requeued": 2}
