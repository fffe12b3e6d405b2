"""Model-call capture end to end over real sockets (contracts §2, §6, §7).

The real ``dispatcher run`` CLI (a subprocess) → agent (in-process) → capture
proxy (in-process, ``build_proxy_app``) → simulated model (in-process). Writes
the test wants late are held in the proxy's ``before_write`` hook on events the
test opens only after it has seen the state it needs; nothing is timed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from dispatcher.capture.proxy import build_proxy_app
from dispatcher.capture.records import Exchange, encode_record
from dispatcher.capture.store import (
    BeforeWrite,
    append_line,
    capture_path,
    claims_path,
    incomplete_path,
)
from dispatcher.sim.model import STATS_KEY, SimModelConfig, SimModelStats, build_sim_model_app
from dispatcher.sim.model_client import ModelCallError, call_model, request_body
from tests.conftest import SimAgentFactory
from tests.helpers import (
    CliProcess,
    CliResult,
    FakeAgent,
    log_events,
    read_jsonl,
    run_args,
    run_cli,
    serve,
    spawn_cli,
    wait_until,
    write_tasks,
)

MODEL = SimModelConfig(completion_tokens=9, reasoning_tokens=3, cached_tokens=5, tool_calls=1)
PROMPT = "Solve the task."  # what the sim agent and ``call_model`` send by default
SECRET = "secret-e2e-7c1f0a9d2b"
PERF_KEYS = {
    "num_turns",
    "num_tool_calls",
    "token_observability_coverage",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "total_latency_ms",
}
TRAJECTORY_KEYS = {
    "schema_version",
    "task_id",
    "rollout_id",
    "invocations",
    "turns",
    "model_calls",
    "tool_calls",
    "gaps",
}
JsonObject = dict[str, Any]
AsyncResponder = Callable[[JsonObject], Awaitable[web.StreamResponse]]


class Stack:
    """One run's files plus the proxy and sim model it talks through.

    ``gate()`` events and agents are opened and stopped at teardown, before the
    proxy, whose shutdown waits for every write still held.
    """

    def __init__(self, tmp_path: Path) -> None:
        self.capture_dir = tmp_path / "captures"
        self.tasks = tmp_path / "tasks.jsonl"
        self.output = tmp_path / "out" / "x.jsonl"
        self.failures = self.output.with_name("x_failures.jsonl")
        self.proxy_url = ""
        self.model = SimModelStats()
        self.session: aiohttp.ClientSession | None = None
        self._gates: list[asyncio.Event] = []
        self._agents: list[FakeAgent] = []
        self._runners: list[web.AppRunner] = []

    async def start(
        self, model: SimModelConfig = MODEL, before_write: BeforeWrite | None = None
    ) -> None:
        model_app = build_sim_model_app(model)
        self.model = model_app[STATS_KEY]
        runner, model_url = await serve(model_app)
        self._runners.append(runner)
        proxy = build_proxy_app(model_url, self.capture_dir, before_write=before_write)
        runner, self.proxy_url = await serve(proxy)
        self._runners.append(runner)
        self.session = aiohttp.ClientSession()

    def gate(self) -> asyncio.Event:
        event = asyncio.Event()
        self._gates.append(event)
        return event

    async def agent(self, respond: AsyncResponder) -> str:
        """A scripted agent server (``FakeAgent``) answering with ``respond``."""
        agent = FakeAgent(respond)
        self._agents.append(agent)
        return await agent.start()

    def args(self, agent_url: str, *extra: str) -> list[str]:
        capture = ("--capture-dir", str(self.capture_dir), "--fsync", "never")
        return run_args(self.tasks, self.output, agent_url, *capture, *extra)

    def rows(self) -> list[JsonObject]:
        return read_jsonl(self.output)

    def failure_rows(self) -> list[JsonObject]:
        return read_jsonl(self.failures)

    def capture_lines(self, rollout_id: str) -> list[bytes]:
        return capture_path(self.capture_dir, rollout_id).read_bytes().splitlines()

    def capture_files(self) -> list[str]:
        return sorted(p.name for p in self.capture_dir.glob("*.capture.*"))

    async def close(self) -> None:
        for gate in self._gates:
            gate.set()
        for agent in self._agents:
            await agent.close()
        if self.session is not None:
            await self.session.close()
        for runner in reversed(self._runners):
            await runner.cleanup()


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    harness = Stack(tmp_path)
    yield harness
    await harness.close()


# ---- what the model reported ------------------------------------------------------------


def reported_tokens(config: SimModelConfig, dialect: str, stream: bool) -> JsonObject:
    """One call's tokens as rows name them, from the sim model's documented rules.

    The prompt is one token per four bytes of the conversation; the other counts
    are the config's. Anthropic (messages) reports cached tokens beside
    ``input_tokens`` and no reasoning count, and total is prompt + completion.
    """
    body = request_body(dialect, stream=stream, prompt=PROMPT, model=config.model)
    prompt = max(1, len(orjson.dumps(body.get("messages") or body["input"])) // 4)
    completion = config.completion_tokens
    return {
        "tokens_in": prompt,
        "tokens_out": completion,
        "tokens_reasoning": None if dialect == "messages" else config.reasoning_tokens,
        "tokens_total": prompt + completion,
        "cached_tokens": min(config.cached_tokens, prompt),
    }


def raw_usage_as_tokens(dialect: str, usage: JsonObject) -> JsonObject:
    """The usage object the proxy wrote for one call, read with the dialect's own names."""
    if dialect == "chat":
        return {
            "tokens_in": usage["prompt_tokens"],
            "tokens_out": usage["completion_tokens"],
            "tokens_reasoning": usage["completion_tokens_details"]["reasoning_tokens"],
            "tokens_total": usage["total_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        }
    if dialect == "responses":
        return {
            "tokens_in": usage["input_tokens"],
            "tokens_out": usage["output_tokens"],
            "tokens_reasoning": usage["output_tokens_details"]["reasoning_tokens"],
            "tokens_total": usage["total_tokens"],
            "cached_tokens": usage["input_tokens_details"]["cached_tokens"],
        }
    prompt = (
        usage["input_tokens"]
        + usage["cache_read_input_tokens"]
        + usage["cache_creation_input_tokens"]
    )
    return {
        "tokens_in": prompt,
        "tokens_out": usage["output_tokens"],
        "tokens_reasoning": None,
        "tokens_total": prompt + usage["output_tokens"],
        "cached_tokens": usage["cache_read_input_tokens"],
    }


def times(per_call: JsonObject, k: int) -> JsonObject:
    return {key: None if value is None else value * k for key, value in per_call.items()}


# ---- row checks ---------------------------------------------------------------------------


def rollout_id_of(row: JsonObject) -> str:
    base = row.get("_ng_rollout_id") or f"{row['_ng_task_index']}-{row['_ng_rollout_index']}"
    attempt = row.get("_ng_attempt_index", 0)
    return f"{base}-a{attempt}" if attempt else base


def gap_codes(section: JsonObject) -> list[str]:
    return [g["code"] for g in section.get("gaps", [])]


def assert_capture(row: JsonObject, k: int, *, gaps: tuple[str, ...] = ()) -> JsonObject:
    """The row's ``ng_model_call_capture`` names this rollout and holds exactly k calls."""
    capture: JsonObject = row["ng_model_call_capture"]
    assert capture["rollout_id"] == rollout_id_of(row)
    assert capture["metrics"]["num_calls"] == k
    assert len(capture["calls"]) == k
    assert len({c["model_call_id"] for c in capture["calls"]}) == k
    assert gap_codes(capture) == list(gaps)
    return capture


def assert_trajectory(row: JsonObject) -> JsonObject:
    trajectory: JsonObject = row["ng_trajectory"]
    assert set(trajectory) >= TRAJECTORY_KEYS
    assert trajectory["schema_version"] == "1.0"
    # Gym's TrajectoryRecord: string ids; the row's index stands for its task.
    assert trajectory["task_id"] == str(row["_ng_task_index"])
    assert trajectory["rollout_id"] == rollout_id_of(row)
    return trajectory


def finished_events(result: CliResult) -> dict[str, JsonObject]:
    events = log_events(result.stderr)
    return {e["rollout_id"]: e for e in events if e["event"] == "rollout_finished"}


def files_holding(directory: Path, needle: bytes) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file() and needle in p.read_bytes()]


def sim_agent_config(stack: Stack, k: int, **config: Any) -> JsonObject:
    return {"model_url": stack.proxy_url, "model_calls": k, **config}


# ---- every row gets its calls ---------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
async def test_each_row_has_exactly_its_calls_and_the_models_token_counts(
    stack: Stack, sim_agent: SimAgentFactory, dialect: str, stream: bool
) -> None:
    k = 3
    await stack.start()
    url, _ = await sim_agent(
        **sim_agent_config(stack, k, model_dialect=dialect, model_stream=stream)
    )
    write_tasks(stack.tasks, 2)

    result = await run_cli(*stack.args(url, "--num-repeats", "2", "--concurrency", "4"))

    assert result.returncode == 0, result.stderr[-3000:]
    rows = stack.rows()
    assert sorted(rollout_id_of(r) for r in rows) == ["0-0", "0-1", "1-0", "1-1"]
    assert stack.model.requests == 4 * k
    assert stack.model.streamed == (4 * k if stream else 0)
    assert stack.model.by_dialect == {dialect: 4 * k}
    per_call = reported_tokens(MODEL, dialect, stream)
    events = finished_events(result)
    for row in rows:
        rollout_id = rollout_id_of(row)
        capture = assert_capture(row, k)
        for line in stack.capture_lines(rollout_id):
            record = orjson.loads(line)
            assert (record["dialect"], record["stream"]) == (dialect, stream)
            assert raw_usage_as_tokens(dialect, record["response"]["usage"]) == per_call
        for call in capture["calls"]:
            assert {key: call[key] for key in per_call} == per_call
            assert (call["dialect"], call["status_code"], call["error_category"]) == (
                dialect,
                200,
                None,
            )
            assert call["num_tool_calls"] == MODEL.tool_calls
            assert (call["latency_ttft_ms"] is not None) is stream
            assert "request" not in call and "response" not in call
        metrics = capture["metrics"]
        assert {key: metrics[key] for key in per_call} == times(per_call, k)
        latencies = sum(c["latency_ms"] for c in capture["calls"])
        assert metrics["latency_total_ms"] == pytest.approx(latencies, abs=0.01)
        assert_built_trajectory(row, capture, k)
        assert_perf(row, per_call, k)
        assert events[rollout_id]["capture"]["calls"] == k
        # The agent's result is never changed by the attachment.
        assert row["model_calls_made"] == k and row["reward"] in (0.0, 1.0)


def assert_built_trajectory(row: JsonObject, capture: JsonObject, k: int) -> None:
    trajectory = assert_trajectory(row)
    call_ids = [c["model_call_id"] for c in capture["calls"]]
    [invocation] = trajectory["invocations"]
    assert invocation["status"] == "completed"
    assert [ref["model_call_id"] for ref in invocation["model_calls"]] == call_ids
    assert [t["model_calls"] for t in trajectory["turns"]] == [
        [{"model_call_id": i, "model_ref": None, "response_id": None}] for i in call_ids
    ]
    assert all(t["answer"] for t in trajectory["turns"])
    assert [c["model_call_id"] for c in trajectory["model_calls"]] == call_ids
    assert len(trajectory["tool_calls"]) == k * MODEL.tool_calls
    # A trajectory built from captures has no conversation to show, as in Gym.
    assert gap_codes(trajectory) == ["conversation_unavailable"]


def assert_perf(row: JsonObject, per_call: JsonObject, k: int) -> None:
    perf = row["ng_perf"]
    reasoning = per_call["tokens_reasoning"] is not None
    assert set(perf) == PERF_KEYS | ({"reasoning_tokens"} if reasoning else set())
    assert perf["num_turns"] == k
    assert perf["num_tool_calls"] == k * MODEL.tool_calls
    assert perf["token_observability_coverage"] == 1.0
    assert perf["prompt_tokens"] == k * per_call["tokens_in"]
    assert perf["cached_prompt_tokens"] == k * per_call["cached_tokens"]
    assert perf["completion_tokens"] == k * per_call["tokens_out"]
    if reasoning:
        assert perf["reasoning_tokens"] == k * per_call["tokens_reasoning"]
    # The dispatcher's own wall time for the rollout.
    assert perf["total_latency_ms"] == pytest.approx(
        row["_ng_dispatch"]["duration_s"] * 1000.0, abs=0.01
    )


async def test_many_rollouts_at_once_never_mix_their_calls(
    stack: Stack, sim_agent: SimAgentFactory
) -> None:
    k, tasks, repeats = 4, 10, 4
    await stack.start()
    url, _ = await sim_agent(**sim_agent_config(stack, k, model_stream=True))
    write_tasks(stack.tasks, tasks)

    result = await run_cli(*stack.args(url, "--num-repeats", str(repeats), "--concurrency", "40"))

    assert result.returncode == 0, result.stderr[-3000:]
    rows = stack.rows()
    assert len(rows) == tasks * repeats
    for row in rows:
        assert_capture(row, k)
        for line in stack.capture_lines(rollout_id_of(row)):
            assert orjson.loads(line)["rollout_id"] == rollout_id_of(row)
    all_ids = [c["model_call_id"] for r in rows for c in r["ng_model_call_capture"]["calls"]]
    assert len(set(all_ids)) == stack.model.requests == tasks * repeats * k


async def test_a_rerun_after_a_kill_keeps_only_the_new_attempts_calls(stack: Stack) -> None:
    """A rollout killed mid-run has no row and runs again under the same id: the
    captures of the killed attempt must not be merged into the new row."""
    k = 2
    await stack.start()
    killed = stack.gate()
    hops: list[int] = []

    async def respond(body: JsonObject) -> web.StreamResponse:
        assert stack.session is not None
        hops.append(len(hops))
        for _ in range(k):
            await call_model(
                stack.session, stack.proxy_url, rollout_id_of(body), dialect="chat", stream=False
            )
        if len(hops) == 1:
            await killed.wait()  # the first dispatcher dies while this rollout is in flight
        return web.json_response({"reward": 1.0, "hop": len(hops)})

    url = await stack.agent(respond)
    write_tasks(stack.tasks, 1)
    first = await spawn_cli(*stack.args(url))
    await wait_until(
        lambda: (
            capture_path(stack.capture_dir, "0-0").exists() and len(stack.capture_lines("0-0")) == k
        )
    )
    killed_calls = {orjson.loads(line)["model_call_id"] for line in stack.capture_lines("0-0")}
    assert (await first.kill()).returncode == -9

    second = await run_cli(*stack.args(url))

    assert second.returncode == 0, second.stderr[-3000:]
    [row] = stack.rows()
    # The killed hop's attempt had reserved index 0: the rerun is attempt 1 (§5).
    assert (row["hop"], row["_ng_dispatch"]["rollout_id"]) == (2, "0-0-a1")
    calls = assert_capture(row, k)["calls"]
    assert not killed_calls & {c["model_call_id"] for c in calls}
    assert stack.model.requests == 2 * k


async def test_the_agents_own_trajectory_is_used(stack: Stack, sim_agent: SimAgentFactory) -> None:
    k = 2
    await stack.start()
    config = sim_agent_config(
        stack, k, model_dialect="responses", model_stream=True, agent_trajectory=True
    )
    url, _ = await sim_agent(**config)
    write_tasks(stack.tasks, 2)

    result = await run_cli(*stack.args(url))

    assert result.returncode == 0, result.stderr[-3000:]
    rows = stack.rows()
    assert len(rows) == 2
    for row in rows:
        capture = assert_capture(row, k)
        trajectory = assert_trajectory(row)
        # The agent's refs are (model_ref, response_id), which a built trajectory never uses.
        response_ids = [c["response_id"] for c in capture["calls"]]
        server = {"type": "responses_api_models", "name": "sim-model"}
        refs = [
            {"model_call_id": None, "model_ref": server, "response_id": r} for r in response_ids
        ]
        [invocation] = trajectory["invocations"]
        assert (invocation["invocation_id"], invocation["status"]) == ("agent", "completed")
        assert invocation["model_calls"] == refs
        assert [t["turn_no"] for t in trajectory["turns"]] == [1, 2]
        assert [c["model_call_id"] for c in trajectory["model_calls"]] == [
            c["model_call_id"] for c in capture["calls"]
        ]
        assert gap_codes(trajectory) == ["conversation_unavailable"]
        perf = row["ng_perf"]
        assert (perf["num_turns"], perf["token_observability_coverage"]) == (k, 1.0)
        assert perf["completion_tokens"] == k * MODEL.completion_tokens


# ---- writes that land late ------------------------------------------------------------------


async def test_a_write_still_held_when_the_agent_answers_is_waited_for(
    stack: Stack, sim_agent: SimAgentFactory
) -> None:
    k = 2
    gate = stack.gate()

    async def hold(rollout_id: str) -> None:
        if rollout_id == "0-0":
            await gate.wait()

    await stack.start(before_write=hold)
    url, agent = await sim_agent(**sim_agent_config(stack, k))
    write_tasks(stack.tasks, 1)
    run = await spawn_cli(*stack.args(url, "--num-repeats", "2", "--metrics-listen", "127.0.0.1:0"))
    try:
        status_url = await metrics_url(run) + "/status"
        await wait_until(lambda: agent.requests == 2 and agent.in_flight == 0)
        # Waiting is per rollout: 0-1's row is written while 0-0's writes are held.
        await wait_until(lambda: [rollout_id_of(r) for r in stack.rows()] == ["0-1"])
        # The dispatcher holds 0-0's answer and its commit waits for the writes.
        await wait_until(lambda: committing(stack, status_url))
        assert len(list(claims_path(stack.capture_dir, "0-0").iterdir())) == k
        assert not capture_path(stack.capture_dir, "0-0").exists()
        gate.set()
        result = await run.wait()
    finally:
        await run.kill()

    assert result.returncode == 0, result.stderr[-3000:]
    rows = {rollout_id_of(r): r for r in stack.rows()}
    assert list(rows) == ["0-1", "0-0"]
    for row in rows.values():
        assert_capture(row, k)
    assert finished_events(result)["0-0"]["capture"]["wait_s"] > 0


async def metrics_url(run: CliProcess) -> str:
    await wait_until(lambda: run.saw("metrics_listening") or run.exited)
    [event] = [e for e in run.events() if e["event"] == "metrics_listening"]
    return str(event["url"]).removesuffix("/metrics")


async def committing(stack: Stack, status_url: str) -> bool:
    assert stack.session is not None
    async with stack.session.get(status_url) as answer:
        status = await answer.json()
    return bool(status["progress"]["committing"] == 1)


async def test_a_write_held_past_the_wait_limit_is_a_pending_gap(
    stack: Stack, sim_agent: SimAgentFactory
) -> None:
    k = 2
    gate = stack.gate()

    async def hold(rollout_id: str) -> None:
        await gate.wait()

    await stack.start(before_write=hold)
    url, _ = await sim_agent(**sim_agent_config(stack, k))
    write_tasks(stack.tasks, 1)

    result = await run_cli(*stack.args(url, "--capture-wait-limit-s", "0.5"))

    assert result.returncode == 0, result.stderr[-3000:]
    [row] = stack.rows()
    capture = assert_capture(
        row, 0, gaps=("model_call_capture_pending", "model_call_capture_no_records")
    )
    assert capture["metrics"]["tokens_in"] is None
    assert "model_call_capture_pending" in gap_codes(row["ng_trajectory"])
    assert "ng_perf" not in row  # no invocation could be built
    assert finished_events(result)["0-0"]["capture"]["wait_s"] >= 0.5
    # The held writes were not lost: they land once let go.
    gate.set()
    await wait_until(lambda: capture_path(stack.capture_dir, "0-0").exists())
    await wait_until(lambda: len(stack.capture_lines("0-0")) == k)


async def test_one_damaged_line_costs_only_itself(stack: Stack, sim_agent: SimAgentFactory) -> None:
    k = 3
    damaged = "0-1"
    torn: list[str] = []

    async def tear_one_line(rollout_id: str) -> None:
        if rollout_id == damaged and not torn:
            torn.append(rollout_id)
            # A torn record, as a crashed writer on another host could leave it.
            path = capture_path(stack.capture_dir, rollout_id)
            await asyncio.to_thread(append_line, path, b'{"model_call_id": "torn", "dia\n')

    await stack.start(before_write=tear_one_line)
    url, _ = await sim_agent(**sim_agent_config(stack, k, model_dialect="messages"))
    write_tasks(stack.tasks, 1)

    result = await run_cli(*stack.args(url, "--num-repeats", "2"))

    assert result.returncode == 0, result.stderr[-3000:]
    rows = {rollout_id_of(r): r for r in stack.rows()}
    assert len(stack.capture_lines(damaged)) == k + 1
    capture = assert_capture(rows[damaged], k, gaps=("model_call_capture_records_unreadable",))
    assert capture["gaps"][0]["detail"] == "count=1"
    per_call = reported_tokens(MODEL, "messages", False)
    assert capture["metrics"]["tokens_out"] == k * per_call["tokens_out"]
    assert rows[damaged]["ng_perf"]["num_turns"] == k
    assert_capture(rows["0-0"], k)


# ---- which captures belong to which row ------------------------------------------------------


def model_then(
    stack: Stack, calls_by_attempt: dict[int, int], status_by_attempt: dict[int, int]
) -> AsyncResponder:
    """An agent that makes its model calls through the proxy, then answers with a status."""

    async def respond(body: JsonObject) -> web.StreamResponse:
        assert stack.session is not None
        attempt = body.get("_ng_attempt_index", 0)
        rollout_id = rollout_id_of(body)
        for _ in range(calls_by_attempt[attempt]):
            await call_model(
                stack.session, stack.proxy_url, rollout_id, dialect="chat", stream=False
            )
        status = status_by_attempt[attempt]
        if status != 200:
            return web.Response(status=status, text="overloaded after the model calls")
        return web.json_response({"reward": 1.0, "attempt_seen": attempt})

    return respond


async def test_a_retried_attempt_gets_its_own_capture(stack: Stack) -> None:
    await stack.start()
    url = await stack.agent(model_then(stack, {0: 2, 1: 3}, {0: 500, 1: 200}))
    write_tasks(stack.tasks, 1)

    first = await run_cli(*stack.args(url))

    assert first.returncode == 75, first.stderr[-3000:]
    assert stack.rows() == []
    [failure] = stack.failure_rows()
    assert failure["_ng_failure_class"] == "agent_run_error"
    assert failure["_ng_failure_http_status"] == 500
    first_calls = assert_capture(failure, 2)["calls"]
    assert failure["ng_trajectory"]["invocations"][0]["status"] == "failed"

    second = await run_cli(*stack.args(url))

    assert second.returncode == 0, second.stderr[-3000:]
    [row] = stack.rows()
    assert (row["_ng_attempt_index"], row["attempt_seen"]) == (1, 1)
    assert row["_ng_dispatch"]["rollout_id"] == "0-0-a1"
    retried_calls = assert_capture(row, 3)["calls"]
    assert not {c["model_call_id"] for c in first_calls} & {
        c["model_call_id"] for c in retried_calls
    }
    assert row["ng_trajectory"]["rollout_id"] == "0-0-a1"
    assert stack.capture_files() == ["0-0-a1.capture.jsonl", "0-0.capture.jsonl"]
    # The first attempt's capture is not about to run again, so it stays as it was.
    assert len(stack.capture_lines("0-0")) == 2
    assert len(stack.capture_lines("0-0-a1")) == 3


async def test_stale_captures_of_the_ids_about_to_run_are_removed(
    stack: Stack, sim_agent: SimAgentFactory
) -> None:
    k = 2
    await stack.start()
    url, _ = await sim_agent(**sim_agent_config(stack, k))
    write_tasks(stack.tasks, 1)
    stack.capture_dir.mkdir(exist_ok=True)  # the proxy made it already
    stale = Exchange("0-0", "chat", "/v1/chat/completions", model_call_id="stale-call")
    append_line(capture_path(stack.capture_dir, "0-0"), encode_record(stale))
    append_line(incomplete_path(stack.capture_dir, "0-0"), b"")
    # A claim left by a proxy killed mid-write would otherwise keep the row pending.
    claims_path(stack.capture_dir, "0-0").mkdir(parents=True)
    (claims_path(stack.capture_dir, "0-0") / "dead-host.1.0.claim").touch()
    other = capture_path(stack.capture_dir, "7-0")
    append_line(other, encode_record(dataclasses.replace(stale, rollout_id="7-0")))

    result = await run_cli(*stack.args(url, "--capture-wait-limit-s", "5"))

    assert result.returncode == 0, result.stderr[-3000:]
    [row] = stack.rows()
    capture = assert_capture(row, k)
    assert "stale-call" not in {c["model_call_id"] for c in capture["calls"]}
    assert len(stack.capture_lines("0-0")) == k
    assert not incomplete_path(stack.capture_dir, "0-0").exists()
    # Only the ids about to run are touched.
    assert len(stack.capture_lines("7-0")) == 1


def write_rows(path: Path, rows: list[JsonObject]) -> None:
    path.write_bytes(
        b"".join(orjson.dumps({"agent_ref": {"name": "sim"}, **r}) + b"\n" for r in rows)
    )


async def test_a_rows_own_rollout_id_keys_its_capture(
    stack: Stack, sim_agent: SimAgentFactory
) -> None:
    k = 2
    await stack.start()
    url, _ = await sim_agent(**sim_agent_config(stack, k))
    own_ids = ["alpha.1", "Beta_2-x"]
    write_rows(stack.tasks, [{"_ng_rollout_id": i} for i in own_ids])

    result = await run_cli(*stack.args(url))

    assert result.returncode == 0, result.stderr[-3000:]
    rows = stack.rows()
    assert sorted(r["_ng_rollout_id"] for r in rows) == sorted(own_ids)
    for row in rows:
        assert_capture(row, k)
        assert assert_trajectory(row)["rollout_id"] == row["_ng_rollout_id"]
    assert stack.capture_files() == sorted(f"{i}.capture.jsonl" for i in own_ids)


async def test_an_own_rollout_id_too_long_for_a_capture_file_is_refused_up_front(
    stack: Stack, sim_agent: SimAgentFactory
) -> None:
    await stack.start()
    url, agent = await sim_agent(**sim_agent_config(stack, 1))
    write_rows(stack.tasks, [{"_ng_rollout_id": "r" * 250}])

    result = await run_cli(*stack.args(url))

    assert result.returncode == 2, result.stderr[-3000:]
    assert "tasks.jsonl:1: _ng_rollout_id" in result.stderr
    assert (agent.requests, stack.model.requests, stack.rows()) == (0, 0, [])


async def test_a_failure_row_shows_the_model_call_that_failed(
    stack: Stack, sim_agent: SimAgentFactory
) -> None:
    await stack.start(dataclasses.replace(MODEL, error_rate=1.0, error_status=429))
    url, _ = await sim_agent(**sim_agent_config(stack, 2))
    write_tasks(stack.tasks, 1)

    result = await run_cli(*stack.args(url, "--max-attempts", "1"))

    # Its one rollout failed for good, as agent_run_error: not done (exit 1).
    assert result.returncode == 1, result.stderr[-3000:]
    assert stack.rows() == []
    [failure] = stack.failure_rows()
    # The sim agent gives up at the first failed model call and answers 500.
    assert failure["_ng_failure_class"] == "agent_run_error"
    [call] = assert_capture(failure, 1)["calls"]
    assert (call["status_code"], call["error_category"]) == (429, "upstream_http_error")
    assert call["tokens_in"] is None
    trajectory = assert_trajectory(failure)
    assert trajectory["invocations"][0]["status"] == "failed"
    assert trajectory["turns"] == []
    perf = failure["ng_perf"]
    assert (perf["num_turns"], perf["token_observability_coverage"]) == (1, 1.0)
    assert "prompt_tokens" not in perf


async def test_drained_rollouts_get_no_capture_and_no_row(
    stack: Stack, sim_agent: SimAgentFactory
) -> None:
    await stack.start()
    url, agent = await sim_agent(**sim_agent_config(stack, 2))
    write_tasks(stack.tasks, 3)

    result = await run_cli(*stack.args(url, "--dispatch-budget-s", "0", "--concurrency", "2"))

    assert result.returncode == 75, result.stderr[-3000:]
    assert (stack.rows(), stack.failure_rows()) == ([], [])
    assert (agent.requests, stack.model.requests) == (0, 0)
    assert stack.capture_files() == []
    assert finished_events(result) == {}


# ---- what the proxy refuses and never writes ---------------------------------------------------


CREDENTIALED_CALLS = (("chat", True), ("messages", False))
BAD_IDS = ("..%2F..%2Fescape", ".hidden", "-dash", "has%20space", "x" * 201)


async def test_credentials_never_reach_a_capture_file_and_bad_ids_are_refused(
    stack: Stack,
) -> None:
    k = len(CREDENTIALED_CALLS)
    await stack.start()
    headers = {"Authorization": f"Bearer {SECRET}"}

    async def respond(body: JsonObject) -> web.StreamResponse:
        assert stack.session is not None
        for dialect, stream in CREDENTIALED_CALLS:
            await call_model(
                stack.session,
                stack.proxy_url,
                rollout_id_of(body),
                dialect=dialect,
                stream=stream,
                headers=headers,
            )
        refused = {}
        for bad_id in BAD_IDS:
            try:
                await call_model(
                    stack.session, stack.proxy_url, bad_id, dialect="chat", stream=False
                )
            except ModelCallError as exc:
                refused[bad_id] = exc.status
        return web.json_response({"reward": 1.0, "refused": refused})

    url = await stack.agent(respond)
    write_tasks(stack.tasks, 1)

    result = await run_cli(*stack.args(url, "--capture-include-payloads"))

    assert result.returncode == 0, result.stderr[-3000:]
    [row] = stack.rows()
    assert row["refused"] == dict.fromkeys(BAD_IDS, 400)
    # Even with the payloads attached, only bodies are kept, never headers.
    for call in assert_capture(row, k)["calls"]:
        assert call["request"]["messages"][0]["content"] == PROMPT
        assert call["response"]["usage"]
    # Forwarded to the model, never written down; refused calls never reach it.
    assert (stack.model.requests, stack.model.with_authorization) == (k, k)
    assert stack.capture_files() == ["0-0.capture.jsonl"]
    assert files_holding(stack.capture_dir, SECRET.encode()) == []
    assert files_holding(stack.output.parent, SECRET.encode()) == []
