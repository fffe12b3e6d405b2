"""A run or job where no rollout succeeded and every failure is of one class is never
done (contracts §10): the live exit code, `dispatcher status` and a served job agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aiohttp import web

from tests.helpers import FakeAgent, read_jsonl, run_args, run_cli, wait_until, write_tasks
from tests.serve.test_service_e2e import Serve, rows

NOTHING = (
    "error: no rollout succeeded: every one of the 6 rollouts failed as agent_run_error; "
    "once the agent is fixed, rerun with --extend-attempts N (or --fresh) to run them again"
)


def broken(body: dict[str, Any]) -> web.StreamResponse:
    return web.json_response({"detail": "internal error"}, status=500)


async def test_an_agent_answering_500_to_everything_never_exits_0(tmp_path: Path) -> None:
    agent = FakeAgent(broken)
    await agent.start()
    tasks = write_tasks(tmp_path / "tasks.jsonl", 3)
    output = tmp_path / "x.jsonl"
    args = [*run_args(tasks, output, agent.url), "--num-repeats", "2", "--max-attempts", "1"]
    try:
        first = await run_cli(*args)
        failures = len(read_jsonl(tmp_path / "x_failures.jsonl"))
        again = await run_cli(*args)
        status = await run_cli("status", str(output))
        fixed = await run_cli(*args, "--extend-attempts", "1")
    finally:
        await agent.close()
    assert first.returncode == 1, first.stderr[-3000:]
    assert first.stderr.splitlines()[-1] == NOTHING
    assert failures == 6
    # Every rollout is final: a rerun starts nothing and says the same.
    assert again.returncode == 1 and again.stderr.splitlines()[-1] == NOTHING
    assert agent.seen == 6 + 6  # the rerun sent nothing; --extend-attempts 1 sent each again
    assert status.returncode == 1, status.stdout
    assert f"failed: {NOTHING.removeprefix('error: ')}" in status.stdout
    assert fixed.returncode == 1


async def test_failures_of_two_classes_are_the_tasks_own_and_the_run_is_done(
    tmp_path: Path,
) -> None:
    def mixed(body: dict[str, Any]) -> web.StreamResponse:
        if body["_ng_task_index"] == 0:
            return web.Response(body=b"not json", content_type="text/plain")
        return broken(body)

    agent = FakeAgent(mixed)
    await agent.start()
    tasks = write_tasks(tmp_path / "tasks.jsonl", 3)
    output = tmp_path / "x.jsonl"
    try:
        result = await run_cli(*run_args(tasks, output, agent.url), "--max-attempts", "1")
        status = await run_cli("status", str(output))
    finally:
        await agent.close()
    assert result.returncode == 0, result.stderr[-3000:]
    assert status.returncode == 0, status.stdout


async def test_a_served_job_that_nothing_succeeded_in_ends_failed(tmp_path: Path) -> None:
    agent = FakeAgent(broken)
    await agent.start()
    serve = await Serve.start(tmp_path / "state", agent.url, "--max-attempts", "1")
    try:
        await serve.submit(job_id="j", rows=rows(3))

        async def final() -> bool:
            return bool((await serve.job("j"))["final"])

        await wait_until(final, timeout_s=30)
        status = await serve.job("j")
    finally:
        await serve.stop()
        await agent.close()
    assert status["state"] == "failed"
    assert status["error"].startswith(
        "no rollout succeeded: every one of the 3 rollouts failed as agent_run_error;"
    )
