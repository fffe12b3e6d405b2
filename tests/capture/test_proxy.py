"""The capture proxy over real sockets: sim model or scripted upstreams on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import structlog
import structlog.testing
from aiohttp import web
from yarl import URL

from dispatcher.capture.proxy import STORE_KEY, build_proxy_app
from dispatcher.capture.store import capture_path, claims_path
from dispatcher.rows.capture import attach_capture
from dispatcher.sim.agent import SimAgentConfig, build_sim_agent_app
from dispatcher.sim.model import STATS_KEY, SimModelConfig, build_sim_model_app
from dispatcher.sim.model_client import ModelCallError, call_model, request_body

DIALECTS = ("chat", "responses", "messages", "completions")
SECRET = "sk-test-0123456789-do-not-store"


class Servers:
    """Starts apps on 127.0.0.1:0 and stops them (after opening every gate) at teardown."""

    def __init__(self) -> None:
        self.runners: list[web.AppRunner] = []
        self.gates: list[asyncio.Event] = []

    async def start(self, app: web.Application, **runner_kwargs: Any) -> str:
        runner = web.AppRunner(app, access_log=None, **runner_kwargs)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    def gate(self) -> asyncio.Event:
        event = asyncio.Event()
        self.gates.append(event)
        return event

    async def close(self) -> None:
        for gate in self.gates:
            gate.set()
        for runner in reversed(self.runners):
            await runner.cleanup()


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    harness = Servers()
    yield harness
    await harness.close()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def sim_and_proxy(
    servers: Servers, capture_dir: Path, config: SimModelConfig | None = None
) -> tuple[web.Application, str]:
    model_app = build_sim_model_app(config or SimModelConfig())
    model_url = await servers.start(model_app)
    proxy_url = await servers.start(build_proxy_app(model_url, capture_dir))
    return model_app, proxy_url


async def finalize(capture_dir: Path, rollout_id: str, **kwargs: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"reward": 1.0}
    await attach_capture(
        row,
        capture_dir=capture_dir,
        rollout_id=rollout_id,
        task_id=0,
        agent_result=dict(row),
        total_latency_ms=1.0,
        **kwargs,
    )
    return row


def scripted_upstream(
    parts: list[bytes],
    *,
    gate: asyncio.Event | None = None,
    gate_before: int = 1,
    cut: bool = False,
    status: int = 200,
    content_type: str = "text/event-stream",
) -> web.Application:
    """An upstream that sends ``parts`` one write each, waiting on ``gate`` before part N
    (before its headers too when N is 0)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(status=status)
        response.content_type = content_type
        try:
            for index, part in enumerate(parts):
                if gate is not None and index == gate_before:
                    await gate.wait()
                await response.prepare(request)
                await response.write(part)
        except ConnectionResetError:
            # The proxy gave up on this answer (timeout) before the gate opened.
            return response
        if cut and request.transport is not None:
            request.transport.close()
        else:
            await response.write_eof()
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else orjson.dumps(data).decode()
    return f"data: {payload}\n\n".encode()


CHAT_STREAM = [
    sse({"id": "c1", "model": "m", "choices": [{"index": 0, "delta": {"content": "Hel"}}]}),
    sse({"id": "c1", "model": "m", "choices": [{"index": 0, "delta": {"content": "lo"}}]}),
    sse(
        {
            "id": "c1",
            "model": "m",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
        }
    ),
    sse("[DONE]"),
]


def post_chat(session: aiohttp.ClientSession, url: str, **kwargs: Any) -> Any:
    body = request_body("chat", stream=True, prompt="hi", model="m")
    return session.post(url, data=orjson.dumps(body), **kwargs)


def written_files(directory: Path) -> list[Path]:
    return sorted(path for path in directory.rglob("*") if path.is_file())


def capture_lines(capture_dir: Path, rollout_id: str) -> list[dict[str, Any]]:
    text = (capture_dir / f"{rollout_id}.capture.jsonl").read_bytes()
    return [orjson.loads(line) for line in text.splitlines()]


# --- recording ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dialect", DIALECTS)
async def test_records_k_calls_with_reported_token_sums(
    servers: Servers,
    session: aiohttp.ClientSession,
    tmp_path: Path,
    dialect: str,
    stream: bool,
) -> None:
    _, proxy = await sim_and_proxy(servers, tmp_path)
    answers = [
        await call_model(session, proxy, "7-2", dialect=dialect, stream=stream, prompt="x" * n)
        for n in (10, 200, 3000)
    ]

    row = await finalize(tmp_path, "7-2")

    capture = row["ng_model_call_capture"]
    assert "gaps" not in capture
    assert [c["response_id"] for c in capture["calls"]] == [a["id"] for a in answers]
    assert all(c["dialect"] == dialect and c["status_code"] == 200 for c in capture["calls"])
    metrics = capture["metrics"]
    assert metrics["num_calls"] == 3
    assert metrics["tokens_out"] == sum(_completion_tokens(a) for a in answers)
    assert metrics["tokens_in"] == sum(_prompt_tokens(dialect, a) for a in answers)
    assert metrics["latency_total_ms"] > 0
    streamed = [line["stream"] for line in capture_lines(tmp_path, "7-2")]
    assert streamed == [stream] * 3


def _completion_tokens(answer: dict[str, Any]) -> int:
    usage = answer["usage"]
    return int(usage.get("completion_tokens", usage.get("output_tokens")))


def _prompt_tokens(dialect: str, answer: dict[str, Any]) -> int:
    usage = answer["usage"]
    if dialect == "messages":
        return int(usage["input_tokens"] + usage["cache_read_input_tokens"])
    return int(usage.get("prompt_tokens", usage.get("input_tokens")))


async def test_streamed_answer_is_reassembled_like_the_direct_one(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    _, proxy = await sim_and_proxy(servers, tmp_path, SimModelConfig(tool_calls=2))
    await call_model(session, proxy, "r", dialect="messages", stream=True)
    await call_model(session, proxy, "r", dialect="messages", stream=False)

    row = await finalize(tmp_path, "r", include_payloads=True)
    streamed, direct = (call["response"] for call in row["ng_model_call_capture"]["calls"])

    assert {k: v for k, v in streamed.items() if k != "id"} == {
        k: v for k, v in direct.items() if k != "id"
    }


async def test_concurrent_calls_of_one_rollout_append_whole_lines(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    model_url = await servers.start(build_sim_model_app(SimModelConfig()))
    proxy_app = build_proxy_app(model_url, tmp_path)
    proxy = await servers.start(proxy_app)

    await asyncio.gather(
        *(
            call_model(session, proxy, f"0-{i % 2}", dialect="chat", stream=i % 3 == 0)
            for i in range(40)
        )
    )

    for rollout_id in ("0-0", "0-1"):
        row = await finalize(tmp_path, rollout_id)
        assert row["ng_model_call_capture"]["metrics"]["num_calls"] == 20
        assert len(capture_lines(tmp_path, rollout_id)) == 20
    # Per-rollout locks exist only while a rollout is writing.
    assert proxy_app[STORE_KEY].rollouts_writing == 0


async def test_calls_without_the_prefix_are_forwarded_not_recorded(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    model_app, proxy = await sim_and_proxy(servers, tmp_path)

    async with session.get(f"{proxy}/v1/models") as listed:
        assert listed.status == 200
        assert (await listed.json())["data"][0]["id"] == "sim-model"
    body = orjson.dumps(request_body("chat", stream=False, prompt="p", model="m"))
    with structlog.testing.capture_logs() as logs:
        for _ in range(2):
            async with session.post(f"{proxy}/v1/chat/completions", data=body) as answered:
                assert answered.status == 200
    async with session.get(f"{proxy}/ng-rollout/0-0/v1/models") as prefixed:
        assert prefixed.status == 200

    assert model_app[STATS_KEY].requests == 2
    assert written_files(tmp_path) == []
    # Said once, so a model server calling without the prefix is noticed, not flooded.
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["model_call_not_captured"]


@pytest.mark.parametrize(
    "bad_id", ["-leading-dash", "has%20space", "semi;colon", "a%0A", "x" * 201]
)
async def test_bad_rollout_id_is_refused_and_writes_nothing(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path, bad_id: str
) -> None:
    model_app, proxy = await sim_and_proxy(servers, tmp_path)
    url = f"{proxy}/ng-rollout/{bad_id}/v1/chat/completions"

    async with post_chat(session, URL(url, encoded=True)) as answer:
        assert answer.status == 400
        assert (await answer.json())["error"]["type"] == "invalid_rollout_id"

    assert model_app[STATS_KEY].requests == 0
    assert written_files(tmp_path) == []


async def test_credentials_are_forwarded_but_never_written(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    model_app, proxy = await sim_and_proxy(servers, tmp_path)
    headers = {"Authorization": f"Bearer {SECRET}", "x-api-key": SECRET, "api-key": SECRET}

    for dialect in DIALECTS:
        for stream in (False, True):
            await call_model(session, proxy, "0-0", dialect=dialect, stream=stream, headers=headers)
    await finalize(tmp_path, "0-0")

    assert model_app[STATS_KEY].with_authorization == 8
    written = written_files(tmp_path)
    assert len(written) == 1
    assert not any(SECRET.encode() in path.read_bytes() for path in written)


# --- streaming ---------------------------------------------------------------------------


async def test_sse_is_relayed_unchanged_and_as_it_arrives(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    gate = servers.gate()
    upstream = await servers.start(scripted_upstream(CHAT_STREAM, gate=gate, gate_before=1))
    proxy = await servers.start(build_proxy_app(upstream, tmp_path))

    async with post_chat(session, f"{proxy}/ng-rollout/s-1/v1/chat/completions") as answer:
        assert answer.headers["Content-Type"].startswith("text/event-stream")
        first = await answer.content.readexactly(len(CHAT_STREAM[0]))
        # The upstream is still held at the gate: this byte-exact event was not buffered.
        assert first == CHAT_STREAM[0]
        assert not gate.is_set()
        gate.set()
        rest = await answer.read()

    assert first + rest == b"".join(CHAT_STREAM)
    row = await finalize(tmp_path, "s-1", include_payloads=True)
    (call,) = row["ng_model_call_capture"]["calls"]
    assert call["response"]["choices"][0]["message"]["content"] == "Hello"
    assert (call["tokens_in"], call["tokens_out"], call["tokens_total"]) == (5, 2, 7)
    assert call["error_category"] is None
    assert 0 < call["latency_ttft_ms"] <= call["latency_ms"]


# --- failures ----------------------------------------------------------------------------


async def test_upstream_error_status_is_relayed_and_recorded(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    config = SimModelConfig(error_rate=1.0, error_status=503)
    _, proxy = await sim_and_proxy(servers, tmp_path, config)

    with pytest.raises(ModelCallError) as failed:
        await call_model(session, proxy, "e-1", dialect="chat", stream=False)

    assert failed.value.status == 503
    assert "simulated model failure" in str(failed.value)
    (call,) = (await finalize(tmp_path, "e-1"))["ng_model_call_capture"]["calls"]
    assert (call["status_code"], call["error_category"]) == (503, "upstream_http_error")


async def test_unreachable_upstream_gives_502_and_is_recorded(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    proxy = await servers.start(build_proxy_app(f"http://127.0.0.1:{closed_port}", tmp_path))

    async with post_chat(session, f"{proxy}/ng-rollout/u-1/v1/chat/completions") as answer:
        assert answer.status == 502
        assert (await answer.json())["error"]["type"] == "upstream_unreachable"

    (call,) = (await finalize(tmp_path, "u-1"))["ng_model_call_capture"]["calls"]
    assert (call["status_code"], call["error_category"]) == (502, "upstream_unreachable")


async def test_upstream_timeout_gives_502_and_is_recorded(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    never = servers.gate()
    upstream = await servers.start(scripted_upstream([b"{}"], gate=never, gate_before=0))
    proxy = await servers.start(build_proxy_app(upstream, tmp_path, upstream_timeout_s=0.2))

    async with post_chat(session, f"{proxy}/ng-rollout/t-1/v1/chat/completions") as answer:
        assert answer.status == 502

    (call,) = (await finalize(tmp_path, "t-1"))["ng_model_call_capture"]["calls"]
    assert call["error_category"] == "upstream_timeout"


async def test_upstream_timeout_mid_stream_cuts_the_stream_and_is_recorded(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    never = servers.gate()
    upstream = await servers.start(scripted_upstream(CHAT_STREAM, gate=never, gate_before=1))
    proxy = await servers.start(build_proxy_app(upstream, tmp_path, upstream_timeout_s=0.2))

    async with post_chat(session, f"{proxy}/ng-rollout/t-2/v1/chat/completions") as answer:
        assert answer.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await answer.read()

    (call,) = (await finalize(tmp_path, "t-2"))["ng_model_call_capture"]["calls"]
    assert call["error_category"] == "upstream_timeout"


async def test_stream_cut_by_the_upstream_is_cut_for_the_agent_and_recorded(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    upstream = await servers.start(scripted_upstream(CHAT_STREAM[:2], cut=True))
    proxy = await servers.start(build_proxy_app(upstream, tmp_path))

    async with post_chat(session, f"{proxy}/ng-rollout/c-1/v1/chat/completions") as answer:
        assert answer.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await answer.read()

    (call,) = (await finalize(tmp_path, "c-1"))["ng_model_call_capture"]["calls"]
    assert call["error_category"] == "upstream_disconnected"
    assert call["status_code"] == 200


async def test_stream_without_its_final_event_is_recorded_as_truncated(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    upstream = await servers.start(scripted_upstream(CHAT_STREAM[:2]))
    proxy = await servers.start(build_proxy_app(upstream, tmp_path))

    async with post_chat(session, f"{proxy}/ng-rollout/c-2/v1/chat/completions") as answer:
        assert await answer.read() == b"".join(CHAT_STREAM[:2])

    row = await finalize(tmp_path, "c-2", include_payloads=True)
    (call,) = row["ng_model_call_capture"]["calls"]
    assert call["error_category"] == "stream_truncated"
    assert call["response"]["choices"][0]["message"]["content"] == "Hello"


async def test_write_completes_when_the_client_goes_away_mid_stream(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    gate = servers.gate()
    upstream = await servers.start(scripted_upstream(CHAT_STREAM, gate=gate, gate_before=1))
    # As under a front proxy that cancels handlers whose client disconnected.
    proxy = await servers.start(build_proxy_app(upstream, tmp_path), handler_cancellation=True)

    answer = await post_chat(session, f"{proxy}/ng-rollout/g-1/v1/chat/completions")
    await answer.content.readexactly(len(CHAT_STREAM[0]))
    answer.close()

    row = await finalize(tmp_path, "g-1", limit_s=30.0)
    (call,) = row["ng_model_call_capture"]["calls"]
    assert call["error_category"] == "client_disconnected"
    assert not claims_path(tmp_path, "g-1").exists()


async def test_held_write_keeps_its_claim_until_durable(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    proxy_app, proxy, reached, release = await held_proxy(servers, tmp_path)

    await call_model(session, proxy, "h-1", dialect="chat", stream=False)
    await reached.wait()

    assert claims_path(tmp_path, "h-1").exists()
    assert proxy_app[STORE_KEY].pending_writes == 1
    release.set()
    await proxy_app[STORE_KEY].aclose()
    assert not claims_path(tmp_path, "h-1").exists()
    assert len(capture_lines(tmp_path, "h-1")) == 1


async def held_proxy(
    servers: Servers, capture_dir: Path
) -> tuple[web.Application, str, asyncio.Event, asyncio.Event]:
    """A proxy whose writes wait, after the answer went out, until ``release`` is set."""
    reached, release = asyncio.Event(), servers.gate()

    async def hold(rollout_id: str) -> None:
        reached.set()
        await release.wait()

    model_url = await servers.start(build_sim_model_app(SimModelConfig()))
    proxy_app = build_proxy_app(model_url, capture_dir, before_write=hold)
    return proxy_app, await servers.start(proxy_app), reached, release


async def test_write_delayed_past_the_answer_is_waited_for(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    _, proxy, reached, release = await held_proxy(servers, tmp_path)
    answer = await call_model(session, proxy, "d-1", dialect="responses", stream=True)
    await reached.wait()

    early = await finalize(tmp_path, "d-1", limit_s=0.0)
    waiting = asyncio.create_task(finalize(tmp_path, "d-1", poll_s=0.01, limit_s=30.0))
    release.set()
    row = await waiting

    # The agent already had its answer, yet the claim made the write visible as pending.
    assert early["ng_model_call_capture"]["gaps"][0]["code"] == "model_call_capture_pending"
    capture = row["ng_model_call_capture"]
    assert "gaps" not in capture
    assert [c["response_id"] for c in capture["calls"]] == [answer["id"]]


async def test_write_delayed_past_the_limit_gives_the_pending_gap(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    _, proxy, reached, _ = await held_proxy(servers, tmp_path)
    await call_model(session, proxy, "d-2", dialect="chat", stream=False)
    await reached.wait()
    row: dict[str, Any] = {"reward": 0.5}

    summary = await attach_capture(
        row,
        capture_dir=tmp_path,
        rollout_id="d-2",
        task_id=3,
        agent_result={"reward": 0.5},
        total_latency_ms=9.0,
        poll_s=0.01,
        limit_s=0.2,
    )

    assert summary.gaps == ["model_call_capture_pending", "model_call_capture_no_records"]
    assert summary.wait_s >= 0.2
    assert summary.num_calls == 0
    assert row["reward"] == 0.5
    assert "ng_perf" not in row


async def test_failed_write_leaves_the_incomplete_marker(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    _, proxy = await sim_and_proxy(servers, tmp_path)
    # A directory where the capture file should be makes every append fail.
    (tmp_path / "w-1.capture.jsonl").mkdir()

    await call_model(session, proxy, "w-1", dialect="chat", stream=False)

    row = await finalize(tmp_path, "w-1", limit_s=30.0)
    codes = [g["code"] for g in row["ng_model_call_capture"]["gaps"]]
    assert codes == ["model_call_capture_unreadable", "model_call_capture_incomplete"]
    assert not claims_path(tmp_path, "w-1").exists()


async def test_sim_agent_model_calls_land_in_the_attempts_own_capture(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    _, proxy = await sim_and_proxy(servers, tmp_path)
    config = SimAgentConfig(model_url=proxy, model_calls=3, model_dialect="messages")
    agent = await servers.start(build_sim_agent_app(config))
    row = {"_ng_task_index": 5, "_ng_rollout_index": 1, "_ng_attempt_index": 1}

    async with session.post(f"{agent}/run", json=row) as answer:
        result = await answer.json()
    finished = dict(result)
    summary = await attach_capture(
        finished,
        capture_dir=tmp_path,
        rollout_id="5-1-a1",
        task_id=5,
        agent_result=result,
        total_latency_ms=1.0,
    )

    assert (summary.num_calls, summary.gaps) == (3, [])
    assert finished["ng_perf"]["num_turns"] == 3
    assert not capture_path(tmp_path, "5-1").exists()
