"""Hostile input and hostile peers: each test is one attack and the outcome it must get.

Read the test names as the list. Agents here are small aiohttp servers on
127.0.0.1 built for the attack; the dispatcher is the real CLI in a subprocess.
Item 3 of the issue (model answers of unexpected shapes in the capture merge)
is tested in tests/capture/test_hostile_shapes.py.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import os
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from dispatcher.capture.proxy import build_proxy_app
from dispatcher.delivery.answers import classify_response
from dispatcher.delivery.limits import ProxyLimits
from dispatcher.sim.model import SimModelConfig, build_sim_model_app
from dispatcher.sim.model_client import call_model
from dispatcher.tasks.materialize import MaterializeSpec, materialize, rollout_id_for
from dispatcher.urls import redact_url
from tests.helpers import (
    CliResult,
    FakeAgent,
    Responder,
    cli_env,
    count_lines,
    echo_result,
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
AgentFactory = Callable[..., Awaitable[FakeAgent]]
JsonObject = dict[str, Any]


@pytest.fixture
async def fake_agent() -> AsyncIterator[AgentFactory]:
    agents: list[FakeAgent] = []

    async def start(respond: Responder = echo_result, *, gated: bool = False) -> FakeAgent:
        agent = FakeAgent(respond, gated=gated)
        await agent.start()
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        await agent.close()


@pytest.fixture
async def raw_server() -> AsyncIterator[Callable[[web.Application], Awaitable[str]]]:
    """Serve a purpose-built aiohttp app; returns its base URL."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner, url = await serve(app)
        runners.append(runner)
        return url

    yield start
    for runner in runners:
        await runner.cleanup()


def app_with(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.Application:
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/run", handler)
    return app


class Run:
    def __init__(self, tmp_path: Path, tasks: int = 1) -> None:
        self.dir = tmp_path / "out"
        self.tasks = tmp_path / "tasks.jsonl"
        if tasks:
            write_tasks(self.tasks, tasks)
        self.output = self.dir / "x.jsonl"
        self.failures = self.dir / "x_failures.jsonl"
        self.materialized = self.dir / "x_materialized_inputs.jsonl"

    def args(self, url: str, *extra: str) -> list[str]:
        return run_args(self.tasks, self.output, url, *FAST, *extra)

    def rows(self) -> list[JsonObject]:
        return read_jsonl(self.output)

    def failure_rows(self) -> list[JsonObject]:
        return read_jsonl(self.failures)


def one_error_line(result: CliResult) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


# ---- 1, 2: the task file is never an output file ------------------------------------------


async def test_1_input_named_as_the_materialized_sidecar_is_refused_and_kept(
    tmp_path: Path, fake_agent: AgentFactory
) -> None:
    agent = await fake_agent()
    run = Run(tmp_path, tasks=0)
    run.dir.mkdir()
    write_tasks(run.materialized, 3)
    before = run.materialized.read_bytes()
    run.tasks = run.materialized

    result = await run_cli(*run.args(agent.url))

    assert result.returncode == 2, result.stderr[-3000:]
    assert "same file" in one_error_line(result)
    assert run.materialized.read_bytes() == before
    assert agent.seen == 0 and not run.output.exists()


@pytest.mark.parametrize("fresh", [False, True], ids=["plain", "fresh"])
async def test_2_input_that_is_the_output_is_refused_even_with_fresh(
    tmp_path: Path, fake_agent: AgentFactory, fresh: bool
) -> None:
    agent = await fake_agent()
    run = Run(tmp_path, tasks=0)
    run.dir.mkdir()
    write_tasks(run.output, 3)
    before = run.output.read_bytes()
    run.tasks = run.output

    result = await run_cli(*run.args(agent.url, *(["--fresh"] if fresh else [])))

    assert result.returncode == 2, result.stderr[-3000:]
    line = one_error_line(result)
    assert "same file" in line and "--fresh" not in line
    assert run.output.read_bytes() == before
    assert sorted(p.name for p in run.dir.iterdir()) == ["x.jsonl"]


async def test_2_input_hard_linked_to_a_sidecar_is_refused_by_inode(
    tmp_path: Path, fake_agent: AgentFactory
) -> None:
    agent = await fake_agent()
    run = Run(tmp_path, tasks=3)
    run.dir.mkdir()
    os.link(run.tasks, run.failures)

    result = await run_cli(*run.args(agent.url))

    assert result.returncode == 2, result.stderr[-3000:]
    assert "same file" in one_error_line(result)
    assert agent.seen == 0 and read_jsonl(run.tasks) == read_jsonl(run.failures)


# ---- 3: tests/capture/test_hostile_shapes.py ---------------------------------------------


# ---- 4: X.jsonl deleted or truncated under a running dispatcher --------------------------


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
async def test_4_output_deleted_or_truncated_mid_run_stops_with_exit_1(
    tmp_path: Path, fake_agent: AgentFactory, damage: str
) -> None:
    agent = await fake_agent(gated=True)
    run = Run(tmp_path, tasks=4)
    proc = await spawn_cli(*run_args(run.tasks, run.output, agent.url, "--concurrency", "1"))
    await wait_until(lambda: agent.seen == 1)
    agent.release_next()
    await wait_until(lambda: count_lines(run.output) == 1)
    if damage == "deleted":
        run.output.unlink()
    else:
        os.truncate(run.output, 5)
    agent.open()

    result = await proc.wait()

    assert result.returncode == 1, result.stderr[-3000:]
    line = one_error_line(result)
    assert str(run.output) in line and damage in line
    if damage == "truncated":
        assert run.output.stat().st_size == 5  # nothing appended after the cut
    else:
        assert not run.output.exists()


# ---- 5: a log stream that cannot be written ------------------------------------------------


@pytest.mark.parametrize("stream", ["dev_full", "closed_pipe"])
async def test_5_unwritable_log_stream_never_stops_dispatch(
    tmp_path: Path, fake_agent: AgentFactory, stream: str
) -> None:
    agent = await fake_agent()
    run = Run(tmp_path, tasks=1500)
    read_end = write_end = -1
    if stream == "dev_full":
        write_end = os.open("/dev/full", os.O_WRONLY)
    else:
        read_end, write_end = os.pipe()
    proc = await asyncio.create_subprocess_exec(
        *_python_cli(run.args(agent.url)),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=write_end,
        env=cli_env(),
    )
    os.close(write_end)
    if read_end >= 0:  # like `2>&1 | head -c 100`
        assert await asyncio.to_thread(os.read, read_end, 100)
        os.close(read_end)

    code = await asyncio.wait_for(proc.wait(), 120)

    assert code == 0
    assert count_lines(run.output) == 1500


def _python_cli(args: list[str]) -> list[str]:
    import sys

    return [sys.executable, "-m", "dispatcher", *args]


# ---- 6: capture scoped to one attempt of one hop -------------------------------------------


async def test_6_a_killed_hops_late_model_calls_never_reach_the_rerun_row(
    tmp_path: Path, raw_server: Callable[[web.Application], Awaitable[str]]
) -> None:
    capture_dir = tmp_path / "captures"
    model_url = await raw_server(build_sim_model_app(SimModelConfig()))
    proxy_url = await raw_server(build_proxy_app(model_url, capture_dir))
    first_arrived, release_first = asyncio.Event(), asyncio.Event()
    bodies: list[JsonObject] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        # An agent that follows the protocol: the model is called under the id it was given.
        body = await request.json(loads=orjson.loads)
        bodies.append(body)
        capture_id = body.get("_ng_capture_id") or rollout_id_for(body)
        if len(bodies) == 1:
            first_arrived.set()
            await release_first.wait()  # the dispatcher that sent this is killed meanwhile
        async with aiohttp.ClientSession() as session:
            await call_model(session, proxy_url, capture_id, dialect="chat", stream=False)
        return web.json_response({"reward": 1.0, "hop": len(bodies)})

    agent_url = await raw_server(app_with(handle))
    run = Run(tmp_path, tasks=1)
    args = run.args(agent_url, "--capture-dir", str(capture_dir))
    first = await spawn_cli(*args)
    await first_arrived.wait()
    assert (await first.kill()).returncode == -9

    async def late_call_then_answer() -> CliResult:
        second = await spawn_cli(*args)
        await wait_until(lambda: len(bodies) == 2)
        release_first.set()  # the killed hop's agent calls the model late
        return await second.wait()

    result = await late_call_then_answer()

    assert result.returncode == 0, result.stderr[-3000:]
    [row] = run.rows()
    # The killed hop's attempt had reserved index 0: the rerun is attempt 1 (§5).
    assert row["_ng_dispatch"]["rollout_id"] == "0-0-a1"
    assert row["ng_model_call_capture"]["rollout_id"] == "0-0-a1"
    assert row["ng_model_call_capture"]["metrics"]["num_calls"] == 1
    assert bodies[0]["_ng_capture_id"] != bodies[1]["_ng_capture_id"]


async def test_6_duplicate_rollout_ids_in_the_task_file_are_an_input_error(
    tmp_path: Path, fake_agent: AgentFactory
) -> None:
    agent = await fake_agent()
    run = Run(tmp_path, tasks=0)
    rows = [{"_ng_rollout_id": "a", "q": 1}, {"_ng_rollout_id": "b"}, {"_ng_rollout_id": "a"}]
    run.tasks.write_bytes(
        b"".join(orjson.dumps({"agent_ref": {"name": "sim"}, **r}) + b"\n" for r in rows)
    )

    result = await run_cli(*run.args(agent.url))

    assert result.returncode == 2, result.stderr[-3000:]
    line = one_error_line(result)
    assert f"{run.tasks}:3" in line and "line 1" in line
    assert agent.seen == 0 and not run.dir.exists()


# ---- 7: reserved keys --------------------------------------------------------------------


async def test_7_agent_results_cannot_forge_the_dispatchers_keys(
    tmp_path: Path, fake_agent: AgentFactory
) -> None:
    forged = {
        "reward": 1.0,
        "_ng_task_index": 99,
        "_ng_attempt_index": 7,
        "_ng_rollout_id": "someone-else",
        "_ng_failure_terminal": True,
        "_ng_dispatch": {"replica": "forged"},
        "ng_model_call_capture": {"calls": []},
    }
    agent = await fake_agent(lambda body: web.json_response(forged))
    run = Run(tmp_path, tasks=1)

    result = await run_cli(*run.args(agent.url))

    assert result.returncode == 0, result.stderr[-3000:]
    [row] = run.rows()
    assert row["reward"] == 1.0 and row["_ng_task_index"] == 0
    assert row["_ng_rollout_id"] == "0-0"
    for key in (
        "_ng_attempt_index",
        "_ng_failure_terminal",
        "ng_model_call_capture",
    ):
        assert key not in row, key
    assert row["_ng_dispatch"]["replica"] == agent.url
    dropped = sorted(set(forged) - {"reward"})
    assert row["_ng_dispatch"]["reserved_keys_dropped"] == dropped
    [event] = [e for e in log_events(result.stderr) if e["event"] == "agent_result_reserved_keys"]
    assert event["keys"] == dropped


async def test_7_an_agent_reported_failure_cannot_claim_it_was_never_delivered(
    tmp_path: Path, fake_agent: AgentFactory
) -> None:
    claim = {"_ng_failure_class": "tool_error", "_ng_failure_not_delivered": True}
    agent = await fake_agent(lambda body: web.json_response(claim))
    run = Run(tmp_path, tasks=1)

    result = await run_cli(*run.args(agent.url, "--max-attempts", "1"))

    assert result.returncode == 0, result.stderr[-3000:]  # the one attempt counted
    [failure] = run.failure_rows()
    assert failure["_ng_failure_class"] == "tool_error"
    assert "_ng_failure_not_delivered" not in failure
    assert failure["_ng_dispatch"]["reserved_keys_dropped"] == ["_ng_failure_not_delivered"]


@pytest.mark.parametrize(
    "key,value",
    [
        ("_ng_no_persist", True),
        ("_ng_failure_class", "x"),
        ("_ng_attempt_index", 2),
        ("_ng_failure_not_delivered", True),
    ],
)
async def test_7_task_rows_carrying_dispatcher_keys_are_an_input_error(
    tmp_path: Path, fake_agent: AgentFactory, key: str, value: Any
) -> None:
    agent = await fake_agent(lambda body: web.json_response(body))  # echoes the task back
    run = Run(tmp_path, tasks=0)
    write_tasks(run.tasks, 2, **{key: value})

    result = await run_cli(*run.args(agent.url))

    assert result.returncode == 2, result.stderr[-3000:]
    line = one_error_line(result)
    assert f"{run.tasks}:1" in line and key in line
    assert agent.seen == 0


# ---- 8: integers beyond 64 bits stay exact --------------------------------------------------


BIG = 2**70 + 1
HUGE_NEGATIVE = -(10**30) - 7


async def test_8_big_integers_in_task_rows_and_results_stay_exact(
    tmp_path: Path, raw_server: Callable[[web.Application], Awaitable[str]]
) -> None:
    seen: list[bytes] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        seen.append(raw)
        body = json.loads(raw)
        result = {"reward": 1.0, "echo": body["big"], "own": HUGE_NEGATIVE}
        return web.Response(body=json.dumps(result), content_type="application/json")

    url = await raw_server(app_with(handle))
    run = Run(tmp_path, tasks=0)
    run.tasks.write_text(json.dumps({"agent_ref": {"name": "sim"}, "big": BIG}) + "\n")

    result = await run_cli(*run.args(url))

    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(seen[0])["big"] == BIG
    [materialized] = [json.loads(line) for line in run.materialized.read_text().splitlines()]
    assert materialized["big"] == BIG
    [row] = [json.loads(line) for line in run.output.read_text().splitlines()]
    assert (row["echo"], row["own"]) == (BIG, HUGE_NEGATIVE)
    assert type(row["echo"]) is int


# ---- 9: answers too large or too slow ---------------------------------------------------------


async def test_9_an_answer_over_max_response_bytes_is_an_agent_run_error(
    tmp_path: Path, fake_agent: AgentFactory
) -> None:
    big = orjson.dumps({"reward": 1.0, "pad": "x" * 300_000})
    agent = await fake_agent(lambda body: web.Response(body=big, content_type="application/json"))
    run = Run(tmp_path, tasks=1)

    result = await run_cli(*run.args(agent.url, "--max-response-bytes", "100000"))

    assert result.returncode == 75, result.stderr[-3000:]
    [failure] = run.failure_rows()
    assert failure["_ng_failure_class"] == "agent_run_error"
    assert failure["_ng_failure_http_status"] == 200
    assert "100000" in failure["_ng_failure_message"]
    assert failure["_ng_failure_response_body"].startswith('{"reward":1.0,"pad":"xxx')


async def test_9_a_gzip_bomb_is_measured_decompressed(
    tmp_path: Path, fake_agent: AgentFactory
) -> None:
    bomb = gzip.compress(b'{"pad":"' + b"0" * 20_000_000 + b'"}')
    assert len(bomb) < 100_000

    def respond(body: JsonObject) -> web.StreamResponse:
        headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        return web.Response(body=bomb, headers=headers)

    agent = await fake_agent(respond)
    run = Run(tmp_path, tasks=1)

    result = await run_cli(*run.args(agent.url, "--max-response-bytes", "1000000"))

    assert result.returncode == 75, result.stderr[-3000:]
    [failure] = run.failure_rows()
    assert failure["_ng_failure_class"] == "agent_run_error"
    assert failure["_ng_failure_response_body"].startswith('{"pad":"000')


@pytest.mark.parametrize("pace", ["flood", "trickle"])
async def test_9_an_endless_chunked_body_ends_as_a_failure(
    tmp_path: Path, raw_server: Callable[[web.Application], Awaitable[str]], pace: str
) -> None:
    async def handle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        chunk = b" " * (65536 if pace == "flood" else 1)
        while True:  # never ends; the dispatcher hangs up
            await response.write(chunk)
            if pace == "trickle":
                await asyncio.sleep(0.01)

    url = await raw_server(app_with(handle))
    run = Run(tmp_path, tasks=1)
    limits = ("--max-response-bytes", "2000000", "--response-read-timeout-s", "1")

    result = await run_cli(*run.args(url, *limits), timeout_s=60)

    assert result.returncode == 75, result.stderr[-3000:]
    [failure] = run.failure_rows()
    assert failure["_ng_failure_class"] == "agent_run_error"
    expected = "2000000" if pace == "flood" else "1"
    assert expected in failure["_ng_failure_message"]


# ---- 10: the capture proxy's bounds ------------------------------------------------------


class Upstream:
    """A model server whose answers the test releases one at a time."""

    def __init__(self, answer: web.Response | None = None) -> None:
        self.answer = answer
        self.arrived = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.gates: asyncio.Queue[asyncio.Event] = asyncio.Queue()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/v1/chat/completions", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.arrived += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.answer is not None:
                return self.answer
            gate = asyncio.Event()
            await self.gates.put(gate)
            await gate.wait()
            return web.json_response({"choices": []})
        finally:
            self.in_flight -= 1


def call_url(proxy_url: str, rollout_id: str) -> str:
    return f"{proxy_url}/ng-rollout/{rollout_id}/v1/chat/completions"


async def test_10_a_request_over_max_request_bytes_is_refused_before_the_upstream(
    tmp_path: Path, raw_server: Callable[[web.Application], Awaitable[str]]
) -> None:
    upstream = Upstream(web.json_response({"choices": []}))
    model_url = await raw_server(upstream.app())
    limits = ProxyLimits(max_request_bytes=1_000_000)
    proxy_url = await raw_server(build_proxy_app(model_url, tmp_path / "c", limits=limits))

    async with aiohttp.ClientSession() as session:
        answer = await session.post(call_url(proxy_url, "r1"), data=io.BytesIO(b"x" * 2_000_000))

    assert answer.status == 413
    assert upstream.arrived == 0


async def test_10_a_gzip_bomb_from_the_upstream_is_relayed_but_never_inflated_into_memory(
    tmp_path: Path, raw_server: Callable[[web.Application], Awaitable[str]]
) -> None:
    bomb = gzip.compress(b'{"pad":"' + b"0" * 50_000_000 + b'"}')
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    model_url = await raw_server(Upstream(web.Response(body=bomb, headers=headers)).app())
    limits = ProxyLimits(max_record_bytes=1_000_000)
    capture_dir = tmp_path / "c"
    proxy_url = await raw_server(build_proxy_app(model_url, capture_dir, limits=limits))

    async with aiohttp.ClientSession(auto_decompress=False) as session:
        answer = await session.post(call_url(proxy_url, "r1"), json={"model": "m"})
        relayed = await answer.read()

    assert relayed == bomb
    capture = capture_dir / "r1.capture.jsonl"
    await wait_until(lambda: capture.exists() and capture.read_bytes().endswith(b"\n"))
    assert capture.stat().st_size < 100_000
    [record] = read_jsonl(capture)
    assert record["error_category"] == "proxy_error" and record["response"] is None


async def test_10_calls_beyond_max_concurrency_wait_for_a_slot(
    tmp_path: Path, raw_server: Callable[[web.Application], Awaitable[str]]
) -> None:
    upstream = Upstream()
    model_url = await raw_server(upstream.app())
    limits = ProxyLimits(max_concurrency=1)
    proxy_url = await raw_server(build_proxy_app(model_url, tmp_path / "c", limits=limits))

    async with aiohttp.ClientSession() as session:

        async def call(i: int) -> int:
            async with session.post(call_url(proxy_url, f"r{i}"), json={"model": "m"}) as r:
                await r.read()
                return r.status

        calls = [asyncio.create_task(call(i)) for i in range(3)]
        for _ in range(3):
            (await upstream.gates.get()).set()  # release each call as it reaches the model
        statuses = await asyncio.gather(*calls)

    assert statuses == [200, 200, 200]
    assert upstream.max_in_flight == 1


# ---- 11: redirects ---------------------------------------------------------------------------


@pytest.mark.parametrize("status", [302, 307])
async def test_11_a_redirect_is_not_followed_and_is_an_agent_run_error(
    tmp_path: Path, fake_agent: AgentFactory, status: int
) -> None:
    elsewhere = await fake_agent()

    def redirect(body: JsonObject) -> web.StreamResponse:
        return web.Response(status=status, headers={"Location": f"{elsewhere.url}/run"})

    agent = await fake_agent(redirect)
    run = Run(tmp_path, tasks=1)

    result = await run_cli(*run.args(agent.url))

    assert result.returncode == 75, result.stderr[-3000:]
    [failure] = run.failure_rows()
    assert (failure["_ng_failure_class"], failure["_ng_failure_http_status"]) == (
        "agent_run_error",
        status,
    )
    assert elsewhere.seen == 0 and run.rows() == []


@pytest.mark.parametrize(
    ("status", "says"),
    [
        (301, "agent answered HTTP 301 (redirects are not followed)"),
        (308, "agent answered HTTP 308 (redirects are not followed)"),
        (304, "agent answered HTTP 304 (Not Modified, to a request that asked for no such check)"),
        (300, "agent answered HTTP 300"),
    ],
)
def test_11_a_3xx_failure_says_what_its_status_means(status: int, says: str) -> None:
    # A 304 is no redirect: it answers a conditional request, and ours never is one.
    _, _, failure = classify_response(status, b"")
    assert failure is not None and failure.message == says


# ---- 12: credentials in replica URLs ---------------------------------------------------------


async def test_12_replica_credentials_never_show(tmp_path: Path, fake_agent: AgentFactory) -> None:
    agent = await fake_agent(gated=True)
    secret_url = agent.url.replace("http://", "http://alice:s3cret@")
    run = Run(tmp_path, tasks=2)
    args = run_args(run.tasks, run.output, secret_url, "--metrics-listen", "127.0.0.1:0")
    proc = await spawn_cli(*args)
    await wait_until(lambda: agent.seen == 2 and proc.saw("metrics_listening"))
    [listening] = [e for e in proc.events() if e["event"] == "metrics_listening"]
    base = listening["url"].removesuffix("/metrics")
    async with aiohttp.ClientSession() as session:
        shown = [await (await session.get(f"{base}{p}")).text() for p in ("/status", "/metrics")]
    agent.open()

    result = await proc.wait()

    assert result.returncode == 0, result.stderr[-3000:]
    for text in (
        *shown,
        result.stderr,
        run.output.read_text(),
        run.dir.joinpath("x_manifest.json").read_text(),
    ):
        assert "s3cret" not in text
    assert "alice:***@127.0.0.1" in shown[0]
    assert {r["_ng_dispatch"]["replica"] for r in run.rows()} == {
        agent.url.replace("http://", "http://alice:***@")
    }


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://user:s3cret@h:1", "http://user:***@h:1"),
        ("http://s3cret@h:1/base", "http://***@h:1/base"),
        ("http://user:s3/cr?e#t@h:1", "http://user:***@h:1"),
        ("http://user:s3cret@h:99999", "http://user:***@h:99999"),
        ("=http://user:s3cret@h", "=http://user:***@h"),
        ("user:s3cret@h:1", "user:***@h:1"),
        ("http://h:1", "http://h:1"),
    ],
)
def test_12_a_url_that_does_not_parse_is_redacted_too(url: str, shown: str) -> None:
    assert redact_url(url) == shown


async def test_12_replicas_that_differ_only_in_credentials_stay_two(
    tmp_path: Path, fake_agent: AgentFactory
) -> None:
    agent = await fake_agent()
    one = agent.url.replace("http://", "http://alice:s3cret@")
    two = agent.url.replace("http://", "http://alice:0ther@")
    run = Run(tmp_path, tasks=8)
    args = run_args(run.tasks, run.output, f"{one},{two}", "--metrics-listen", "127.0.0.1:0")
    proc = await spawn_cli(*args, "--concurrency", "1")

    result = await proc.wait()

    assert result.returncode == 0, result.stderr[-3000:]
    shown = agent.url.replace("http://", "http://alice:***@")
    # Round-robin over two replicas: both carry rows, under two names.
    assert {r["_ng_dispatch"]["replica"] for r in run.rows()} == {shown, f"{shown}#2"}
    for text in (result.stderr, run.output.read_text()):
        assert "s3cret" not in text and "0ther" not in text


# ---- 13: malformed agent URLs -----------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["http://", "http://127.0.0.1:99999", "http://bad host:80", "http://h:80/x?q=1", "ftp://h"],
)
async def test_13_a_malformed_agent_url_exits_2_at_start(tmp_path: Path, url: str) -> None:
    run = Run(tmp_path, tasks=1)

    result = await run_cli(*run.args(url))

    assert result.returncode == 2, result.stderr[-3000:]
    assert "--agent" in one_error_line(result)
    assert not run.dir.exists()


async def test_13_a_colon_in_the_user_name_is_exit_2_at_start_never_exit_1_at_the_end(
    tmp_path: Path, fake_agent: AgentFactory
) -> None:
    # RFC 3986 lets a URL's user name carry ":" (as %3A), but Basic auth cannot
    # send one (RFC 7617: the first ":" ends the user-id): the agent would see
    # another user. A configuration error, said before anything runs.
    agent = await fake_agent()
    url = agent.url.replace("http://", "http://us%3Aer:pw@")
    run = Run(tmp_path, tasks=2)

    result = await run_cli(*run.args(url))

    assert result.returncode == 2, result.stderr[-3000:]
    line = one_error_line(result)
    assert "--agent" in line and "%3A" in line and "pw" not in line
    assert agent.seen == 0 and not run.dir.exists()


# ---- 14: --num-repeats is bounded, and repeats are streamed -----------------------------------


@pytest.mark.parametrize("repeats", ["1e12", "1000000000", '{"_default": 99999999}'])
async def test_14_num_repeats_beyond_the_bound_exits_2(tmp_path: Path, repeats: str) -> None:
    run = Run(tmp_path, tasks=1)

    result = await run_cli(*run.args("http://127.0.0.1:9", "--num-repeats", repeats))

    assert result.returncode == 2, result.stderr[-3000:]
    assert "num_repeats" in one_error_line(result)
    assert not run.dir.exists()


def test_14_repeats_are_streamed_not_built_in_memory(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "tasks.jsonl", 1)
    spec = MaterializeSpec(
        input_path=tasks,
        agents=frozenset({"sim"}),
        default_agent=None,
        num_repeats=200_000,
        limit=None,
        overrides={},
        skip_invalid_rows=False,
    )
    tracemalloc.start()
    try:
        result = materialize(spec, tmp_path / "m.jsonl")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.rollouts == 200_000
    assert peak < 16 * 1024 * 1024, f"peak {peak / 1e6:.1f} MB"


# ---- 15: special files and special numbers -----------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
async def test_15_a_fifo_or_device_as_input_exits_2_without_hanging(
    tmp_path: Path, kind: str
) -> None:
    run = Run(tmp_path, tasks=0)
    if kind == "fifo":
        os.mkfifo(run.tasks)
    else:
        run.tasks = Path("/dev/zero")

    result = await run_cli(*run.args("http://127.0.0.1:9"), timeout_s=30)

    assert result.returncode == 2, result.stderr[-3000:]
    assert "not a regular file" in one_error_line(result)
    assert not run.dir.exists()


async def test_15_dev_full_as_output_exits_2_and_writes_nothing_beside_it(tmp_path: Path) -> None:
    run = Run(tmp_path, tasks=1)
    before = set(os.listdir("/dev"))

    result = await run_cli(
        *run_args(run.tasks, Path("/dev/full"), "http://127.0.0.1:9"), timeout_s=30
    )

    assert result.returncode == 2, result.stderr[-3000:]
    assert "not a regular file" in one_error_line(result)
    assert set(os.listdir("/dev")) == before


@pytest.mark.parametrize(
    "flag,value", [("--dispatch-budget-s", "nan"), ("--rollout-timeout-s", "inf")]
)
async def test_15_nan_and_inf_settings_exit_2(tmp_path: Path, flag: str, value: str) -> None:
    run = Run(tmp_path, tasks=1)

    result = await run_cli(*run.args("http://127.0.0.1:9", flag, value))

    assert result.returncode == 2, result.stderr[-3000:]
    assert flag in one_error_line(result)


async def test_15_a_directory_as_config_exits_2_with_one_line(tmp_path: Path) -> None:
    run = Run(tmp_path, tasks=1)

    result = await run_cli(*run.args("http://127.0.0.1:9", "--config", str(tmp_path)))

    assert result.returncode == 2, result.stderr[-3000:]
    assert str(tmp_path) in one_error_line(result)


# ---- 16: empty input ---------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["empty", "blank_lines", "dev_null"])
async def test_16_empty_input_exits_2_unless_allowed(tmp_path: Path, content: str) -> None:
    run = Run(tmp_path, tasks=0)
    if content == "dev_null":
        run.tasks = Path("/dev/null")
    else:
        run.tasks.write_text("" if content == "empty" else "\n  \n\n")

    refused = await run_cli(*run.args("http://127.0.0.1:9"))

    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"no tasks in {run.tasks}" in one_error_line(refused)
    assert not run.dir.exists()

    allowed = await run_cli(*run.args("http://127.0.0.1:9", "--allow-empty"))

    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert run.rows() == []
