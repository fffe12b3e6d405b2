"""Faults of the infrastructure are not failures of the task (contracts §11), over real sockets.

Each test starts real agents on 127.0.0.1, kills or silences them at a point
the test controls, and runs the real CLI: dead replicas, an outage of the
only replica, 429s with ``Retry-After``, a descriptor limit far below the
concurrency, an unreachable agent, a silent agent and a budget that ends
with rollouts in flight.
"""

from __future__ import annotations

import asyncio
import itertools
import resource
import socket
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from dispatcher.files.resume import OutputPaths, load_run_state, row_key
from dispatcher.sim.agent import STATS_KEY, SimAgentConfig, build_sim_agent_app
from dispatcher.telemetry.http_app import start_site
from tests.helpers import (
    free_port,
    log_events,
    read_jsonl,
    run_args,
    run_cli,
    serve,
    spawn_cli,
    wait_until,
    write_tasks,
)

FAST = ("--fsync", "never")
BREAKER_FAILURES = 5  # the default failures_to_open


class Files:
    def __init__(self, tmp_path: Path, tasks: int) -> None:
        self.tasks = write_tasks(tmp_path / "tasks.jsonl", tasks)
        self.output = tmp_path / "out" / "x.jsonl"
        self.output.parent.mkdir()
        self.count = tasks

    def args(self, agent_urls: str, *extra: str) -> list[str]:
        return run_args(self.tasks, self.output, agent_urls, *FAST, *extra)

    def rows(self) -> list[dict[str, Any]]:
        return read_jsonl(self.output)

    def failure_rows(self) -> list[dict[str, Any]]:
        return read_jsonl(OutputPaths.for_output(self.output).failures)


def summary_of(stderr: str) -> dict[str, Any]:
    [summary] = [e for e in log_events(stderr) if e["event"] == "run_summary"]
    return summary


def assert_complete(files: Files, stderr: str) -> None:
    rows = files.rows()
    assert sorted(row_key(r) or 0 for r in rows) == sorted(
        row_key({"_ng_task_index": i, "_ng_rollout_index": 0}) or 0 for i in range(files.count)
    )
    assert files.failure_rows() == [], stderr[-3000:]


def probes_share(summary: dict[str, Any], url: str) -> float:
    """Attempts sent to ``url`` while its breaker was not closed, over all attempts."""
    replicas = summary["replicas"]["sim"]
    total = sum(r["sent"] for r in replicas.values())
    return float(replicas[url]["probes"]) / total


Servers = list[web.AppRunner]


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    """Runners the test starts; whatever it did not stop itself is stopped at the end."""
    runners: Servers = []
    yield runners
    for runner in runners:
        if runner.server is not None:
            await runner.cleanup()


async def sim_replica(servers: Servers, **config: Any) -> tuple[web.AppRunner, str, Any]:
    app = build_sim_agent_app(SimAgentConfig(**config))
    runner, url = await serve(app)
    servers.append(runner)
    return runner, url, app[STATS_KEY]


async def fake_agent(servers: Servers, handler: Any) -> str:
    app = web.Application()
    app.router.add_post("/run", handler)
    runner, url = await serve(app)
    servers.append(runner)
    return url


# ---- dead replicas ------------------------------------------------------------------


async def test_a_replica_dead_from_the_start_gets_almost_no_work(
    tmp_path: Path, servers: Servers
) -> None:
    _, live, _ = await sim_replica(servers, latency_s=0.005)
    dead = f"http://127.0.0.1:{free_port()}"
    files = Files(tmp_path, 600)

    result = await run_cli(*files.args(f"{dead},{live}", "--concurrency", "16"))

    assert result.returncode == 0, result.stderr[-3000:]
    assert_complete(files, result.stderr)
    summary = summary_of(result.stderr)
    assert summary["replicas"]["sim"][dead]["opened"] >= 1
    assert probes_share(summary, dead) < 0.05
    assert summary["retries"]["sim"]["no_answer"] >= BREAKER_FAILURES
    events = log_events(result.stderr)
    assert any(e["event"] == "replica_opened" and e["replica"] == dead for e in events)

    # `status` and `report` read the same history back from the manifest.
    status = await run_cli("status", str(files.output), "--json")
    history = orjson.loads(status.stdout)["delivery"]
    assert history["hops"] == 1
    assert history["retries"]["sim"]["no_answer"] == summary["retries"]["sim"]["no_answer"]
    by_url = {r["replica"]: r for r in history["replicas"]}
    assert by_url[dead]["delivered"] == 0 and by_url[dead]["opened"] >= 1
    assert by_url[live]["delivered"] == 600
    for command in ("status", "report"):
        text = (await run_cli(command, str(files.output))).stdout
        assert "delivery over 1 hop(s)" in text and dead in text and "no_answer" in text


async def test_a_replica_killed_mid_run_hands_its_work_to_the_live_one(
    tmp_path: Path, servers: Servers
) -> None:
    _, live, _ = await sim_replica(servers, latency_s=0.01)
    doomed_runner, doomed, doomed_stats = await sim_replica(servers, latency_s=0.01)
    files = Files(tmp_path, 1500)

    run = await spawn_cli(*files.args(f"{live},{doomed}", "--concurrency", "16"))
    await wait_until(lambda: doomed_stats.requests >= 100, timeout_s=60)
    await doomed_runner.cleanup()
    result = await run.wait(timeout_s=120)

    assert result.returncode == 0, result.stderr[-3000:]
    assert_complete(files, result.stderr)
    summary = summary_of(result.stderr)
    assert summary["replicas"]["sim"][doomed]["opened"] >= 1
    assert probes_share(summary, doomed) < 0.05


async def test_the_only_replica_down_for_3_backoff_caps_then_back(
    tmp_path: Path, servers: Servers
) -> None:
    app = build_sim_agent_app(SimAgentConfig(latency_s=0.01))
    runner, port = await start_site(app, "127.0.0.1", 0)
    servers.append(runner)
    url = f"http://127.0.0.1:{port}"
    files = Files(tmp_path, 400)
    # Backoffs capped at 2 s (default 30 s): the breaker and the retries reach
    # their caps within the outage, as in a long one, in a fraction of its time.
    caps = {"DISPATCHER_RETRY_BACKOFF_CAP_S": "2", "DISPATCHER_BREAKER_OPEN_CAP_S": "2"}

    run = await spawn_cli(*files.args(url, "--concurrency", "16"), env=caps)
    await wait_until(lambda: app[STATS_KEY].requests >= 100, timeout_s=60)
    await runner.cleanup()
    await wait_until(lambda: run.saw("replica_opened"), timeout_s=30)
    # The outage itself is the scenario: 6 s (three caps) with nobody on the port.
    await asyncio.sleep(6)
    back, _ = await start_site(
        build_sim_agent_app(SimAgentConfig(latency_s=0.01)), "127.0.0.1", port
    )
    try:
        result = await run.wait(timeout_s=120)
    finally:
        await back.cleanup()

    assert result.returncode == 0, result.stderr[-3000:]
    assert_complete(files, result.stderr)
    summary = summary_of(result.stderr)
    assert sum(summary["retries"]["sim"].values()) > 0
    assert summary["outcomes"] == {"success": 400}
    assert run.saw("replica_closed")


async def test_429_with_retry_after_is_honoured_and_writes_no_failure(
    tmp_path: Path, servers: Servers
) -> None:
    arrivals: defaultdict[str, list[tuple[float, int]]] = defaultdict(list)
    served = 0

    async def handle(request: web.Request) -> web.Response:
        nonlocal served
        served += 1
        body = orjson.loads(await request.read())
        rollout = f"{body['_ng_task_index']}-{body['_ng_rollout_index']}"
        status = 429 if served <= 200 else 200
        arrivals[rollout].append((time.monotonic(), status))
        if status == 429:
            return web.Response(status=429, headers={"Retry-After": "1"}, text="slow down")
        return web.Response(body=orjson.dumps({**body, "reward": 1.0}))

    url = await fake_agent(servers, handle)
    files = Files(tmp_path, 100)

    result = await run_cli(*files.args(url, "--concurrency", "50"))

    assert result.returncode == 0, result.stderr[-3000:]
    assert_complete(files, result.stderr)
    assert summary_of(result.stderr)["retries"]["sim"]["http_429"] == 200
    for seen in arrivals.values():
        for (at, status), (next_at, _) in itertools.pairwise(seen):
            assert status == 429
            assert next_at - at >= 0.99, seen


# ---- our own faults -------------------------------------------------------------------


def _nofile_256() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


async def test_a_descriptor_limit_far_below_the_concurrency_is_not_the_agents_fault(
    tmp_path: Path, servers: Servers
) -> None:
    _, url, stats = await sim_replica(servers, latency_s=0.05)
    files = Files(tmp_path, 2000)

    run = await spawn_cli(*files.args(url, "--concurrency", "1000"), preexec_fn=_nofile_256)
    result = await run.wait(timeout_s=180)

    # Throttled to what the limit allows, and complete; nothing charged to the agent.
    assert result.returncode == 0, result.stderr[-3000:]
    assert_complete(files, result.stderr)
    [capped] = [e for e in log_events(result.stderr) if e["event"] == "concurrency_capped"]
    assert capped["concurrency"] == 1000 and capped["capped_to"] < 256
    assert "ulimit -n" in capped["reason"]
    assert 1 < stats.max_in_flight <= capped["capped_to"]


# ---- deadlines --------------------------------------------------------------------------


async def test_an_unreachable_agent_exits_75_after_the_delivery_deadline(
    tmp_path: Path, servers: Servers
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    files = Files(tmp_path, 40)
    args = files.args(url, "--concurrency", "8", "--delivery-deadline-s", "1")

    started = time.monotonic()
    result = await run_cli(*args)

    assert result.returncode == 75, result.stderr[-3000:]
    assert time.monotonic() - started < 30
    [down] = [e for e in log_events(result.stderr) if e["event"] == "agent_down"]
    assert down["level"] == "error" and down["agent"] == "sim" and down["replicas"] == [url]
    assert url in down["message"]
    failures = files.failure_rows()
    assert failures and all(f["_ng_failure_not_delivered"] is True for f in failures)
    assert all(f["_ng_failure_class"] == "agent_request_failed" for f in failures)
    summary = summary_of(result.stderr)
    assert summary["agents_down"] == ["sim"] and summary["remaining"] == 40

    again = await run_cli(*args)

    assert again.returncode == 75
    state = load_run_state(OutputPaths.for_output(files.output), max_attempts=3)
    assert not any(state.is_final(row_key(f) or 0) for f in files.failure_rows())
    assert files.rows() == []


async def test_a_silent_agent_is_retried_after_the_first_byte_timeout(
    tmp_path: Path, servers: Servers
) -> None:
    never = asyncio.Event()

    async def silent(request: web.Request) -> web.Response:
        await never.wait()
        return web.Response()

    url = await fake_agent(servers, silent)
    files = Files(tmp_path, 2)

    result = await run_cli(
        *files.args(url, "--first-byte-timeout-s", "0.2", "--delivery-deadline-s", "1")
    )

    assert result.returncode == 75, result.stderr[-3000:]
    summary = summary_of(result.stderr)
    assert summary["retries"]["sim"]["first_byte_timeout"] >= 2
    failures = files.failure_rows()
    assert len(failures) == 2 and all(f["_ng_failure_not_delivered"] for f in failures)


async def test_the_budget_end_cancels_in_flight_rollouts_after_the_grace(
    tmp_path: Path, servers: Servers
) -> None:
    never = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await never.wait()
        return web.Response()

    url = await fake_agent(servers, hang)
    files = Files(tmp_path, 20)

    started = time.monotonic()
    result = await run_cli(
        *files.args(
            url, "--concurrency", "4", "--dispatch-budget-s", "1", "--shutdown-grace-s", "0.5"
        )
    )

    assert result.returncode == 75, result.stderr[-3000:]
    assert time.monotonic() - started < 20
    assert files.rows() == [] and files.failure_rows() == []
    events = log_events(result.stderr)
    assert any(e["event"] == "budget_exhausted" for e in events)
    assert summary_of(result.stderr)["outcomes"]["cancelled"] == 4


# ---- what the operator sees ---------------------------------------------------------------


async def test_failures_are_warnings_with_the_status_and_every_line_has_the_run_id(
    tmp_path: Path, servers: Servers
) -> None:
    async def error(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    url = await fake_agent(servers, error)
    files = Files(tmp_path, 3)

    result = await run_cli(*files.args(url))

    assert result.returncode == 75
    events = log_events(result.stderr)
    assert events and all(e.get("run_id") for e in events), result.stderr[-3000:]
    finished = [e for e in events if e["event"] == "rollout_finished"]
    assert {(e["level"], e["http_status"]) for e in finished} == {("warning", 500)}


async def test_a_black_holed_address_hits_the_connect_timeout(
    tmp_path: Path, servers: Servers
) -> None:
    # A listener that never accepts, its accept queue already full: the
    # kernel drops further SYNs, so a connect hangs as on a black-holed host.
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(0)
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(hole.getsockname())
        fillers.append(filler)
    url = f"http://127.0.0.1:{hole.getsockname()[1]}"
    files = Files(tmp_path, 2)
    try:
        result = await run_cli(
            *files.args(url, "--connect-timeout-s", "0.3", "--delivery-deadline-s", "1.5")
        )
    finally:
        for s in (*fillers, hole):
            s.close()

    assert result.returncode == 75, result.stderr[-3000:]
    assert summary_of(result.stderr)["retries"]["sim"]["connect_timeout"] >= 2
    failures = files.failure_rows()
    assert len(failures) == 2 and all(f["_ng_failure_not_delivered"] for f in failures)
