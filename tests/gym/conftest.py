"""A real NeMo Gym 0.7.0 stack on 127.0.0.1, in front of our capture proxy and sim-model.

Topology (one stack per model server type, started once per module):

    dispatcher run → Gym simple_agent (string_match) → Gym model server
        (vllm_model: /v1/chat/completions, or openai_model: /v1/responses)
        → our capture proxy → our sim-model

Gym's own model-call capture is on (``+observability_enabled=true
+model_call_capture_dir=...``); ``dispatcher run --capture-dir`` reads it.
The stack runs from the cached Gym venv of ``gym_env.py``; without Python 3.13
the whole directory is skipped.
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
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.gym import gym_env
from tests.helpers import wait_until

AGENT = "string_match_simple_agent"
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

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, timeout_s: float = 15) -> None:
        """Stop the whole group. Gym's own SIGINT shutdown takes 30-60 s (Ray); the stack
        holds nothing worth a graceful stop, so its group gets SIGTERM, then SIGKILL."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout_s)
        # Ray's workers share the group; none may outlive the stack.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()


def start(args: list[str], log: Path, cwd: Path) -> Proc:
    with log.open("wb") as out:
        popen = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
        )
    return Proc(popen, log)


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


@dataclass
class GymStack:
    """What a test needs of a running stack."""

    venv: Path
    root: Path
    agent_url: str
    head_port: int
    gym_capture_dir: Path
    proxy_capture_dir: Path
    sim_model_url: str
    tasks: Path

    def gym(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.venv / "bin" / "gym"), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=self.root,
        )

    def python(self, code: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.venv / "bin" / "python"), "-c", code, *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    def gym_collect(self, output: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        """Gym's own collector against the running stack (``gym eval run --no-serve``)."""
        args = ["eval", "run", "--no-serve", "--agent", AGENT, "--input", str(self.tasks)]
        args += ["--output", str(output), "--num-repeats", "2", "--no-health-check"]
        args += ["+head_server.host=127.0.0.1", f"+head_server.port={self.head_port}", *extra]
        return self.gym(*args, timeout_s=180)

    def run(self, output: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        args = ["run", "--input", str(self.tasks), "--output", str(output)]
        args += ["--agent", f"{AGENT}={self.agent_url}", "--default-agent", AGENT]
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


def _gym_args(
    venv: Path, model_server: str, proxy_url: str, root: Path, ports: tuple[int, int]
) -> list[str]:
    agent_port, head_port = ports
    packages = site_packages(venv)
    model_config = f"responses_api_models/{model_server}/configs/{model_server}.yaml"
    return [
        str(venv / "bin" / "gym"), "env", "start",
        "--config", str(packages / "resources_servers/string_match/configs/string_match.yaml"),
        "--config", str(packages / model_config),
        f"+policy_base_url={proxy_url}/v1", "+policy_api_key=sim", "+policy_model_name=sim-model",
        f"+uv_venv_dir={_venv_links(root, venv)}", "+skip_venv_if_present=true",
        "+head_server.host=127.0.0.1", f"+head_server.port={head_port}",
        f"++{AGENT}.responses_api_agents.simple_agent.host=127.0.0.1",
        f"++{AGENT}.responses_api_agents.simple_agent.port={agent_port}",
        "+observability_enabled=true", f"+model_call_capture_dir={root / 'gym-captures'}",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def gym_stack(
    request: pytest.FixtureRequest, gym_venv: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GymStack]:
    """A running stack; the module sets ``MODEL_SERVER`` (``vllm_model`` or ``openai_model``)."""
    model_server: str = request.module.MODEL_SERVER
    root = tmp_path_factory.mktemp(model_server)
    procs: list[Proc] = []
    try:
        sim = start(dispatcher_cmd("sim-model", "--listen", "127.0.0.1:0"), root / "sim.log", root)
        procs.append(sim)
        sim_url = wait_for(sim, LISTENING, 30).group(1)
        proxy_args = ["capture-proxy", "--listen", "127.0.0.1:0", "--upstream", sim_url]
        proxy_args += ["--capture-dir", str(root / "proxy-captures")]
        proxy = start(dispatcher_cmd(*proxy_args), root / "proxy.log", root)
        procs.append(proxy)
        proxy_url = wait_for(proxy, LISTENING, 30).group(1)
        agent_port, head_port = free_port(), free_port()
        gym_args = _gym_args(gym_venv, model_server, proxy_url, root, (agent_port, head_port))
        gym = start(gym_args, root / "gym.log", root)
        procs.append(gym)
        wait_for(gym, READY, 240)
        tasks = site_packages(gym_venv) / "resources_servers/string_match/data/example.jsonl"
        yield GymStack(
            venv=gym_venv,
            root=root,
            agent_url=f"http://127.0.0.1:{agent_port}",
            head_port=head_port,
            gym_capture_dir=root / "gym-captures",
            proxy_capture_dir=root / "proxy-captures",
            sim_model_url=sim_url,
            tasks=tasks,
        )
    finally:
        for proc in reversed(procs):
            proc.stop()
