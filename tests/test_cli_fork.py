"""The warm CLI the tests fork from (``tests/cli_fork.py``) is ``python -m dispatcher``:
same output, exit codes, signals, environment and working directory as a new
interpreter."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.cli_fork import ForkedCli, can_fork, start_forked
from tests.helpers import cli_env, run_args, spawn_cli, write_tasks


async def _fresh(*args: str, cwd: Path | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dispatcher", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(), cwd=cwd,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def _forked(*args: str, cwd: Path | None = None) -> tuple[int, str, str]:
    proc = await start_forked(list(args), cli_env(), cwd)
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["--version"],
        ["run", "--help"],
        ["run", "--conc", "3"],
        ["run", "--input", "missing.jsonl", "--output", "out.jsonl", "--agent", "a=http://x:1"],
        ["no-such-command"],
        ["status", "nowhere.jsonl"],
    ],
)
async def test_output_and_exit_code_are_a_new_interpreters(args: list[str], tmp_path: Path) -> None:
    assert await _forked(*args, cwd=tmp_path) == await _fresh(*args, cwd=tmp_path)


async def test_the_child_has_the_asked_environment_and_directory(tmp_path: Path) -> None:
    # `init DIR` writes relative to the working directory; DISPATCHER_* settings come
    # from the environment the test gives, not the server's.
    code, _, err = await _forked("init", "here", cwd=tmp_path)
    assert code == 0, err
    assert (tmp_path / "here").is_dir()
    proc = await start_forked(["run", "--help"], {**cli_env(), "DISPATCHER_X": "1"}, tmp_path)
    assert isinstance(proc, ForkedCli) and proc.pid != os.getpid()
    await proc.communicate()


async def test_signals_reach_the_child_and_its_exit_code_says_so(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "tasks.jsonl", 3)
    # An agent that never answers: the run waits until it is told to stop.
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    run = await spawn_cli(*run_args(tasks, tmp_path / "out.jsonl", f"http://127.0.0.1:{port}"))
    assert isinstance(run.proc, ForkedCli)
    run.send_signal(signal.SIGKILL)
    result = await run.wait()
    assert result.returncode == -signal.SIGKILL
    server.close()


def test_a_run_that_changes_how_python_starts_gets_a_new_interpreter() -> None:
    assert not can_fork({**os.environ, "PYTHONPATH": "/elsewhere"}, None)
    assert not can_fork(dict(os.environ), lambda: None)
