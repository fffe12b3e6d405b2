"""docs/capture.md's NeMo Gym deployments of the capture proxy, run as written
against a real Gym 0.7.0 stack.

In front of several Gym model servers: Gym's agent calls the proxy, whose
``--upstream``s are two Gym ``vllm_model`` servers, each in front of a
``sim-model`` of its own (the engines). Then, on the same stack, the proxy of
the router example, with a ``sim-model`` reached directly in the router's
place (no router that reads the headers is a test dependency; a stand-in
router runs the example in tests/test_readme_commands.py).

Only what cannot exist here is replaced, each replacement matching the text:
the engines' hosts become sim-models, fixed ports free ones; the Gym command
gets what running offline needs (``+uv_venv_dir``/``+skip_venv_if_present``)
and runs in a directory laid out as a Gym checkout.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from tests.gym.conftest import (
    GYM_GRACE_S,
    LISTENING,
    READY,
    Proc,
    _venv_links,
    dispatcher_cmd,
    free_port,
    site_packages,
    wait_for,
)
from tests.helpers import indented_blocks, read_jsonl, wait_until

ROOT = Path(__file__).resolve().parents[2]
SECTION = "\n### Where the proxy sits in a NeMo Gym deployment\n"
TASKS = 5  # Gym's string_match example.jsonl
REPEATS = 4  # the docs' --num-repeats
METRIC = re.compile(r'^(dispatcher_capture_upstream_\w+)\{upstream="([^"]+)"\} (\S+)$', re.M)


def section_blocks() -> list[str]:
    """The section's indented code blocks, in order."""
    text = (ROOT / "docs" / "capture.md").read_text().split(SECTION, 1)[1]
    return indented_blocks(re.split(r"\n#{2,3} ", text, maxsplit=1)[0])


def test_the_deployment_blocks_are_found() -> None:
    proxy, gym, run, router_proxy = section_blocks()
    assert proxy.startswith("dispatcher capture-proxy") and proxy.count("--upstream") == 2
    assert gym.startswith("cat > replica_1.yaml") and "gym env start" in gym
    assert run.startswith("dispatcher run --gym-head-server") and "--capture-proxy-url" in run
    assert "--upstream http://router:8000" in router_proxy


def replaced(text: str, changes: dict[str, str]) -> str:
    for old, new in changes.items():
        assert old in text, f"the example no longer says {old!r}"
        text = text.replace(old, new)
    return text


def _start(script: str, log: Path, cwd: Path, env: dict[str, str], grace_s: float = 15) -> Proc:
    with log.open("wb") as out:
        popen = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", script], stdout=out, stderr=subprocess.STDOUT,
            cwd=cwd, env=env, start_new_session=True,
        )  # fmt: skip
    return Proc(popen, log, grace_s)


def _shell(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as answer:
        body: bytes = answer.read()
        return body


def _upstream_metrics(proxy_url: str) -> dict[str, dict[str, float]]:
    """``/ng-metrics``'s per-upstream figures: {metric: {upstream: value}}."""
    found: dict[str, dict[str, float]] = defaultdict(dict)
    for name, upstream, value in METRIC.findall(_get(f"{proxy_url}/ng-metrics").decode()):
        found[name][upstream] = float(value)
    return found


def _live_sessions(proxy_url: str) -> float:
    return sum(_upstream_metrics(proxy_url)["dispatcher_capture_upstream_sessions"].values())


def _stats(engine_url: str) -> dict[str, int]:
    stats: dict[str, int] = orjson.loads(_get(f"{engine_url}/stats"))
    return stats


def _captures(capture_dir: Path) -> dict[str, list[dict[str, object]]]:
    """Each rollout's capture records, by rollout id."""
    return {
        path.name.removesuffix(".capture.jsonl"): read_jsonl(path)
        for path in sorted(capture_dir.glob("*.capture.jsonl"))
    }


def _wait(condition: Callable[[], bool]) -> None:
    asyncio.run(wait_until(condition, timeout_s=30, step_s=0.1))


@dataclass
class Deployment:
    """The docs' deployment on 127.0.0.1: two engines, the proxy and a Gym stack."""

    work: Path
    env: dict[str, str]
    logs: Path
    procs: list[Proc] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    proxy_port: int = field(default_factory=free_port)
    head_port: int = field(default_factory=free_port)
    model_ports: list[int] = field(default_factory=lambda: [free_port(), free_port()])

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    @property
    def model_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.model_ports]

    def spawn(self, script: str, name: str, grace_s: float = 15) -> Proc:
        self.procs.append(_start(script, self.logs / f"{name}.log", self.work, self.env, grace_s))
        return self.procs[-1]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def run(self, run_block: str, *changes: tuple[str, str]) -> list[dict[str, Any]]:
        """The docs' `dispatcher run` (with ``changes``): its rows."""
        script = replaced(run_block, {
            "127.0.0.1:11000": f"127.0.0.1:{self.head_port}",
            "http://127.0.0.1:8100": self.proxy_url,
            **dict(changes),
        })  # fmt: skip
        ran = _shell(script, self.work, self.env)
        assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
        output = re.search(r"--output (\S+)", script)
        assert output is not None
        return read_jsonl(self.work / output.group(1))


def _deployment(gym_venv: Path, tmp_path: Path) -> Deployment:
    work = tmp_path / "work"
    work.mkdir()
    # A Gym checkout's layout: its servers, their configs and example tasks.
    for kind in ("resources_servers", "responses_api_models"):
        (work / kind).symlink_to(site_packages(gym_venv) / kind)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISPATCHER_", "NEMO_GYM_"))}
    env["PATH"] = f"{Path(sys.executable).parent}:{gym_venv / 'bin'}:{env['PATH']}"
    return Deployment(work, env, tmp_path)


def _start_stack(deployment: Deployment, gym_venv: Path, proxy_block: str, gym_block: str) -> Proc:
    """The engines, the docs' proxy in front of the Gym model servers, and the docs' Gym
    stack; the proxy's process."""
    # The engines and the proxy (whose upstreams are the Gym model servers' ports) start at once.
    command = " ".join(dispatcher_cmd("sim-model", "--listen", "127.0.0.1:0"))
    engines = [deployment.spawn(command, f"e{i}") for i in range(2)]
    proxy_script = replaced(proxy_block, {
        "127.0.0.1:8100": f"127.0.0.1:{deployment.proxy_port}",
        "http://127.0.0.1:8001": deployment.model_urls[0],
        "http://127.0.0.1:8002": deployment.model_urls[1],
    })  # fmt: skip
    proxy = deployment.spawn(proxy_script, "proxy")
    deployment.engines += [wait_for(engine, LISTENING, 30)[1] for engine in engines]
    wait_for(proxy, LISTENING, 30)
    gym_script = replaced(gym_block, {
        "http://127.0.0.1:8100": deployment.proxy_url,
        "http://vllm-0:8000": deployment.engines[0],
        "http://vllm-1:8000": deployment.engines[1],
        "port=8001": f"port={deployment.model_ports[0]}",
        "port=8002": f"port={deployment.model_ports[1]}",
        "port=11000": f"port={deployment.head_port}",
    })  # fmt: skip
    links = _venv_links(deployment.logs, gym_venv)
    offline = f" +uv_venv_dir={links} +skip_venv_if_present=true"
    wait_for(deployment.spawn(gym_script.rstrip() + offline, "gym", GYM_GRACE_S), READY, 240)
    return proxy


def _check_in_front_of_gym_model_servers(
    deployment: Deployment, rows: list[dict[str, Any]]
) -> None:
    assert len(rows) == TASKS * REPEATS
    captures = _captures(deployment.work / "runs" / "step1" / "captures")
    assert set(captures) == {row["_ng_rollout_id"] for row in rows}
    # Every row has its model calls; every call the engines answered was captured.
    for row in rows:
        capture = row["ng_model_call_capture"]
        assert capture["metrics"]["num_calls"] == len(captures[row["_ng_rollout_id"]]) >= 1
    records = [record for found in captures.values() for record in found]
    assert sum(_stats(url)["requests"] for url in deployment.engines) == len(records)
    calls = _upstream_metrics(deployment.proxy_url)["dispatcher_capture_upstream_calls_total"]
    assert calls == {
        url: sum(r["upstream"] == url for r in records) for url in deployment.model_urls
    }
    # The repeats of a task went to one Gym model server; both served.
    by_task: dict[int, set[object]] = defaultdict(set)
    for row in rows:
        by_task[row["_ng_task_index"]] |= {r["upstream"] for r in captures[row["_ng_rollout_id"]]}
    assert len(by_task) == TASKS and all(len(ups) == 1 for ups in by_task.values()), by_task
    assert set().union(*by_task.values()) == set(deployment.model_urls)
    # Sessions released as the rollouts ended.
    _wait(lambda: _live_sessions(deployment.proxy_url) == 0)
    # Gym's model servers got the calls without /ng-rollout/<id>/ (nothing in Gym's
    # capture directory), and their engines none of the identity headers.
    assert not list((deployment.work / "runs" / "step1" / "gym-captures").glob("*"))
    assert [_stats(url)["with_identity"] for url in deployment.engines] == [0, 0]


def test_the_proxy_in_front_of_gym_model_servers_runs_as_written(
    no_shared_stack: None, gym_venv: Path, tmp_path: Path
) -> None:
    proxy_block, gym_block, run_block, router_block = section_blocks()
    deployment = _deployment(gym_venv, tmp_path)
    try:
        proxy = _start_stack(deployment, gym_venv, proxy_block, gym_block)
        _check_in_front_of_gym_model_servers(deployment, deployment.run(run_block))

        # The router example on the same agents: the agents' model URL is its port, and
        # an engine answers in the router's place (Gym's /v1/responses calls included).
        proxy.stop()
        engine = deployment.engines[0]
        router_script = replaced(router_block, {
            "127.0.0.1:8200": f"127.0.0.1:{deployment.proxy_port}",
            "http://router:8000": engine,
            "runs/step1": "runs/step2",
        })  # fmt: skip
        router_proxy = deployment.spawn(router_script, "router-proxy")
        wait_for(router_proxy, LISTENING, 30)
        before = _stats(engine)
        rows = deployment.run(run_block, ("runs/step1", "runs/step2"))

        assert len(rows) == TASKS * REPEATS
        captures = _captures(deployment.work / "runs" / "step2" / "captures")
        assert set(captures) == {row["_ng_rollout_id"] for row in rows}
        calls = sum(len(records) for records in captures.values())
        after = _stats(engine)
        # Every call reached the engine with both identity headers.
        assert after["requests"] - before["requests"] == calls
        assert after["with_identity"] - before["with_identity"] == calls
        # Each rollout's release reached the engine's /release (which refuses it).
        _wait(lambda: router_proxy.text().count('"session_release_refused"') == len(rows))
    finally:
        deployment.stop()
