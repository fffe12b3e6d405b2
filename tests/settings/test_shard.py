"""Shards: K/N parsing, task membership, output naming, and the scheduler's variables."""

from __future__ import annotations

from pathlib import Path

import pytest

from dispatcher.errors import ConfigError
from dispatcher.files.resume import OutputPaths
from dispatcher.settings.shard import (
    Shard,
    parse_shard,
    resolve_shard,
    shard_from_env,
    shard_of_output,
)


@pytest.mark.parametrize(
    ("text", "index", "count"), [("0/4", 0, 4), ("3/4", 3, 4), (" 0 / 1 ", 0, 1)]
)
def test_parse_shard_accepts_k_of_n(text: str, index: int, count: int) -> None:
    assert parse_shard(text) == Shard(index, count)


@pytest.mark.parametrize("text", ["4/4", "-1/4", "1/0", "1", "a/b", "1/2/3", ""])
def test_parse_shard_rejects_bad_values(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_shard(text)


def test_shards_partition_the_tasks() -> None:
    shards = [Shard(k, 3) for k in range(3)]
    for task in range(30):
        assert sum(s.contains(task) for s in shards) == 1
    assert Shard(1, 3).contains(4)
    assert not Shard(1, 3).contains(5)


def test_output_for_names_the_whole_set() -> None:
    shard = Shard(2, 8)
    out = shard.output_for(Path("runs/rollouts.jsonl"))
    assert out == Path("runs/rollouts.shard-2-of-8.jsonl")
    paths = OutputPaths.for_output(out)
    assert paths.failures == Path("runs/rollouts.shard-2-of-8_failures.jsonl")
    assert paths.materialized == Path("runs/rollouts.shard-2-of-8_materialized_inputs.jsonl")
    assert shard_of_output(out) == shard
    assert shard_of_output(Path("runs/rollouts.jsonl")) is None
    assert Shard(0, 2).output_for(Path("plain")) == Path("plain.shard-0-of-2.jsonl")


def test_slurm_array_counts_from_its_minimum() -> None:
    env = {"SLURM_ARRAY_TASK_ID": "12", "SLURM_ARRAY_TASK_MIN": "10", "SLURM_ARRAY_TASK_COUNT": "4"}
    assert shard_from_env(env) == Shard(2, 4)


def test_slurm_array_with_step() -> None:
    env = {
        "SLURM_ARRAY_TASK_ID": "4",
        "SLURM_ARRAY_TASK_MIN": "0",
        "SLURM_ARRAY_TASK_STEP": "2",
        "SLURM_ARRAY_TASK_COUNT": "3",
    }
    assert shard_from_env(env) == Shard(2, 3)


@pytest.mark.parametrize(
    "env",
    [
        {"SLURM_ARRAY_TASK_ID": "1"},  # no count
        {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_COUNT": "3"},  # sparse --array=1,3,7
        {"SLURM_ARRAY_TASK_ID": "x", "SLURM_ARRAY_TASK_COUNT": "3"},
    ],
)
def test_slurm_array_errors(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        shard_from_env(env)


def test_indexed_job() -> None:
    env = {"JOB_COMPLETION_INDEX": "3", "DISPATCHER_SHARD_COUNT": "5"}
    assert shard_from_env(env) == Shard(3, 5)
    with pytest.raises(ConfigError, match="DISPATCHER_SHARD_COUNT"):
        shard_from_env({"JOB_COMPLETION_INDEX": "3"})
    with pytest.raises(ConfigError, match="outside"):
        shard_from_env({"JOB_COMPLETION_INDEX": "5", "DISPATCHER_SHARD_COUNT": "5"})


def test_no_scheduler_variables_means_no_shard() -> None:
    assert shard_from_env({"SLURM_JOB_ID": "1", "HOME": "/"}) is None


def test_resolve_shard() -> None:
    env = {"JOB_COMPLETION_INDEX": "1", "DISPATCHER_SHARD_COUNT": "2"}
    assert resolve_shard(None, env) is None
    assert resolve_shard("auto", env) == Shard(1, 2)
    assert resolve_shard("0/3", env) == Shard(0, 3)
    with pytest.raises(ConfigError, match="no shard in the environment"):
        resolve_shard("auto", {})


@pytest.mark.parametrize("name", ["x.shard-3.jsonl", "x.shard-3-of-8.jsonl", "x.jsonl"])
def test_output_that_names_its_shard_gets_one_tag(name: str) -> None:
    # A job script's `--output out/x.shard-$K.jsonl --shard auto` used to give
    # x.shard-3.shard-3-of-8.jsonl.
    assert Shard(3, 8).output_for(Path("out") / name) == Path("out/x.shard-3-of-8.jsonl")


@pytest.mark.parametrize("name", ["x.shard-2.jsonl", "x.shard-3-of-4.jsonl"])
def test_output_that_names_another_shard_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="names shard"):
        Shard(3, 8).output_for(Path(name))
