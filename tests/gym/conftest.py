"""A real NeMo Gym 0.7.0 stack on 127.0.0.1, in front of our capture proxy and sim-model.

Topology (one stack for the session, shared by the modules that use ``gym_stack``):

    dispatcher run → Gym simple_agent (string_match) → Gym model server
        → our capture proxy → our sim-model

The stack serves both model server types, each behind its own simple_agent:
``string_match_simple_agent`` → ``policy_model`` (vllm_model: /v1/chat/completions)
and ``string_match_responses_agent`` → ``responses_policy_model`` (openai_model:
/v1/responses); a module names the one it tests with ``MODEL_SERVER``. The
second agent, its model server and its environment server come from a Gym
config the fixture writes next to the stack (``responses_agent.yaml``), as
does a third model server, ``token_policy_model``: vllm_model with
``return_token_id_information`` in front of a ``sim-model --token-ids`` of its
own, called directly.

Gym's own model-call capture is on (``+observability_enabled=true
+model_call_capture_dir=...``); both model servers write into that one
directory, keyed by rollout id, and ``dispatcher run --capture-dir`` reads it
(such a run first clears the captures of exactly its own rollout ids).
Ray runs one cluster per machine at a time: a test that starts a stack of its
own asks for ``no_shared_stack`` first, and runs after every test of the shared
stack (so that the session starts the shared stack once). The tests' Gym-side scripts (Gym's
models) and ``gym`` commands other than ``gym env start`` run in processes
forked from one long-lived, Gym-importing Python of the Gym venv,
``gym_interpreter`` (``interpreter.py``). The stack runs from the cached
Gym venv of ``gym_env.py``; without Python 3.13 the whole directory is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.gym import gym_env
from tests.gym.interpreter import GymInterpreter, ScriptResult
from tests.helpers import wait_until

CHAT_AGENT = "string_match_simple_agent"
RESPONSES_AGENT = "string_match_responses_agent"
RESPONSES_MODEL = "responses_policy_model"
TOKEN_MODEL = "token_policy_model"
# The agent in front of each model server type of the shared stack.
AGENTS = {"vllm_model": CHAT_AGENT, "openai_model": RESPONSES_AGENT}
STRING_MATCH_CONFIG = "resources_servers/string_match/configs/string_match.yaml"
READY = re.compile(r"All \d+ / \d+ servers ready")
LISTENING = re.compile(r"listening on (http://\S+)")
SERVER_DIRS = (
    "resources_servers/string_match",
    "responses_api_agents/simple_agent",
    "environment_servers/legacy_agent",
    "responses_api_models/vllm_model",
    "responses_api_models/openai_model",
)


def _gym_venv() -> Path:
    if gym_env.skipped():
        pytest.skip(f"NeMo Gym tests skipped on request (${gym_env.SKIP_ENV} is set)")
    venv = gym_env.ready_venv()
    if venv is not None:
        return venv
    python = gym_env.find_python313()
    if python is None:
        pytest.skip(
            "NeMo Gym 0.7.0 needs Python 3.13 and none was found "
            f"(set {gym_env.PYTHON_ENV}, or run `python3 tests/gym/gym_env.py` after installing it)"
        )
    return gym_env.install(python)


@pytest.fixture(scope="session")
def gym_venv() -> Path:
    return _gym_venv()


def site_packages(venv: Path) -> Path:
    return next(venv.glob("lib/python3.13/site-packages"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Proc:
    """A process we started in its own session, so its whole group can be stopped by id."""

    popen: subprocess.Popen[bytes]
    log: Path
    grace_s: float = 15
    """How long ``stop`` lets the group exit on SIGTERM before SIGKILL."""

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        """Stop the whole group: SIGTERM, up to ``grace_s`` to exit, then SIGKILL."""
        if self.grace_s > 0:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(self.grace_s)
        # Ray's processes share the group; none may outlive the stack.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()


# A Gym stack holds nothing worth a graceful stop: its SIGINT shutdown takes
# 30-60 s and its SIGTERM one about 3 s (Ray's), so its group is killed at once.
GYM_GRACE_S = 0.0


def start(args: list[str], log: Path, cwd: Path, grace_s: float = 15) -> Proc:
    with log.open("wb") as out:
        popen = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
        )
    return Proc(popen, log, grace_s)


def wait_for(proc: Proc, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str]:
    def seen() -> bool:
        if proc.popen.poll() is not None:
            raise AssertionError(f"{proc.log.name} exited early:\n{proc.text()[-3000:]}")
        return pattern.search(proc.text()) is not None

    asyncio.run(wait_until(seen, timeout_s=timeout_s, step_s=0.1))
    match = pattern.search(proc.text())
    assert match is not None
    return match


def dispatcher_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dispatcher", *args]


@dataclass(frozen=True)
class GymStack:
    """What a test needs of the running stack, seen through one of its agents."""

    venv: Path
    interpreter: GymInterpreter
    root: Path
    agent: str
    agent_urls: dict[str, str]
    head_port: int
    gym_capture_dir: Path
    proxy_capture_dir: Path
    sim_model_url: str
    tasks: Path
    # Gym's vllm_model with return_token_id_information, in front of `sim-model --token-ids`.
    token_model_url: str = ""

    @property
    def agent_url(self) -> str:
        return self.agent_urls[self.agent]

    def gym(self, *args: str, timeout_s: float = 120) -> ScriptResult:
        """A ``gym`` CLI command, run in the stack's directory."""
        return self.interpreter.gym(*args, cwd=self.root, timeout_s=timeout_s)

    def python(self, code: str, *args: str) -> ScriptResult:
        """A script in the Gym venv's Python, as ``python -c code args`` would run it."""
        return self.interpreter.run(code, *args, cwd=self.root)

    def gym_collect(self, output: Path, *extra: str) -> ScriptResult:
        """Gym's own collector against the running stack (``gym eval run --no-serve``)."""
        args = ["eval", "run", "--no-serve", "--agent", self.agent, "--input", str(self.tasks)]
        args += ["--output", str(output), "--num-repeats", "2", "--no-health-check"]
        args += ["+head_server.host=127.0.0.1", f"+head_server.port={self.head_port}", *extra]
        return self.gym(*args, timeout_s=180)

    def run(self, output: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        args = ["run", "--input", str(self.tasks), "--output", str(output)]
        args += ["--agent", f"{self.agent}={self.agent_url}", "--default-agent", self.agent]
        args += ["--num-repeats", "2", "--metrics-listen", "off", "--log-format", "json"]
        return subprocess.run(
            dispatcher_cmd(*args, *extra), capture_output=True, text=True, timeout=180
        )


def _venv_links(root: Path, venv: Path) -> Path:
    # Gym builds a venv per server; offline, each one is our Gym venv (skip_venv_if_present).
    links = root / "venvs"
    for server in SERVER_DIRS:
        (links / server).mkdir(parents=True)
        (links / server / ".venv").symlink_to(venv)
    return links


def _responses_config(packages: Path) -> dict[str, Any]:
    """The second agent: Gym's openai_model config under another name, with a
    simple_agent and an environment server in front of it as string_match.yaml
    has them in front of ``policy_model``."""
    model_config = packages / "responses_api_models/openai_model/configs/openai_model.yaml"
    [model] = yaml.safe_load(model_config.read_text()).values()
    stock = yaml.safe_load((packages / STRING_MATCH_CONFIG).read_text())
    agent = stock[CHAT_AGENT]["responses_api_agents"]["simple_agent"]
    agent["model_server"]["name"] = RESPONSES_MODEL
    del agent["datasets"]  # Gym's example dataset stays the first agent's
    environment = stock["string_match_environment_server"]
    environment["environment_servers"]["legacy_agent"]["agent_server"]["name"] = RESPONSES_AGENT
    return {
        RESPONSES_MODEL: model,
        RESPONSES_AGENT: stock[CHAT_AGENT],
        "string_match_responses_environment_server": environment,
    }


def _token_model_config(packages: Path, sim_url: str, port: int) -> dict[str, Any]:
    """Gym's vllm_model asking for token ids (``return_token_id_information``) of
    `sim-model --token-ids`, reached directly (no agent in front of it)."""
    model_config = packages / "responses_api_models/vllm_model/configs/vllm_model.yaml"
    [model] = yaml.safe_load(model_config.read_text()).values()
    server = model["responses_api_models"]["vllm_model"]
    server.update(base_url=f"{sim_url}/v1", return_token_id_information=True)
    server.update(host="127.0.0.1", port=port)
    return {TOKEN_MODEL: model}


def _gym_args(
    venv: Path,
    proxy_url: str,
    root: Path,
    head_port: int,
    agent_ports: dict[str, int],
    token_model: tuple[str, int],
) -> list[str]:
    packages = site_packages(venv)
    responses_config = root / "responses_agent.yaml"
    extra = _token_model_config(packages, *token_model)
    responses_config.write_text(yaml.safe_dump({**_responses_config(packages), **extra}))
    args = [
        str(venv / "bin" / "gym"), "env", "start",
        "--config", str(packages / STRING_MATCH_CONFIG),
        "--config", str(packages / "responses_api_models/vllm_model/configs/vllm_model.yaml"),
        "--config", str(responses_config),
        f"+policy_base_url={proxy_url}/v1", "+policy_api_key=sim", "+policy_model_name=sim-model",
        f"+uv_venv_dir={_venv_links(root, venv)}", "+skip_venv_if_present=true",
        "+head_server.host=127.0.0.1", f"+head_server.port={head_port}",
        "+observability_enabled=true", f"+model_call_capture_dir={root / 'gym-captures'}",
    ]  # fmt: skip
    for agent, port in agent_ports.items():
        args += [f"++{agent}.responses_api_agents.simple_agent.host=127.0.0.1"]
        args += [f"++{agent}.responses_api_agents.simple_agent.port={port}"]
    return args


class SharedStack:
    """The one stack of the session: started on first use, kept until ``stop``
    (after which the next use starts another)."""

    def __init__(
        self, venv: Path, interpreter: GymInterpreter, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        self._venv = venv
        self._interpreter = interpreter
        self._tmp_path_factory = tmp_path_factory
        self._procs: list[Proc] = []
        self._stack: GymStack | None = None

    def seen_by(self, model_server: str) -> GymStack:
        """The running stack, through the agent in front of ``model_server``."""
        if self._stack is None:
            try:
                self._stack = self._start()
            except BaseException:
                self.stop()
                raise
        return replace(self._stack, agent=AGENTS[model_server])

    def stop(self) -> None:
        for proc in reversed(self._procs):
            proc.stop()
        self._procs.clear()
        self._stack = None

    def _start(self) -> GymStack:
        root = self._tmp_path_factory.mktemp("gym-stack")
        # Both sim-models start at once; the proxy needs the first one's URL.
        sim = self._spawn(dispatcher_cmd("sim-model", "--listen", "127.0.0.1:0"), root / "sim.log")
        token_sim = self._spawn(
            dispatcher_cmd("sim-model", "--listen", "127.0.0.1:0", "--token-ids"),
            root / "token-sim.log",
        )
        sim_url = wait_for(sim, LISTENING, 30).group(1)
        proxy_args = ["capture-proxy", "--listen", "127.0.0.1:0", "--upstream", sim_url]
        proxy_args += ["--capture-dir", str(root / "proxy-captures")]
        proxy = self._spawn(dispatcher_cmd(*proxy_args), root / "proxy.log")
        token_sim_url = wait_for(token_sim, LISTENING, 30).group(1)
        proxy_url = wait_for(proxy, LISTENING, 30).group(1)
        head_port = free_port()
        agent_ports = {agent: free_port() for agent in AGENTS.values()}
        token_port = free_port()
        gym_args = _gym_args(
            self._venv, proxy_url, root, head_port, agent_ports, (token_sim_url, token_port)
        )
        wait_for(self._spawn(gym_args, root / "gym.log", GYM_GRACE_S), READY, 240)
        return GymStack(
            venv=self._venv,
            interpreter=self._interpreter,
            root=root,
            agent=CHAT_AGENT,
            agent_urls={agent: f"http://127.0.0.1:{port}" for agent, port in agent_ports.items()},
            head_port=head_port,
            gym_capture_dir=root / "gym-captures",
            proxy_capture_dir=root / "proxy-captures",
            sim_model_url=sim_url,
            token_model_url=f"http://127.0.0.1:{token_port}",
            tasks=site_packages(self._venv) / "resources_servers/string_match/data/example.jsonl",
        )

    def _spawn(self, args: list[str], log: Path, grace_s: float = 15) -> Proc:
        proc = start(args, log, log.parent, grace_s)
        self._procs.append(proc)
        return proc


@pytest.fixture(scope="session")
def gym_interpreter(
    gym_venv: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GymInterpreter]:
    """The Gym venv's Python for the session's Gym-side scripts (see ``interpreter.py``)."""
    interpreter = GymInterpreter(gym_venv, tmp_path_factory.mktemp("gym-python") / "stderr.log")
    try:
        yield interpreter
    finally:
        interpreter.stop()


@pytest.fixture(scope="session")
def shared_stack(
    gym_venv: Path, gym_interpreter: GymInterpreter, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SharedStack]:
    shared = SharedStack(gym_venv, gym_interpreter, tmp_path_factory)
    try:
        yield shared
    finally:
        shared.stop()


@pytest.fixture(scope="module")
def gym_stack(request: pytest.FixtureRequest, shared_stack: SharedStack) -> GymStack:
    """The shared stack through the agent of the module's ``MODEL_SERVER``
    (``vllm_model`` or ``openai_model``)."""
    return shared_stack.seen_by(request.module.MODEL_SERVER)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that stop the shared stack (``no_shared_stack``) run after every test
    that uses it, in their order: a test of the shared stack after them would start
    it again, and a stack costs more than anything else in the group."""
    items.sort(key=lambda item: "no_shared_stack" in getattr(item, "fixturenames", ()))


@pytest.fixture
def no_shared_stack(shared_stack: SharedStack) -> None:
    """For a test that starts a stack of its own: Ray runs one cluster per machine
    at a time, so the shared stack is stopped first."""
    shared_stack.stop()
