"""Agent health over real sockets (contracts §11, issue 19): Gym's 409, wrong agent URLs,
an unreachable agent named at once, and an agent marked down that comes back.

Agents are real aiohttp servers on 127.0.0.1; the runs are the real CLI.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from dispatcher.delivery.client import classify_response
from dispatcher.outcome import Outcome
from dispatcher.telemetry.http_app import start_site
from tests.delivery.test_delivery_e2e import Files, Servers, fake_agent, servers, summary_of
from tests.helpers import (
    free_port,
    log_events,
    read_jsonl,
    read_request,
    run_cli,
    spawn_cli,
    wait_until,
    write_tasks,
)
from tests.serve.test_service_e2e import Serve, api_session, rows

pytestmark = pytest.mark.timeout(120)
__all__ = ["servers"]  # the fixture, imported for these tests

ADMISSION_CLOSED = {"detail": "admission_closed"}


def _not_a_run_request(body: dict[str, Any]) -> web.Response | None:
    # As NeMo Gym's FastAPI agents answer the dispatcher's probe (``{}``).
    if "_ng_task_index" not in body:
        return web.json_response({"detail": "field required"}, status=422)
    return None


# ---- Gym's 409 ----------------------------------------------------------------------


def test_a_409_is_not_delivered_only_when_it_says_admission_closed() -> None:
    closed = orjson.dumps(ADMISSION_CLOSED)
    assert classify_response(409, closed)[0] is Outcome.AGENT_REQUEST_FAILED
    assert classify_response(409, b'{"detail": "conflict"}')[0] is Outcome.AGENT_RUN_ERROR


async def test_admission_closed_for_two_tries_of_each_rollout_is_retried_not_failed(
    tmp_path: Path, servers: Servers
) -> None:
    tries: Counter[int] = Counter()

    async def checkpointing(request: web.Request) -> web.Response:
        body = await request.json()
        if (probe := _not_a_run_request(body)) is not None:
            return probe
        task = body["_ng_task_index"]
        tries[task] += 1
        if tries[task] <= 2:
            return web.json_response(ADMISSION_CLOSED, status=409)
        return web.json_response({"reward": 1.0})

    url = await fake_agent(servers, checkpointing)
    files = Files(tmp_path, 10)

    result = await run_cli(
        *files.args(url, "--delivery-deadline-s", "30"),
        env={"DISPATCHER_RETRY_BACKOFF_BASE_S": "0.01", "DISPATCHER_BREAKER_FAILURES": "100"},
    )

    assert result.returncode == 0, result.stderr[-3000:]
    assert len(files.rows()) == 10 and files.failure_rows() == []
    summary = summary_of(result.stderr)
    assert summary["retries"]["sim"]["http_409_admission_closed"] == 20
    assert all(count == 3 for count in tries.values())


async def test_a_409_that_only_mentions_admission_closed_is_the_agents_error_as_it_said(
    tmp_path: Path, servers: Servers
) -> None:
    # Not Gym's checkpoint refusal: an agent's own conflict that quotes the word.
    said = {"detail": "rollout already ran; the env said admission_closed earlier"}
    tries: Counter[int] = Counter()

    async def conflicting(request: web.Request) -> web.Response:
        body = await request.json()
        if (probe := _not_a_run_request(body)) is not None:
            return probe
        tries[body["_ng_task_index"]] += 1
        return web.json_response(said, status=409)

    url = await fake_agent(servers, conflicting)
    files = Files(tmp_path, 3)

    result = await run_cli(
        *files.args(url, "--delivery-deadline-s", "5", "--max-attempts", "1"),
        env={"DISPATCHER_RETRY_BACKOFF_BASE_S": "0.01", "DISPATCHER_BREAKER_FAILURES": "100"},
    )

    failures = files.failure_rows()
    assert [row["_ng_failure_class"] for row in failures] == ["agent_run_error"] * 3, failures
    assert all("rollout already ran" in row["_ng_failure_response_body"] for row in failures)
    assert "http_409_admission_closed" not in orjson.dumps(summary_of(result.stderr)).decode()
    assert set(tries.values()) == {1}


# ---- a wrong agent URL --------------------------------------------------------------


async def test_an_agent_url_ending_in_run_is_exit_2_and_one_line(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/run"
    tasks = write_tasks(tmp_path / "t.jsonl", 2)
    output = tmp_path / "out" / "x.jsonl"

    for command in ("run", "validate"):
        result = await run_cli(
            command, "--input", str(tasks), "--output", str(output), "--agent", f"sim={url}"
        )

        assert result.returncode == 2, result.stderr
        [line] = result.stderr.strip().splitlines()
        assert "--agent" in line and url in line
        assert "give the base URL, the dispatcher appends /run" in line
    assert not (tmp_path / "out").exists()


async def test_a_replica_that_404s_post_run_is_a_config_error_not_a_failure(
    tmp_path: Path, servers: Servers
) -> None:
    async def index(request: web.Request) -> web.Response:
        return web.Response(text="an agent, but not here")

    app = web.Application()
    app.router.add_get("/", index)
    runner, port = await start_site(app, "127.0.0.1", 0)
    servers.append(runner)
    url = f"http://127.0.0.1:{port}"
    files = Files(tmp_path, 5)

    validated = await run_cli("validate", *files.args(url)[1:])
    ran = await run_cli(*files.args(url))

    assert validated.returncode == 2, validated.stdout
    assert f"problem: agent sim: {url}: no /run there" in validated.stdout
    assert ran.returncode == 2, ran.stderr[-3000:]
    last = ran.stderr.strip().splitlines()[-1]
    assert "'sim'" in last and url in last and "/run" in last
    assert files.failure_rows() == [] and files.rows() == []


async def test_a_404_after_successes_is_that_tasks_failure_not_a_wrong_url(
    tmp_path: Path, servers: Servers
) -> None:
    # A resources server's "not found", or an ingress during a rolling restart:
    # a replica that has served /run keeps serving the others.
    answered = 0

    async def once_404(request: web.Request) -> web.Response:
        nonlocal answered
        body = await request.json()
        answered += 1
        if answered == 6:
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response({"reward": 1.0, "task": body["_ng_task_index"]})

    url = await fake_agent(servers, once_404)
    files = Files(tmp_path, 10)

    result = await run_cli(*files.args(url, "--concurrency", "1"))
    rerun = await run_cli(*files.args(url, "--concurrency", "1"))

    # A failed attempt, not a wrong URL: the next hop runs it again (a Slurm chain goes on).
    assert result.returncode == 75, result.stderr[-3000:]
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert len(files.rows()) == 10
    [failure] = files.failure_rows()
    assert (failure["_ng_failure_class"], failure["_ng_failure_http_status"]) == (
        "agent_run_error",
        404,
    )
    assert not any(e["event"] == "replica_has_no_run" for e in log_events(result.stderr))


async def test_an_answer_broken_after_its_status_line_is_one_failed_attempt_not_retries(
    tmp_path: Path,
) -> None:
    # The agent ran the rollout before it sent two Content-Lengths: retrying it
    # ran it again and again, and took a live replica for a dead one.
    runs = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal runs
        try:
            while True:
                await read_request(reader)
                runs += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    files = Files(tmp_path, 3)
    try:
        result = await run_cli(
            *files.args(url, "--max-attempts", "1", "--delivery-deadline-s", "2"),
            env={"DISPATCHER_RETRY_BACKOFF_BASE_S": "0.01"},
        )
    finally:
        server.close()
        await server.wait_closed()

    # Each final (its one attempt failed), none succeeded, all alike: exit 1, not retries.
    assert result.returncode == 1, result.stderr[-3000:]
    assert runs == 3
    failures = files.failure_rows()
    assert {(f["_ng_failure_class"], f["_ng_failure_type"], f["_ng_failure_http_status"])
            for f in failures} == {("agent_run_error", "MalformedAnswer", 200)}  # fmt: skip
    summary = summary_of(result.stderr)
    assert summary["retries"] == {} and summary["agents_down"] == []


# ---- an agent no replica of which answers -------------------------------------------


async def test_an_unreachable_agent_is_named_when_its_breakers_open(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    files = Files(tmp_path, 6)
    # Every rollout starts at once: none is held back by the deadline's agent_down,
    # so only the breakers opening can name the agent.
    args = files.args(url, "--concurrency", "8", "--delivery-deadline-s", "2")

    result = await run_cli(*args)
    status = await run_cli("status", str(files.output))

    assert result.returncode == 75, result.stderr[-3000:]
    events = log_events(result.stderr)
    [named] = [e for e in events if e["event"] == "agent_unavailable"]
    assert named["level"] == "error" and named["agent"] == "sim"
    assert summary_of(result.stderr)["agents_down"] == ["sim"]
    assert status.returncode == 75
    assert "not delivered: agent sim unreachable (6 rollouts" in status.stdout


# ---- an agent marked down comes back ------------------------------------------------


class Restartable:
    """An agent on a fixed port that the test stops and starts again."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.probes = 0
        self.runs = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/run", self._handle)
        self._runner, _ = await start_site(app, "127.0.0.1", self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        if (probe := _not_a_run_request(body)) is not None:
            self.probes += 1
            return probe
        self.runs += 1
        return web.json_response({"reward": 1.0})


@pytest.fixture
async def restartable() -> AsyncIterator[Restartable]:
    agent = Restartable()
    yield agent
    await agent.stop()


async def test_serve_an_agent_down_past_the_deadline_is_probed_and_its_job_goes_on(
    tmp_path: Path, restartable: Restartable
) -> None:
    agent = restartable
    await agent.start()
    serve = await _serve(tmp_path / "state", agent.url)
    try:
        await agent.stop()
        job_id = "j1"
        await serve.submit(job_id=job_id, rows=rows(3))
        await wait_until(lambda: _agents_down(serve, ["sim"]), timeout_s=30)
        assert 'dispatcher_agent_up{agent="sim"} 0.0' in await serve.metrics()
        # Past the delivery deadline: a hop that starts none of its rollouts.
        await wait_until(lambda: _hop_paused(serve), timeout_s=30)

        await agent.start()

        await wait_until(lambda: agent.probes > 0, timeout_s=10)
        await wait_until(lambda: _agents_down(serve, []), timeout_s=10)
        assert 'dispatcher_agent_up{agent="sim"} 1.0' in await serve.metrics()
        # Woken when the agent came back, not after the hop's pause.
        await wait_until(serve.in_state(job_id, "done"), timeout_s=10)
        assert agent.runs == 3
        output = tmp_path / "state" / "jobs" / job_id / "rollouts.jsonl"
        assert len(read_jsonl(output)) == 3
    finally:
        assert await serve.stop() == 0


async def _serve(state_dir: Path, agent_url: str) -> Serve:
    """``dispatcher serve`` with a short delivery deadline and quick breakers."""
    env = {
        "DISPATCHER_BREAKER_FAILURES": "1",
        "DISPATCHER_BREAKER_OPEN_S": "0.2",
        "DISPATCHER_BREAKER_OPEN_CAP_S": "0.5",
        "DISPATCHER_RETRY_BACKOFF_BASE_S": "0.05",
    }
    proc = await spawn_cli(
        "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state_dir),
        "--agent", f"sim={agent_url}", "--log-format", "json", "--fsync", "never",
        "--delivery-deadline-s", "1", env=env,
    )  # fmt: skip
    await wait_until(lambda: bool(proc.stdout) or proc.exited, timeout_s=30)
    assert proc.stdout, b"".join(proc.stderr).decode()[-2000:]
    url = proc.stdout[0].decode().split()[-1]
    return Serve(proc, url, api_session())


async def _agents_down(serve: Serve, expected: list[str]) -> bool:
    async with serve.http.get(f"{serve.url}/status") as r:
        return bool((await r.json())["agents_down"] == expected)


def _hop_paused(serve: Serve) -> bool:
    stderr = b"".join(serve.proc.stderr).decode()
    return any(e["event"] == "job_hop_paused" for e in log_events(stderr))
