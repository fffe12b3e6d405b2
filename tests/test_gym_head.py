"""``--gym-head-server``: agents from a Gym head server's global config (contracts §15).

The head server here answers ``GET /global_config_dict_yaml`` as Gym's does
(FastAPI's JSON encoding of OmegaConf's YAML text); ``tests/gym`` runs the
same flag against a real Gym 0.7.0 stack.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest
import yaml
from aiohttp import web

from dispatcher.errors import ConfigError
from dispatcher.settings.config import load_settings
from dispatcher.settings.gym_head import gym_agents, head_url, parse_global_config
from tests.conftest import SimAgentFactory
from tests.helpers import free_port, read_jsonl, run_cli, serve, write_tasks

HeadFactory = Callable[[dict[str, Any]], Coroutine[Any, Any, str]]


def agent_instance(url: str, agent_type: str = "simple_agent") -> dict[str, Any]:
    parts = urlsplit(url)
    server = {"entrypoint": "app.py", "host": parts.hostname, "port": parts.port}
    return {"responses_api_agents": {agent_type: server}}


def relay_instance(url: str, agent: str) -> dict[str, Any]:
    """Gym 0.7.0's legacy_agent environment server in front of ``agent``."""
    parts = urlsplit(url)
    server = {
        "entrypoint": "app.py",
        "agent_server": {"type": "responses_api_agents", "name": agent},
        "host": parts.hostname,
        "port": parts.port,
    }
    return {"environment_servers": {"legacy_agent": server}}


def gym_config(**instances: dict[str, Any]) -> dict[str, Any]:
    head = {"host": "127.0.0.1", "port": 11000}
    return {"head_server": head, "policy_base_url": "http://127.0.0.1:1/v1", **instances}


@pytest.fixture
async def head_server() -> AsyncIterator[HeadFactory]:
    runners: list[web.AppRunner] = []

    async def start(config: dict[str, Any]) -> str:
        async def config_yaml(request: web.Request) -> web.Response:
            # FastAPI returns the YAML text as a JSON string.
            return web.json_response(yaml.safe_dump(config, sort_keys=False))

        app = web.Application()
        app.router.add_get("/global_config_dict_yaml", config_yaml)
        runner, url = await serve(app)
        runners.append(runner)
        return url

    yield start
    for runner in runners:
        await runner.cleanup()


def test_an_agent_resolves_to_its_environment_server_else_to_itself() -> None:
    config = gym_config(
        relayed_agent=agent_instance("http://10.0.0.1:8001"),
        relayed_agent_environment_server=relay_instance("http://10.0.0.1:8002", "relayed_agent"),
        direct_agent=agent_instance("http://10.0.0.2:9001"),
        shared_agent=agent_instance("http://10.0.0.3:7001"),
        env_a=relay_instance("http://10.0.0.3:7002", "shared_agent"),
        env_b=relay_instance("http://10.0.0.3:7003", "shared_agent"),
        string_match={"resources_servers": {"string_match": {"host": "10.0.0.4", "port": 1}}},
    )
    # As Gym's collector: /run goes to the one environment server fronting the
    # agent; without one, to the agent; with several, nowhere (Gym refuses it).
    assert gym_agents(config) == {
        "relayed_agent": ["http://10.0.0.1:8002"],
        "direct_agent": ["http://10.0.0.2:9001"],
    }


def test_the_answer_is_a_json_string_of_yaml() -> None:
    config = gym_config(a=agent_instance("http://127.0.0.1:5"))
    raw = orjson.dumps(yaml.safe_dump(config))
    assert parse_global_config(raw, "h") == config
    for bad in (b"{}", b'"- a list"', b"not json", b'"a: [unclosed"'):
        with pytest.raises(ConfigError, match="not a YAML mapping in a JSON string"):
            parse_global_config(bad, "h")


def test_head_url_takes_host_port_or_a_url() -> None:
    assert head_url("127.0.0.1:11000") == "http://127.0.0.1:11000"
    assert head_url("https://h:1/") == "https://h:1"
    with pytest.raises(ConfigError, match="--gym-head-server 'ftp://h:1'"):
        head_url("ftp://h:1")


async def test_agent_flag_wins_for_the_names_it_gives(head_server: HeadFactory) -> None:
    url = await head_server(
        gym_config(
            a=agent_instance("http://127.0.0.1:5001"), b=agent_instance("http://127.0.0.1:5002")
        )
    )
    cli = {"input": "x", "output": "y.jsonl", "gym_head_server": url}
    settings = await asyncio.to_thread(
        load_settings, {**cli, "agents": {"b": ["http://127.0.0.1:6000"]}}, {}
    )
    assert settings.agents == {"a": ["http://127.0.0.1:5001"], "b": ["http://127.0.0.1:6000"]}
    # From the environment too, as every setting.
    env = {"DISPATCHER_GYM_HEAD_SERVER": url}
    settings = await asyncio.to_thread(load_settings, {"input": "x", "output": "y.jsonl"}, env)
    assert sorted(settings.agents) == ["a", "b"]


async def test_run_takes_its_agents_from_the_head_server(
    tmp_path: Path, sim_agent: SimAgentFactory, head_server: HeadFactory
) -> None:
    agent_url, _ = await sim_agent()
    url = await head_server(gym_config(sim=agent_instance(agent_url)))
    tasks = write_tasks(tmp_path / "tasks.jsonl", 3)
    output = tmp_path / "out.jsonl"
    args = ["run", "--input", str(tasks), "--output", str(output), "--gym-head-server", url]
    result = await run_cli(*args, "--num-repeats", "2", "--metrics-listen", "off")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = read_jsonl(output)
    assert len(rows) == 6 and {r["_ng_dispatch"]["replica"] for r in rows} == {agent_url}


async def test_validate_and_serve_take_the_flag(
    tmp_path: Path, sim_agent: SimAgentFactory, head_server: HeadFactory
) -> None:
    agent_url, _ = await sim_agent()
    url = await head_server(gym_config(sim=agent_instance(agent_url)))
    tasks = write_tasks(tmp_path / "tasks.jsonl", 2)
    args = ["--input", str(tasks), "--output", str(tmp_path / "o.jsonl")]
    result = await run_cli("validate", *args, "--gym-head-server", url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"agent sim: {agent_url} reachable" in result.stdout
    help_text = (await run_cli("serve", "--help")).stdout
    assert "--gym-head-server" in help_text


async def test_an_unknown_agent_or_an_unreachable_head_server_is_exit_2(
    tmp_path: Path, sim_agent: SimAgentFactory, head_server: HeadFactory
) -> None:
    agent_url, _ = await sim_agent()
    url = await head_server(gym_config(sim=agent_instance(agent_url)))
    tasks = write_tasks(tmp_path / "tasks.jsonl", 2, agent="typo_agent")
    args = ["run", "--input", str(tasks), "--output", str(tmp_path / "o.jsonl")]
    result = await run_cli(*args, "--gym-head-server", url, "--metrics-listen", "off")
    assert result.returncode == 2
    assert "agent 'typo_agent' is not configured (configured: sim)" in result.stderr
    assert "Traceback" not in result.stderr

    dead = f"127.0.0.1:{free_port()}"
    serve = ["serve", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state")]
    for command in ([*args, "--metrics-listen", "off"], ["validate", *args[1:]], serve):
        result = await run_cli(*command, "--gym-head-server", dead)
        assert result.returncode == 2, (command[0], result.stderr)
        lines = result.stderr.strip().splitlines()
        assert lines[-1].startswith(f"error: Gym head server http://{dead} does not answer")
        assert "Traceback" not in result.stderr
