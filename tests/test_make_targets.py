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


def gym_plan(tmp_path: Path, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gym" / "gym_env.py"), "--plan"],
        capture_output=True, text=True, check=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env},
    )  # fmt: skip
    return result.stdout.strip()


def test_make_test_says_what_it_does_about_the_gym_venv_before_pytest_runs() -> None:
    recipe = (ROOT / "Makefile").read_text().split("\ntest: ", 1)[1].split("\n\n", 1)[0]
    plan, pytest_line = recipe.index("gym_env.py --plan"), recipe.index("pytest ")
    assert plan < pytest_line
    assert " -rs " in recipe[pytest_line:]


def test_the_gym_plan_says_it_builds_and_how_to_skip(tmp_path: Path) -> None:
    fake = tmp_path / "python3.13"
    fake.write_text("#!/bin/sh\nexit 0\n")  # answers the version check as 3.13 would
    fake.chmod(0o755)
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
