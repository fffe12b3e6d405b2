"""The files NeMo Gym's collector writes or reads around a run, without a Gym install.

- ``X_aggregate_metrics.json`` (what ``gym eval compare`` reads) is made of each
  agent's ``/aggregate_metrics`` answer, as Gym makes it, once the run is complete;
- an output directory Gym wrote (rows, materialized inputs, no manifest) is
  adopted on resume when its materialized inputs are this run's, else refused
  with its files untouched. (``tests/gym`` does both against a real Gym.)
"""

from __future__ import annotations

import contextlib
import json
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from dispatcher.run.aggregate import WithoutRoute, aggregate_metrics
from dispatcher.run.aggregate_rows import PASS_LINES, RowSpools, spool_by_agent
from tests.conftest import SimAgentFactory
from tests.helpers import keys_of, log_events, read_jsonl, run_args, run_cli, serve, write_tasks

METRICS = {
    "agent_metrics": {"mean/reward": 1.0},
    "key_metrics": {"mean/reward": 1.0},
    "group_level_metrics": [{"task_index": 0}],
    "repeat_level_metrics": [],
    "perf_summary": {"token_observability_coverage": 1.0},
}


class GymLikeAgent:
    """An agent with Gym's ``/aggregate_metrics``: it keeps what it was sent."""

    def __init__(self) -> None:
        self.aggregated: list[dict[str, Any]] = []

    async def run(self, request: web.Request) -> web.Response:
        body = await request.json()
        usage = {"input_tokens": 3, "output_tokens": 1}
        return web.json_response({**body, "reward": 1.0, "response": {"usage": usage, "x": 1}})

    async def aggregate(self, request: web.Request) -> web.Response:
        self.aggregated.append(await request.json())
        return web.json_response(METRICS)


@pytest.fixture
async def gym_like_agent() -> AsyncIterator[tuple[str, GymLikeAgent]]:
    agent = GymLikeAgent()
    app = web.Application()
    app.router.add_post("/run", agent.run)
    app.router.add_post("/aggregate_metrics", agent.aggregate)
    runner, url = await serve(app)
    yield url, agent
    await runner.cleanup()


async def test_a_complete_run_writes_gyms_aggregate_metrics(
    tmp_path: Path, gym_like_agent: tuple[str, GymLikeAgent]
) -> None:
    url, agent = gym_like_agent
    tasks = write_tasks(tmp_path / "tasks.jsonl", 3)
    output = tmp_path / "out" / "x.jsonl"

    result = await run_cli(*run_args(tasks, output, url, "--num-repeats", "2"))

    assert result.returncode == 0, result.stderr[-3000:]
    [sent] = agent.aggregated
    rows = sent["verify_responses"]
    assert len(rows) == 6
    # Stripped as Gym strips them: no payloads, the response's usage kept.
    assert all("responses_create_params" not in row for row in rows)
    assert all(
        row["response"] == {"usage": {"input_tokens": 3, "output_tokens": 1}} for row in rows
    )
    written = orjson.loads((tmp_path / "out" / "x_aggregate_metrics.json").read_bytes())
    assert written == [{"agent_ref": {"name": "sim"}, **METRICS}]


async def test_an_agent_without_the_endpoint_gets_no_file_and_no_failure(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, _ = await sim_agent()
    tasks = write_tasks(tmp_path / "tasks.jsonl", 2)
    output = tmp_path / "out" / "x.jsonl"

    result = await run_cli(*run_args(tasks, output, url))

    assert result.returncode == 0, result.stderr[-3000:]
    assert not (tmp_path / "out" / "x_aggregate_metrics.json").exists()
    [event] = [
        e for e in log_events(result.stderr) if e["event"] == "aggregate_metrics_unavailable"
    ]
    assert (event["agent"], event["http_status"], event["level"]) == ("sim", 404, "info")


async def test_a_run_with_work_left_writes_no_metrics(
    tmp_path: Path, gym_like_agent: tuple[str, GymLikeAgent]
) -> None:
    url, agent = gym_like_agent
    tasks = write_tasks(tmp_path / "tasks.jsonl", 2)
    output = tmp_path / "out" / "x.jsonl"

    result = await run_cli(*run_args(tasks, output, url, "--dispatch-budget-s", "0"))

    assert result.returncode == 75, result.stderr[-3000:]
    assert agent.aggregated == []


# ---- adopting Gym's output directory -----------------------------------------------------


async def gym_written_run(tmp_path: Path, url: str) -> tuple[Path, Path, list[dict[str, Any]]]:
    """A finished run whose manifest is gone: the files Gym's collector leaves."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", 3)
    output = tmp_path / "out" / "x.jsonl"
    first = await run_cli(*run_args(tasks, output, url, "--num-repeats", "2"))
    assert first.returncode == 0, first.stderr[-3000:]
    (tmp_path / "out" / "x_manifest.json").unlink()
    return tasks, output, read_jsonl(output)


async def test_a_gym_output_directory_is_adopted_and_resumed(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, agent = await sim_agent()
    tasks, output, rows = await gym_written_run(tmp_path, url)
    output.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows[1:]))
    before = agent.requests

    result = await run_cli(*run_args(tasks, output, url, "--num-repeats", "2"))

    assert result.returncode == 0, result.stderr[-3000:]
    assert [e for e in log_events(result.stderr) if e["event"] == "gym_output_adopted"]
    assert agent.requests - before == 1
    assert sorted(keys_of(read_jsonl(output))) == sorted(keys_of(rows))
    assert (tmp_path / "out" / "x_manifest.json").exists()
    assert not list((tmp_path / "out").glob("*.gym"))


async def test_a_gym_directory_of_another_run_is_refused_untouched(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, agent = await sim_agent()
    tasks, output, _ = await gym_written_run(tmp_path, url)
    materialized = tmp_path / "out" / "x_materialized_inputs.jsonl"
    theirs = materialized.read_bytes()
    before = agent.requests

    result = await run_cli(*run_args(tasks, output, url, "--num-repeats", "3"))

    assert result.returncode == 2, result.stderr[-3000:]
    assert "materialized inputs differ from this run's" in result.stderr
    assert "3 of this run's not in it" in result.stderr
    assert materialized.read_bytes() == theirs
    assert not list((tmp_path / "out").glob("*.gym"))
    assert agent.requests == before


async def test_rows_without_manifest_or_materialized_inputs_are_still_refused(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, _ = await sim_agent()
    tasks, output, _ = await gym_written_run(tmp_path, url)
    (tmp_path / "out" / "x_materialized_inputs.jsonl").unlink()

    result = await run_cli(*run_args(tasks, output, url, "--num-repeats", "2"))

    assert result.returncode == 2
    assert "x_manifest.json does not" in result.stderr


async def test_a_gym_directory_is_left_as_found_when_the_run_cannot_start(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, _ = await sim_agent()
    tasks, output, _ = await gym_written_run(tmp_path, url)
    materialized = tmp_path / "out" / "x_materialized_inputs.jsonl"
    theirs = materialized.read_bytes()
    # A task file that cannot be read stops the run while it materializes.
    tasks.write_bytes(tasks.read_bytes() + b"not json\n")

    result = await run_cli(*run_args(tasks, output, url, "--num-repeats", "2"))

    assert result.returncode == 2, result.stderr[-3000:]
    assert materialized.read_bytes() == theirs
    assert not list((tmp_path / "out").glob("*.gym"))


def test_aggregate_rows_leave_out_outsized_values_and_stream_without_holding_the_rows(
    tmp_path: Path,
) -> None:
    # A 2 MB per-token list in every row: only the small values travel.
    tokens = [{"token_id": i, "logprob": -0.5} for i in range(100_000)]
    output = tmp_path / "x.jsonl"
    with output.open("wb") as f:
        for i in range(20):
            row = {
                "reward": 1.0,
                "tokens": tokens,
                "big_int": 2**70 + i,
                "response": {"usage": {"input_tokens": 3}, "output": ["long"]},
                "agent_ref": {"name": "sim"},
                "_ng_dispatch": {"replica": "http://a"},
            }
            f.write(json.dumps(row).encode() + b"\n")
    with contextlib.ExitStack() as spools:
        tracemalloc.start()
        grouped = spool_by_agent(output, spools)
        chunks = [len(chunk) for chunk in grouped["sim"].body_chunks(chunk_bytes=100)]
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        entry = grouped["sim"]
        sent = json.loads(b"".join(entry.body_chunks()))["verify_responses"]
    assert (entry.rows, entry.last_replica) == (20, "http://a")
    assert len(chunks) > 10  # sent from the spool a chunk at a time
    assert len(sent) == 20
    assert sent[3]["big_int"] == 2**70 + 3  # exact, copied as written
    assert "tokens" not in sent[0] and sent[0]["reward"] == 1.0
    assert sent[0]["response"] == {"usage": {"input_tokens": 3}}
    # A few rows' worth at a time, never the file (the old way held it all, parsed).
    assert peak < output.stat().st_size / 4, (peak, output.stat().st_size)


def test_aggregate_spool_skips_the_last_replica_of_a_single_replica_agent(tmp_path: Path) -> None:
    output = tmp_path / "x.jsonl"
    rows = [
        {"reward": 1.0, "agent_ref": {"name": name}, "_ng_dispatch": {"replica": f"http://{name}"}}
        for name in ("one", "two")
    ]
    output.write_bytes(b"".join(json.dumps(row).encode() + b"\n" for row in rows))
    with contextlib.ExitStack() as spools:
        grouped = spool_by_agent(output, spools, single_replica={"one"})
        sent = json.loads(b"".join(grouped["one"].body_chunks()))["verify_responses"]
    assert grouped["one"].last_replica is None  # one replica: nothing to order
    assert grouped["two"].last_replica == "http://two"
    assert sent == [rows[0]]


def test_aggregate_rows_keep_the_responses_usage_as_written(tmp_path: Path) -> None:
    # An integer past 64 bits in the usage was read as a float and sent rounded; the
    # kept keys of the response travel as the row holds them, the rest of it left out.
    output = tmp_path / "x.jsonl"
    usage = b'{"input_tokens": 3, "seed": 1180591620717411303425}'
    rows = [
        b'{"reward":1.0,"agent_ref":{"name":"sim"},"response":{"output":["long"],"usage":'
        + usage
        + b',"incomplete_details":null}}',
        b'{"reward":0.0,"agent_ref":{"name":"sim"},"response":{"output":[]}}',
        b'{"reward":0.5,"agent_ref":{"name":"sim"},"response":"not an object"}',
    ]
    output.write_bytes(b"\n".join(rows) + b"\n")
    with contextlib.ExitStack() as spools:
        grouped = spool_by_agent(output, spools)
        body = b"".join(grouped["sim"].body_chunks())
    sent = json.loads(body)["verify_responses"]
    assert sent[0]["response"] == {
        "usage": {"input_tokens": 3, "seed": 2**70 + 1},
        "incomplete_details": None,
    }
    assert usage in body
    assert [row.get("response") for row in sent[1:]] == [None, None]
    assert [row["reward"] for row in sent] == [1.0, 0.0, 0.5]


def test_the_pass_goes_only_as_far_as_the_bodies_read(tmp_path: Path) -> None:
    # An agent that answers before reading its body (a 404) spares the rest of the
    # pass: the rows are spooled as the bodies need them, each agent's in order.
    output = tmp_path / "x.jsonl"
    rows = [{"i": i, "agent_ref": {"name": "ab"[i % 2]}} for i in range(2 * PASS_LINES + 5)]
    output.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    with contextlib.ExitStack() as spools:
        spooled = RowSpools(output, spools, single_replica={"a", "b"}, wanted={"a", "b"})
        a = spooled.rows_of("a")
        assert a is not None and (a.rows, spooled.over) == (PASS_LINES // 2, False)
        body = a.body_chunks(spooled, chunk_bytes=100)
        [next(body) for _ in range(3)]  # the first chunks; the request ends there
        assert (a.rows, spooled.over) == (PASS_LINES // 2, False)
        b = spooled.rows_of("b")
        assert b is not None
        sent_b = json.loads(b"".join(b.body_chunks(spooled)))["verify_responses"]
        assert spooled.over
        sent_a = json.loads(b"".join(a.body_chunks(spooled)))["verify_responses"]
    assert sent_a == rows[0::2] and sent_b == rows[1::2]


async def test_an_answer_before_the_body_is_read_still_names_the_environment_server(
    tmp_path: Path,
) -> None:
    # The agent answers without reading its body; only the last row names its server.
    async def aggregate(request: web.Request) -> web.Response:
        return web.json_response(METRICS)

    app = web.Application()
    app.router.add_post("/aggregate_metrics", aggregate)
    runner, url = await serve(app)
    output = tmp_path / "x.jsonl"
    rows = [{"i": i, "agent_ref": {"name": "sim"}} for i in range(3 * PASS_LINES)]
    rows[-1]["_ng_environment_server"] = "math_env"
    output.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    try:
        path = (await aggregate_metrics(output, {"sim": [url], "other": [url]})).path
    finally:
        await runner.cleanup()
    assert path is not None
    [entry] = orjson.loads(path.read_bytes())
    assert entry["agent_ref"] == {"name": "sim"}
    assert entry["_ng_environment_server"] == "math_env"


async def test_an_agent_without_the_endpoint_keeps_its_connection_between_jobs(
    tmp_path: Path,
) -> None:
    # A served job of a few rows asked an agent without /aggregate_metrics over a new
    # connection each time: the 404 came before its body was streamed, so the
    # connection could not be reused (a connect per job, on both sides).
    peers: list[Any] = []

    async def run(request: web.Request) -> web.Response:
        return web.json_response({})

    @web.middleware
    async def seen(request: web.Request, handler: Any) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        return await handler(request)

    app = web.Application(middlewares=[seen])
    app.router.add_post("/run", run)
    runner, url = await serve(app)
    output = tmp_path / "x.jsonl"
    output.write_bytes(b"".join(orjson.dumps({"i": i, "agent_ref": {"name": "sim"}}) + b"\n"
                                for i in range(8)))  # fmt: skip
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(3):
                path = (await aggregate_metrics(output, {"sim": [url]}, session=session)).path
                assert path is None
    finally:
        await runner.cleanup()
    assert len(peers) == 3 and len(set(peers)) == 1


async def test_a_small_output_is_sent_whole_and_names_its_server(
    tmp_path: Path, gym_like_agent: tuple[str, GymLikeAgent]
) -> None:
    url, agent = gym_like_agent
    output = tmp_path / "x.jsonl"
    rows = [{"i": i, "agent_ref": {"name": "sim"}, "response": {"output": [1]}} for i in range(3)]
    rows[-1]["_ng_environment_server"] = "math_env"
    output.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    path = (await aggregate_metrics(output, {"sim": [url], "other": [url]})).path
    assert path is not None
    [entry] = orjson.loads(path.read_bytes())
    assert list(entry)[:2] == ["agent_ref", "_ng_environment_server"]
    assert entry["_ng_environment_server"] == "math_env"
    [sent] = agent.aggregated
    assert sent == {"verify_responses": [{k: v for k, v in r.items() if k != "response"}
                                         for r in rows]}  # fmt: skip


async def test_an_agent_without_the_route_is_asked_again_only_after_a_while(
    tmp_path: Path,
) -> None:
    # A daemon serving a job per prompt group asked such an agent at every job's end:
    # a request, and a pass over the job's rows, for nothing.
    asked: list[str] = []

    async def run(request: web.Request) -> web.Response:
        return web.json_response({})

    @web.middleware
    async def seen(request: web.Request, handler: Any) -> web.StreamResponse:
        asked.append(request.path)
        return await handler(request)

    app = web.Application(middlewares=[seen])
    app.router.add_post("/run", run)
    runner, url = await serve(app)
    output = tmp_path / "x.jsonl"
    output.write_bytes(orjson.dumps({"agent_ref": {"name": "sim"}}) + b"\n")
    now = [0.0]
    without = WithoutRoute(ttl_s=60.0, clock=lambda: now[0])
    try:
        for at in (0.0, 1.0, 59.0, 60.0, 61.0):
            now[0] = at
            aggregated = await aggregate_metrics(output, {"sim": [url]}, without=without)
            assert aggregated.path is None and aggregated.states(["sim"]) == {"sim": "error"}
    finally:
        await runner.cleanup()
    assert asked == ["/aggregate_metrics", "/aggregate_metrics"]  # at 0 and at 60
