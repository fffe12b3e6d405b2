"""What `make test` and `make demo` tell a newcomer before and while they run."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def gym_env(tmp_path: Path, mode: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gym" / "gym_env.py"), mode],
        capture_output=True, text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env},
    )  # fmt: skip


def gym_plan(tmp_path: Path, **env: str) -> str:
    result = gym_env(tmp_path, "--plan", **env)
    assert result.returncode == 0
    return result.stdout.strip()


def fake_python313(tmp_path: Path) -> Path:
    fake = tmp_path / "python3.13"
    fake.write_text("#!/bin/sh\nexit 0\n")  # answers the version check as 3.13 would
    fake.chmod(0o755)
    return fake


def test_make_test_builds_the_gym_venv_before_pytest_runs() -> None:
    # Built inside a test, the venv's minutes of downloads ran under the per-test
    # timeout: a fresh machine's first `make test` failed 21 Gym tests on it.
    recipe = (ROOT / "Makefile").read_text().split("\ntest: ", 1)[1].split("\n\n", 1)[0]
    prepare, pytest_line = recipe.index("gym_env.py --prepare"), recipe.index("pytest ")
    assert prepare < pytest_line
    assert " -rs " in recipe[pytest_line:]


def test_preparing_says_the_plan_then_builds_and_a_failed_build_says_how_to_skip(
    tmp_path: Path,
) -> None:
    fake = fake_python313(tmp_path)  # its venv never appears: the build fails
    result = gym_env(tmp_path, "--prepare", ROLLOUT_DISPATCHER_PYTHON313=str(fake))
    assert result.returncode == 1
    assert result.stdout.startswith("NeMo Gym tests: building a NeMo Gym 0.7.0 venv")
    [said] = result.stderr.splitlines()
    assert said.startswith("the NeMo Gym 0.7.0 venv could not be built (")
    assert said.endswith("`make test ROLLOUT_DISPATCHER_SKIP_GYM=1` skips the NeMo Gym tests")


def test_preparing_builds_nothing_when_the_gym_tests_will_skip(tmp_path: Path) -> None:
    for env in ({"ROLLOUT_DISPATCHER_SKIP_GYM": "1"},
                {"ROLLOUT_DISPATCHER_PYTHON313": str(tmp_path / "none")}):  # fmt: skip
        result = gym_env(tmp_path, "--prepare", **env)
        assert (result.returncode, result.stderr) == (0, "")
        assert result.stdout.startswith("NeMo Gym tests: skipped")
    assert not (tmp_path / ".cache").exists()


def test_the_gym_plan_says_it_builds_and_how_to_skip(tmp_path: Path) -> None:
    fake = fake_python313(tmp_path)
    said = gym_plan(tmp_path, ROLLOUT_DISPATCHER_PYTHON313=str(fake))
    assert said.startswith(f"NeMo Gym tests: building a NeMo Gym 0.7.0 venv with {fake} in ")
    assert "`make test ROLLOUT_DISPATCHER_SKIP_GYM=1` skips these tests instead" in said


def test_the_gym_plan_says_when_it_skips(tmp_path: Path) -> None:
    said = gym_plan(tmp_path, ROLLOUT_DISPATCHER_SKIP_GYM="1")
    assert said == "NeMo Gym tests: skipped ($ROLLOUT_DISPATCHER_SKIP_GYM is set)"
    said = gym_plan(tmp_path, ROLLOUT_DISPATCHER_PYTHON313=str(tmp_path / "none"))
    assert said.startswith("NeMo Gym tests: skipped, no Python 3.13 found")


@pytest.fixture
def demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("demo", ROOT / "scripts" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_prints_each_command_as_it_can_be_copied(
    demo: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["run", "--input", "tasks file.jsonl", "--agent", "a=http://127.0.0.1:1,http://x:2"]
    demo._say(args, tmp_path / "run.log")
    line = capsys.readouterr().out.strip()
    assert line.startswith("$ ")
    words = shlex.split(line[2:])
    assert Path(words[0]).name == "dispatcher"
    assert words[1:] == [*args, "2>", str(tmp_path / "run.log")]
