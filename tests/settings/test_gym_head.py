"""``--gym-head-server``: agents from a Gym head server's global config (contracts §15).

The head server here answers ``GET /global_config_dict_yaml`` as Gym's does
(FastAPI's JSON encoding of OmegaConf's YAML text); ``tests/gym`` runs the
same flag against a real Gym 0.7.0 stack.
"""

from __future__ import annotations

import asyncio
import contextlib
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


async def start_head(app: web.Application, runners: list[web.AppRunner]) -> str:
    runner, url = await serve(app)
    runners.append(runner)
    return url


@pytest.fixture
async def runners() -> AsyncIterator[list[web.AppRunner]]:
    started: list[web.AppRunner] = []
    yield started
    for runner in started:
        await runner.cleanup()


@pytest.fixture
def head_server(runners: list[web.AppRunner]) -> HeadFactory:
    async def start(config: dict[str, Any]) -> str:
        async def config_yaml(request: web.Request) -> web.Response:
            # FastAPI returns the YAML text as a JSON string.
            return web.json_response(yaml.safe_dump(config, sort_keys=False))

        app = web.Application()
        app.router.add_get("/global_config_dict_yaml", config_yaml)
        return await start_head(app, runners)

    return start


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
    serve = [
        "serve", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
        "--gym-head-server-wait-s", "0",
    ]  # fmt: skip
    for command in ([*args, "--metrics-listen", "off"], ["validate", *args[1:]], serve):
        result = await run_cli(*command, "--gym-head-server", dead)
        assert result.returncode == 2, (command[0], result.stderr)
        lines = result.stderr.strip().splitlines()
        assert lines[-1].startswith(f"error: Gym head server http://{dead} does not answer")
        assert "Traceback" not in result.stderr


async def run_with_head(tmp_path: Path, url: str, *flags: str) -> Any:
    tasks = write_tasks(tmp_path / "tasks.jsonl", 1)
    return await run_cli(
        "run", "--input", str(tasks), "--output", str(tmp_path / "o.jsonl"),
        "--metrics-listen", "off", "--gym-head-server", url, *flags,
    )  # fmt: skip


def the_error(result: Any) -> str:
    """The run's one error line: exit 2, no traceback."""
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    return str(line)


async def test_a_head_server_that_drips_its_answer_is_cut_at_the_deadline(
    tmp_path: Path, runners: list[web.AppRunner]
) -> None:
    # A byte now and then kept every read under its timeout: start-up waited for
    # as long as the server dripped.
    done = asyncio.Event()

    async def drip(request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse(headers={"Content-Type": "application/json"})
        await answer.prepare(request)
        while not done.is_set():
            await answer.write(b" ")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.05)  # the drip's pace
        return answer

    app = web.Application()
    app.router.add_get("/global_config_dict_yaml", drip)
    url = await start_head(app, runners)
    try:
        result = await run_with_head(tmp_path, url, "--gym-head-timeout-s", "0.5")
    finally:
        done.set()
    assert the_error(result) == (
        f"error: Gym head server {url}: no whole answer within 0.5 s (--gym-head-timeout-s)"
    )


async def test_a_head_server_that_redirects_is_an_error_naming_where_to(
    tmp_path: Path, runners: list[web.AppRunner], sim_agent: SimAgentFactory
) -> None:
    agent_url, _ = await sim_agent()
    asked: list[str] = []

    async def config_yaml(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response(yaml.safe_dump(gym_config(sim=agent_instance(agent_url))))

    other = web.Application()
    other.router.add_get("/global_config_dict_yaml", config_yaml)
    elsewhere = await start_head(other, runners)

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(f"{elsewhere}/global_config_dict_yaml")

    app = web.Application()
    app.router.add_get("/global_config_dict_yaml", moved)
    url = await start_head(app, runners)
    result = await run_with_head(tmp_path, url)
    assert the_error(result) == (
        f"error: Gym head server {url}: GET /global_config_dict_yaml answered 307, a redirect "
        f"to {elsewhere}/global_config_dict_yaml (not followed: give --gym-head-server the "
        "head server itself)"
    )
    assert asked == []


async def test_a_deeply_nested_head_config_is_one_line(
    tmp_path: Path, runners: list[web.AppRunner]
) -> None:
    deep = "a: " + "[" * 50_000 + "]" * 50_000

    async def config_yaml(request: web.Request) -> web.Response:
        return web.json_response(deep)

    app = web.Application()
    app.router.add_get("/global_config_dict_yaml", config_yaml)
    url = await start_head(app, runners)
    result = await run_with_head(tmp_path, url)
    assert the_error(result) == (
        f"error: Gym head server {url}: /global_config_dict_yaml is nested too deeply"
    )


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_head_config_over_the_bound_is_an_error_read_no_further(
    tmp_path: Path, runners: list[web.AppRunner], chunked: bool
) -> None:
    # A 300 MB config cost 1.24 GB: it is read up to the bound, then refused.
    big = orjson.dumps(yaml.safe_dump(gym_config(pad={"x": "y" * 5000})))

    async def config_yaml(request: web.Request) -> web.StreamResponse:
        if not chunked:
            return web.Response(body=big, content_type="application/json")
        answer = web.StreamResponse(headers={"Content-Type": "application/json"})
        answer.enable_chunked_encoding()
        await answer.prepare(request)
        for start in range(0, len(big), 1000):
            await answer.write(big[start : start + 1000])
        return answer

    app = web.Application()
    app.router.add_get("/global_config_dict_yaml", config_yaml)
    url = await start_head(app, runners)
    result = await run_with_head(tmp_path, url, "--gym-head-max-bytes", "4096")
    assert the_error(result) == (
        f"error: Gym head server {url}: /global_config_dict_yaml is larger than "
        "--gym-head-max-bytes (4096 bytes)"
    )
