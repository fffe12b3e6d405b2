"""A model answer of a shape nobody expects is a fact about that call, never a crash.

Reading a capture used to assume the dialect's shapes (``choices`` a list of
objects, ``message`` and ``function`` objects, ``output``/``content`` lists):
``{"choices": 5}`` made the merge raise and every hop exit 1. Now every shape
reads, and the row is written with what could be read.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from dispatcher.capture.proxy import build_proxy_app
from dispatcher.capture.store import capture_path
from dispatcher.rows.capture import attach_capture
from dispatcher.trajectory.schema import TrajectoryRecord
from tests.conftest import SimAgentFactory
from tests.helpers import read_jsonl, run_args, run_cli, serve, write_tasks

HOSTILE = [
    ("chat", {"choices": 5}),
    ("chat", {"choices": [{"message": "a string"}]}),
    ("chat", {"choices": [{"message": {"tool_calls": [{"id": "t", "function": "f"}]}}]}),
    ("chat", {"choices": [{"message": {"tool_calls": 5}}]}),
    ("chat", {"choices": ["x"], "usage": 5}),
    ("responses", {"output": 5}),
    ("responses", {"output": ["x", 5], "incomplete_details": "no"}),
    ("messages", {"content": 5}),
    ("messages", {"content": [5, "x"], "usage": {"input_tokens": "many"}}),
    ("completions", {"choices": [{"text": 5}]}),
]
IDS = [f"{dialect}:{orjson.dumps(body).decode()}" for dialect, body in HOSTILE]


def line(dialect: str, response: Any, call_id: str = "c1") -> bytes:
    record = {
        "model_call_id": call_id,
        "dialect": dialect,
        "model_ref": "m",
        "started_at": 1.0,
        "completed_at": 2.0,
        "latency_ms": 1000.0,
        "status_code": 200,
        "error_category": None,
        "request": {"model": "m", "input": "hi"},
        "response": response,
    }
    return orjson.dumps(record) + b"\n"


def write_capture(capture_dir: Path, lines: bytes) -> None:
    capture_dir.mkdir(exist_ok=True)
    capture_path(capture_dir, "0-0").write_bytes(lines)


async def attach(capture_dir: Path, lines: bytes) -> dict[str, Any]:
    write_capture(capture_dir, lines)
    row: dict[str, Any] = {"_ng_task_index": 0, "_ng_rollout_index": 0, "reward": 1.0}
    await attach_capture(
        row,
        capture_dir=capture_dir,
        rollout_id="0-0",
        task_id=0,
        agent_result={"reward": 1.0},
        total_latency_ms=5.0,
    )
    return row


@pytest.mark.parametrize(("dialect", "response"), HOSTILE, ids=IDS)
async def test_each_hostile_shape_reads_as_a_call(
    tmp_path: Path, dialect: str, response: Any
) -> None:
    row = await attach(tmp_path / "captures", line(dialect, response))

    [call] = row["ng_model_call_capture"]["calls"]
    assert (call["model_call_id"], call["status_code"]) == ("c1", 200)
    # A tool call whose function is not an object still has its id: it counts, nameless.
    assert call["num_tool_calls"] == (1 if "function" in orjson.dumps(response).decode() else 0)
    TrajectoryRecord.model_validate(row["ng_trajectory"])
    assert row["reward"] == 1.0


@pytest.mark.parametrize(
    "record",
    [
        b'{"model_call_id": "c1", "response": 5, "model_ref": 7, "started_at": [], '
        b'"latency_ms": "fast", "status_code": "200", "dialect": 3}',
        b'{"model_call_id": "c1", "model_ref": {"type": "other", "name": 5}, "started_at": "then"}',
        b"[1, 2, 3]",
        b'"a string"',
    ],
)
async def test_hostile_record_fields_never_raise(tmp_path: Path, record: bytes) -> None:
    row = await attach(tmp_path / "captures", record + b"\n" + line("chat", {"choices": []}, "c2"))

    capture = row["ng_model_call_capture"]
    assert "c2" in [call["model_call_id"] for call in capture["calls"]]
    TrajectoryRecord.model_validate(row["ng_trajectory"])


# ---- end to end: a model that answers nonsense, through the proxy and the CLI ----------------


@pytest.fixture
async def hostile_model() -> AsyncIterator[str]:
    """A model server answering every call with the next hostile shape, as 200 JSON."""
    shapes = iter(HOSTILE * 10)

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(next(shapes)[1])

    app = web.Application()
    app.router.add_post("/{tail:.*}", answer)
    runner, url = await serve(app)
    yield url
    await runner.cleanup()


async def test_a_run_through_a_hostile_model_finishes_with_every_rollout(
    tmp_path: Path, hostile_model: str, sim_agent: SimAgentFactory
) -> None:
    capture_dir = tmp_path / "captures"
    proxy, proxy_url = await serve(build_proxy_app(hostile_model, capture_dir))
    try:
        agent_url, _ = await sim_agent(model_url=proxy_url, model_calls=1)
        tasks = write_tasks(tmp_path / "tasks.jsonl", len(HOSTILE))
        output = tmp_path / "out" / "x.jsonl"
        args = run_args(tasks, output, agent_url, "--capture-dir", str(capture_dir))

        result = await run_cli(*args, "--max-attempts", "1")
    finally:
        await proxy.cleanup()

    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(output) + read_jsonl(output.with_name("x_failures.jsonl"))
    assert len(rows) == len(HOSTILE)
    for row in rows:
        assert len(row["ng_model_call_capture"]["calls"]) == 1
        TrajectoryRecord.model_validate(row["ng_trajectory"])
