"""The simulated model server, its command-line knobs, and the sim agent's model client."""

from __future__ import annotations

import argparse
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestClient
from pytest_aiohttp import AiohttpClient

from dispatcher.capture.streams import reassemble
from dispatcher.capture.tokens import TokenCounts, normalize_usage
from dispatcher.sim.model import (
    STATS_KEY,
    SimModelConfig,
    add_parser,
    build_sim_model_app,
    config_from_args,
)
from dispatcher.sim.model_client import DIALECT_PATHS, agent_trajectory, request_body
from dispatcher.trajectory.schema import TrajectoryRecord

DIALECTS = tuple(DIALECT_PATHS)


async def sim(aiohttp_client: AiohttpClient, **knobs: Any) -> TestClient[Any, Any]:
    return await aiohttp_client(build_sim_model_app(SimModelConfig(**knobs)))


async def ask(client: TestClient[Any, Any], dialect: str, *, stream: bool) -> tuple[int, bytes]:
    body = request_body(dialect, stream=stream, prompt="p" * 400, model="policy")
    async with client.post(DIALECT_PATHS[dialect], data=orjson.dumps(body)) as answer:
        return answer.status, await answer.read()


def without_volatile(response: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in response.items() if k not in ("id", "created", "created_at")}


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_stream_reassembles_to_the_plain_answer(
    aiohttp_client: AiohttpClient, dialect: str
) -> None:
    client = await sim(aiohttp_client, tool_calls=1)

    _, plain_body = await ask(client, dialect, stream=False)
    _, stream_body = await ask(client, dialect, stream=True)

    plain = orjson.loads(plain_body)
    rebuilt = reassemble(dialect, stream_body)
    assert rebuilt.complete
    assert rebuilt.response is not None
    assert without_volatile(rebuilt.response) == without_volatile(plain)
    assert plain["model"] == "policy"


@pytest.mark.parametrize(
    ("dialect", "expected"),
    [
        ("chat", TokenCounts(100, 16, 4, 8, 116)),
        ("responses", TokenCounts(100, 16, 4, 8, 116)),
        ("messages", TokenCounts(100, 16, None, 8, 116)),
        ("completions", TokenCounts(100, 16, None, None, 116)),
    ],
)
async def test_usage_follows_request_size_and_knobs(
    aiohttp_client: AiohttpClient, dialect: str, expected: TokenCounts
) -> None:
    client = await sim(aiohttp_client)
    body = request_body(dialect, stream=False, prompt="", model="m")
    for key in ("messages", "input", "prompt"):
        if key in body:
            # 400 bytes of JSON (the quotes count): 100 prompt tokens at four bytes each.
            body[key] = "x" * 398

    async with client.post(DIALECT_PATHS[dialect], data=orjson.dumps(body)) as answer:
        usage = (await answer.json())["usage"]

    assert normalize_usage(usage) == expected


async def test_error_knob_answers_with_the_configured_status(aiohttp_client: AiohttpClient) -> None:
    client = await sim(aiohttp_client, error_rate=1.0, error_status=429)

    status, body = await ask(client, "chat", stream=False)

    assert status == 429
    assert orjson.loads(body)["error"]["type"] == "server_error"
    assert client.app is not None
    assert client.app[STATS_KEY].errors == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_truncate_knob_cuts_the_body(aiohttp_client: AiohttpClient, stream: bool) -> None:
    client = await sim(aiohttp_client, truncate_rate=1.0)

    with pytest.raises(aiohttp.ClientPayloadError):
        await ask(client, "responses", stream=stream)


async def test_stats_and_model_list(aiohttp_client: AiohttpClient) -> None:
    client = await sim(aiohttp_client, model="tiny")
    for dialect in DIALECTS:
        await ask(client, dialect, stream=dialect == "chat")

    async with client.get("/stats") as answer:
        stats = await answer.json()
    async with client.get("/v1/models") as listed:
        models = await listed.json()

    assert stats["requests"] == 4
    assert stats["streamed"] == 1
    assert stats["by_dialect"] == dict.fromkeys(DIALECTS, 1)
    assert models["data"][0]["id"] == "tiny"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["sim-model", *argv])


def test_command_line_converts_units_once() -> None:
    args = parse("--listen", "127.0.0.1:0", "--latency-ms", "250", "--inter-chunk-ms", "5")
    config = config_from_args(args)
    assert (config.latency_s, config.inter_chunk_s) == (0.25, 0.005)
    assert args.is_async


@pytest.mark.parametrize(
    "argv", [("--error-rate", "1.5"), ("--error-status", "200"), ("--latency-ms", "-1")]
)
def test_command_line_refuses_bad_knobs(argv: tuple[str, str]) -> None:
    with pytest.raises(ValueError):
        config_from_args(parse(*argv))


def test_agent_trajectory_helper_is_a_valid_trajectory() -> None:
    responses = [{"id": "resp-1"}, {"id": "resp-2"}]

    sent = agent_trajectory(task_id=2, rollout_id="2-1", responses=responses, model_ref="policy")

    parsed = TrajectoryRecord.model_validate(sent)
    assert [ref.response_id for ref in parsed.invocations[0].model_calls] == ["resp-1", "resp-2"]
    assert len(parsed.turns) == 2


def test_request_body_refuses_unknown_dialects() -> None:
    with pytest.raises(ValueError, match="unknown dialect"):
        request_body("embeddings", stream=False, prompt="p", model="m")
