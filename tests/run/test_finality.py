"""One finality rule (contracts §11): the live run's exit code, resume, ``dispatcher status``
and a served job's state never disagree, and a not-delivered row is never final.

Each test drives the real CLI against agents on 127.0.0.1 that the test scripts.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.helpers import (
    FakeAgent,
    free_port,
    log_events,
    read_jsonl,
    run_args,
    run_cli,
    spawn_cli,
    wait_until,
    write_tasks,
)
from tests.serve.test_service_e2e import Serve, rows

pytestmark = pytest.mark.timeout(120)


def _summary(stderr: str) -> dict[str, Any]:
    [summary] = [e for e in log_events(stderr) if e["event"] == "run_summary"]
    return summary


async def _status_code(output: Path) -> int:
    return (await run_cli("status", str(output))).returncode


async def test_a_rollout_never_delivered_on_its_last_attempt_is_not_final(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "tasks.jsonl", 5)
    output = tmp_path / "x.jsonl"
    args = run_args(tasks, output, f"http://127.0.0.1:{free_port()}")
    args += ["--max-attempts", "1", "--delivery-deadline-s", "0"]

    first = await run_cli(*args)

    assert first.returncode == 75, first.stderr[-3000:]
    assert _summary(first.stderr)["remaining"] == 5
    assert len(read_jsonl(tmp_path / "x_failures.jsonl")) == 5
    assert await _status_code(output) == 75
    again = await run_cli(*args)
    assert again.returncode == 75, again.stderr[-3000:]
    assert await _status_code(output) == 75


async def test_two_real_failures_then_an_agent_down_leave_the_run_resumable(
    tmp_path: Path,
) -> None:
    mode = {"answer": 500}

    def respond(body: dict[str, Any]) -> web.StreamResponse:
        if mode["answer"] == 200:
            return web.json_response({"reward": 1.0})
        return web.json_response({"error": "no"}, status=mode["answer"])

    agent = FakeAgent(respond)
    await agent.start()
    tasks = write_tasks(tmp_path / "tasks.jsonl", 2)
    output = tmp_path / "x.jsonl"
    args = [*run_args(tasks, output, agent.url), "--delivery-deadline-s", "0"]
    try:
        codes = []
        for answer in (500, 500, 503):
            mode["answer"] = answer
            result = await run_cli(*args)
            codes.append((result.returncode, await _status_code(output)))
        mode["answer"] = 200
        last = await run_cli(*args)
    finally:
        await agent.close()

    # Each hop's exit code and `dispatcher status` agree; the not-delivered
    # third hop leaves both rollouts to run (before: exit 0 at 0% coverage).
    assert codes == [(75, 75), (75, 75), (75, 75)]
    assert last.returncode == 0, last.stderr[-3000:]
    assert await _status_code(output) == 0
    assert len(read_jsonl(output)) == 2
    # Two counted failures, one not delivered (it spends no attempt, but its index
    # was used), then the success: attempt index 3 (contracts §5: never reused).
    assert [r.get("_ng_attempt_index", 0) for r in read_jsonl(output)] == [3, 3]


async def test_a_served_job_whose_rollouts_were_never_delivered_is_not_done(
    tmp_path: Path,
) -> None:
    def unavailable(body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response({"error": "busy"}, status=503)

    agent = FakeAgent(unavailable)
    await agent.start()
    state = tmp_path / "state"
    serve = await Serve.start(state, agent.url, "--delivery-deadline-s", "0", "--max-attempts", "1")
    code = None
    try:
        await serve.submit(job_id="j", rows=rows(3))
        await _wait_for(lambda: agent.seen >= 6)
        status = await serve.job("j")
        code = await serve.stop(signal.SIGTERM)
    finally:
        if code is None:
            await serve.stop(signal.SIGKILL)
        await agent.close()

    assert status["state"] != "done", status
    assert status["final"] is False
    assert code == 75
    listed = await run_cli("status", str(state))
    assert listed.returncode == 75, listed.stdout + listed.stderr


async def _wait_for(condition: Any) -> None:
    await wait_until(condition, timeout_s=30)


async def test_sigint_cancels_at_once_rollouts_only_waiting_to_retry(tmp_path: Path) -> None:
    def unavailable(body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response({"error": "busy"}, status=503)

    agent = FakeAgent(unavailable)
    await agent.start()
    tasks = write_tasks(tmp_path / "tasks.jsonl", 4)
    output = tmp_path / "x.jsonl"
    args = run_args(tasks, output, agent.url)
    # Every rollout sleeps between retries; the grace would hold them a minute.
    args += ["--shutdown-grace-s", "60", "--delivery-deadline-s", "600"]
    proc = await spawn_cli(*args)
    try:
        await wait_until(lambda: proc.saw("rollout_retry"), timeout_s=30)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGINT)
        result = await proc.wait()
    finally:
        await agent.close()

    assert result.returncode == 75, result.stderr[-3000:]
    assert time.monotonic() - signalled < 15, "rollouts waiting on a backoff got the grace"
    assert read_jsonl(output) == [] and read_jsonl(tmp_path / "x_failures.jsonl") == []
