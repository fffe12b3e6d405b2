"""Rollout identity and keys (contracts §2): bounds that keep keys from colliding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dispatcher.errors import ConfigError
from dispatcher.settings.config import load_settings
from dispatcher.tasks.keys import (
    MAX_REPEATS,
    MAX_ROLLOUT_INDEX,
    MAX_TASK_INDEX,
    key_label,
    line_key,
    rollout_key,
    row_key,
    task_of,
)
from dispatcher.tasks.materialize import MaterializeSpec, materialize
from tests.helpers import run_cli, write_tasks

T, R = "_ng_task_index", "_ng_rollout_index"
BASE = {"input": "t.jsonl", "output": "o.jsonl", "agents": {"a": ["http://h:1"]}}


@pytest.mark.parametrize(
    ("task", "rollout"), [(0, 0), (3, 1), (7, MAX_ROLLOUT_INDEX), (MAX_TASK_INDEX, 5)]
)
def test_a_key_gives_back_its_task_and_label(task: int, rollout: int) -> None:
    key = row_key({T: task, R: rollout})
    assert key == rollout_key(task, rollout)
    assert task_of(key) == task
    assert key_label(key) == f"{task}-{rollout}"


def test_the_last_rollout_of_a_task_and_the_first_of_the_next_differ() -> None:
    assert row_key({T: 0, R: MAX_ROLLOUT_INDEX}) != row_key({T: 1, R: 0})


@pytest.mark.parametrize(
    "row",
    [
        {T: 0, R: MAX_ROLLOUT_INDEX + 1},  # would read as task 1, rollout 0
        {T: MAX_TASK_INDEX + 1, R: 0},
        {T: -1, R: 0},
        {T: True, R: 0},
        {T: 0},
    ],
)
def test_a_row_outside_the_bounds_has_no_key(row: dict[str, object]) -> None:
    assert row_key(row) is None


def test_num_repeats_is_bounded_by_the_key() -> None:
    assert load_settings({**BASE, "num_repeats": MAX_REPEATS}, env={}).num_repeats == MAX_REPEATS
    for value in (MAX_REPEATS + 1, {"a": MAX_REPEATS + 1, "_default": 1}):
        with pytest.raises(ConfigError) as info:
            load_settings({**BASE, "num_repeats": value}, env={})
        assert "config key 'num_repeats' (from --num-repeats)" in str(info.value)
        assert f"at most {MAX_REPEATS:,}" in str(info.value)


async def test_too_many_repeats_through_the_cli_is_exit_2(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "t.jsonl", 1)
    output = tmp_path / "out" / "o.jsonl"
    flag = await run_cli(
        "run", "--input", str(tasks), "--output", str(output), "--agent", "sim=http://127.0.0.1:9",
        "--num-repeats", str(MAX_REPEATS + 1),
    )  # fmt: skip
    config = tmp_path / "c.toml"
    config.write_text(f"num_repeats = {{ sim = {MAX_REPEATS + 1}, _default = 1 }}\n")
    from_file = await run_cli(
        "run", "--input", str(tasks), "--output", str(output), "--agent", "sim=http://127.0.0.1:9",
        "--config", str(config),
    )  # fmt: skip

    for result, source in ((flag, "--num-repeats"), (from_file, str(config))):
        assert result.returncode == 2
        [line] = result.stderr.strip().splitlines()
        assert f"config key 'num_repeats' (from {source})" in line
        assert f"at most {MAX_REPEATS:,}" in line
    assert not output.parent.exists()


def test_a_task_index_beyond_the_key_is_an_input_error(tmp_path: Path) -> None:
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(f'{{"agent_ref": {{"name": "a"}}, "{T}": {MAX_TASK_INDEX + 1}}}\n')
    spec = MaterializeSpec(
        input_path=tasks,
        agents=frozenset({"a"}),
        default_agent=None,
        num_repeats=1,
        limit=None,
        overrides={},
        skip_invalid_rows=False,
    )
    with pytest.raises(ConfigError, match=rf"t.jsonl:1: {T} must be at most"):
        materialize(spec, tmp_path / "m.jsonl")


@pytest.mark.parametrize("pad", [0, 2000])
def test_line_key_reads_short_and_long_lines_alike(pad: int) -> None:
    row = {T: 7, "big": 2**70, "text": "x" * pad, R: 2}
    line = json.dumps(row).encode() + b"\n"
    assert line_key(line) == rollout_key(7, 2)
    assert line_key(line[: len(line) // 2]) is None  # torn
    assert line_key(b"[1, 2]\n") is None
