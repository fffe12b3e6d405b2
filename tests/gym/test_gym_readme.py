"""The README's five-minute path from ``gym env start`` to ``dispatcher run
--gym-head-server``, run as written against a real Gym 0.7.0 stack.

Its Gym command is the one thing that starts a stack of its own (the README's
command is what is under test). The test adds only what running offline
needs: ``+uv_venv_dir``/``+skip_venv_if_present`` (Gym reuses its venv instead
of building one per server) and, for the policy, our ``sim-model``. The
commands run in a directory that holds Gym's ``resources_servers`` as a Gym
checkout does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.gym.conftest import (
    GYM_GRACE_S,
    LISTENING,
    READY,
    Proc,
    _venv_links,
    dispatcher_cmd,
    free_port,
    site_packages,
    start,
    wait_for,
)
from tests.helpers import indented_blocks, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
SECTION = "\n## A NeMo Gym agent in five minutes\n"


def readme_blocks() -> list[str]:
    """The section's indented code blocks, in order."""
    text = (ROOT / "README.md").read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    return indented_blocks(text)


def test_the_readme_blocks_are_found() -> None:
    gym, run, trainer = readme_blocks()
    assert "gym env start" in gym and gym.startswith("HEAD=")
    assert "dispatcher run --gym-head-server $HEAD" in run
    assert trainer.startswith("import asyncio") and "run_examples(" in trainer


def shell(script: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_five_minute_path_runs_as_written(
    no_shared_stack: None, gym_venv: Path, tmp_path: Path
) -> None:
    gym_block, run_block, trainer_block = readme_blocks()
    work = tmp_path / "work"
    work.mkdir()
    # A Gym checkout's layout: the example tasks under resources_servers/.
    (work / "resources_servers").symlink_to(site_packages(gym_venv) / "resources_servers")
    procs: list[Proc] = []
    try:
        sim = start(
            dispatcher_cmd("sim-model", "--listen", "127.0.0.1:0"), tmp_path / "sim.log", work
        )
        procs.append(sim)
        env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}:{gym_venv / 'bin'}:{os.environ['PATH']}",
            "GYM_HEAD_SERVER": f"127.0.0.1:{free_port()}",
            "POLICY_BASE_URL": wait_for(sim, LISTENING, 30).group(1) + "/v1",
            "POLICY_API_KEY": "sim",
            "POLICY_MODEL_NAME": "sim-model",
        }
        env = {k: v for k, v in env.items() if not k.startswith("DISPATCHER_")}
        offline = f" +uv_venv_dir={_venv_links(tmp_path, gym_venv)} +skip_venv_if_present=true"
        gym_args = ["bash", "-euo", "pipefail", "-c", gym_block.rstrip() + offline]
        gym = _start_with_env(gym_args, tmp_path / "gym.log", work, env, GYM_GRACE_S)
        procs.append(gym)
        wait_for(gym, READY, 240)
        assert "servers ready" in gym.text()

        ran = shell(run_block, env, work)
        assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
        rows = read_jsonl(work / "runs" / "first" / "rollouts.jsonl")
        assert len(rows) == 10 and {r["agent_ref"]["name"] for r in rows} == {
            "string_match_simple_agent"
        }

        serve_args = ["serve", "--gym-head-server", env["GYM_HEAD_SERVER"]]
        serve_args += ["--state-dir", "serve-state", "--listen", "127.0.0.1:0"]
        daemon = _start_with_env(dispatcher_cmd(*serve_args), tmp_path / "serve.log", work, env)
        procs.append(daemon)
        url = wait_for(daemon, LISTENING, 60).group(1)
        trainer = subprocess.run(
            [sys.executable, "-c", trainer_block], env={**env, "DISPATCHER_URL": url},
            cwd=work, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert trainer.returncode == 0, trainer.stderr[-3000:]
        lines = trainer.stdout.splitlines()
        assert len(lines) == 5 and all(re.fullmatch(r"reward [01]\.0: .+", x) for x in lines)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _start_with_env(
    args: list[str], log: Path, cwd: Path, env: dict[str, str], grace_s: float = 15
) -> Proc:
    with log.open("wb") as out:
        popen = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True
        )
    return Proc(popen, log, grace_s)
