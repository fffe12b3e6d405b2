"""`run` against an agent none of whose replicas ever accepts a connection: exit 2 naming
it once `--wait-for-agents-s` is over, not retries until the delivery deadline."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import SimAgentFactory
from tests.helpers import free_port, listening_port, read_jsonl, run_args, run_cli, write_tasks


async def test_a_typoed_agent_port_is_exit_2_naming_the_agent(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "tasks.jsonl", 4)
    dead = f"http://127.0.0.1:{free_port()}"
    args = run_args(tasks, tmp_path / "x.jsonl", dead, "--wait-for-agents-s", "0.5")
    result = await run_cli(*args, "--delivery-deadline-s", "600", timeout_s=60)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == (
        f"error: agent 'sim' at {dead}: no replica accepted a connection in the 0.5 s since "
        "the start (--wait-for-agents-s): check the URL and that the agent is up"
    )
    # Nothing was delivered, and nothing is charged to the tasks: a rerun runs them all.
    assert read_jsonl(tmp_path / "x_failures.jsonl") == []


async def test_one_replica_that_accepts_is_enough(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, _ = await sim_agent(latency_s=0.0)
    tasks = write_tasks(tmp_path / "tasks.jsonl", 4)
    dead = f"http://127.0.0.1:{free_port()}"
    args = run_args(tasks, tmp_path / "x.jsonl", f"{dead},{url}", "--wait-for-agents-s", "30")
    result = await run_cli(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(read_jsonl(tmp_path / "x.jsonl")) == 4


async def test_an_agent_that_accepts_but_never_answers_is_no_config_error(
    tmp_path: Path,
) -> None:
    # It took the connection: the rules of an agent that fails to deliver apply (exit 75).
    with listening_port() as port:
        url = f"http://127.0.0.1:{port}"
        tasks = write_tasks(tmp_path / "tasks.jsonl", 2)
        args = run_args(tasks, tmp_path / "x.jsonl", url, "--wait-for-agents-s", "0.2")
        args += ["--first-byte-timeout-s", "0.5", "--delivery-deadline-s", "1"]
        result = await run_cli(*args, timeout_s=60)
    assert result.returncode == 75, result.stderr[-3000:]
