"""Gym's ``_ng_environment_server`` and ``_ng_result_type`` on rows, failure rows and the
aggregate metrics file, as Gym 0.7.0's collector writes them (contracts §15)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest
import yaml
from aiohttp import web

from dispatcher.settings.gym_head import gym_environments
from tests.helpers import read_jsonl, run_cli, serve


def _relay(url: str, agent: str) -> dict[str, Any]:
    """Gym 0.7.0's legacy_agent environment server in front of ``agent``."""
    parts = urlsplit(url)
    server = {
        "entrypoint": "app.py",
        "agent_server": {"type": "responses_api_agents", "name": agent},
        "host": parts.hostname,
        "port": parts.port,
    }
    return {"environment_servers": {"legacy_agent": server}}


@pytest.fixture
async def stack() -> AsyncIterator[str]:
    """A Gym head server whose config puts one environment server (this test's agent)
    in front of the agent ``sim``: task 1 fails with a 500, the rest succeed."""
    runners: list[web.AppRunner] = []

    async def run(request: web.Request) -> web.Response:
        body = await request.json()
        if body["_ng_task_index"] == 1:
            return web.Response(status=500, text="boom")
        return web.json_response({"reward": 1.0})

    async def aggregate(request: web.Request) -> web.Response:
        rows = (await request.json())["verify_responses"]
        servers = sorted({row.get("_ng_environment_server") for row in rows})
        return web.json_response({"agent_metrics": {"rows": len(rows), "servers": servers}})

    agent = web.Application()
    agent.router.add_post("/run", run)
    agent.router.add_post("/aggregate_metrics", aggregate)
    runner, agent_url = await serve(agent)
    runners.append(runner)
    sim = {"responses_api_agents": {"simple_agent": {"host": "127.0.0.1", "port": 1}}}
    config = {"head_server": {"host": "127.0.0.1", "port": 1}, "sim": sim}
    config["sim_env"] = _relay(agent_url, "sim")

    async def config_yaml(request: web.Request) -> web.Response:
        return web.json_response(yaml.safe_dump(config, sort_keys=False))

    head = web.Application()
    head.router.add_get("/global_config_dict_yaml", config_yaml)
    runner, head_url = await serve(head)
    runners.append(runner)
    yield head_url
    for started in runners:
        await started.cleanup()


async def test_rows_failure_rows_and_the_aggregate_file_name_the_environment_server(
    tmp_path: Path, stack: str
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    rows = [{"q": 0}, {"q": 1}, {"q": 2, "_ng_environment_server": "other_env"}]
    tasks.write_bytes(
        b"".join(orjson.dumps({**r, "agent_ref": {"name": "sim"}}) + b"\n" for r in rows)
    )
    out = tmp_path / "out.jsonl"
    result = await run_cli(
        "run", "--input", str(tasks), "--output", str(out), "--gym-head-server", stack,
        "--max-attempts", "1", "--metrics-listen", "off", "--log-format", "json",
    )  # fmt: skip
    assert result.returncode in (0, 1), result.stderr[-3000:]
    by_task = {row["_ng_task_index"]: row for row in read_jsonl(out)}
    assert by_task[0]["_ng_environment_server"] == "sim_env"
    assert by_task[0]["_ng_result_type"] == "legacy_agent"
    # A task row's own server travels with it (Gym stamps materialized rows); the
    # config's implementation is not that server's, so no type is claimed.
    assert by_task[2]["_ng_environment_server"] == "other_env"
    assert "_ng_result_type" not in by_task[2]
    [failure] = read_jsonl(tmp_path / "out_failures.jsonl")
    assert failure["_ng_failure_http_status"] == 500
    assert failure["_ng_environment_server"] == "sim_env"
    assert failure["_ng_result_type"] == "legacy_agent"
    [entry] = orjson.loads((tmp_path / "out_aggregate_metrics.json").read_bytes())
    assert entry["agent_ref"] == {"name": "sim"}
    assert entry["_ng_environment_server"] == "sim_env"
    assert entry["agent_metrics"] == {"rows": 2, "servers": ["other_env", "sim_env"]}


def test_an_agent_behind_one_environment_server_has_its_name_and_implementation() -> None:
    config = {
        "a": {"responses_api_agents": {"simple_agent": {}}},
        "a_env": _relay("http://127.0.0.1:2", "a"),
        "b": {"responses_api_agents": {"simple_agent": {}}},
        "b_env_1": _relay("http://127.0.0.1:3", "b"),
        "b_env_2": _relay("http://127.0.0.1:4", "b"),
        "c": {"responses_api_agents": {"simple_agent": {}}},
    }
    # "b" is fronted by two (Gym refuses to route it by name); "c" by none.
    assert gym_environments(config) == {"a": ("a_env", "legacy_agent")}
