"""Shards: split one run's tasks across machines by task index.

Shard ``K/N`` takes the tasks whose ``_ng_task_index % N == K``. All repeats
of a task land in the same shard, so pass@k over a shard's output is the same
as over the whole run's. Each shard writes its own output set, named by
``Shard.output_for``; ``dispatcher merge`` joins them back into one.

Where the shard comes from (``resolve_shard``):

- ``--shard K/N`` given explicitly;
- ``--shard auto``: a Slurm job array (``SLURM_ARRAY_TASK_ID`` relative to
  ``SLURM_ARRAY_TASK_MIN``, in steps of ``SLURM_ARRAY_TASK_STEP``, out of
  ``SLURM_ARRAY_TASK_COUNT``), else a Kubernetes indexed Job
  (``JOB_COMPLETION_INDEX`` out of ``DISPATCHER_SHARD_COUNT``, which the Job
  must set to its ``completions``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dispatcher.errors import ConfigError

SHARD_COUNT_ENV = "DISPATCHER_SHARD_COUNT"
"""Shard count for a Kubernetes indexed Job: set it to the Job's ``completions``."""

AUTO = "auto"

_SHARD_RE = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")
_SHARD_NAME_RE = re.compile(r"\.shard-(\d+)-of-(\d+)$")
# What a user may already have put in --output: ".shard-K" or ".shard-K-of-N".
_SHARD_TAG_RE = re.compile(r"\.shard-(\d+)(?:-of-(\d+))?$")


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count``: the tasks with ``task_index % count == index``."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ConfigError(f"shard {self.index}/{self.count}: need 0 <= K < N (K/N, N >= 1)")

    def contains(self, task_index: int) -> bool:
        return task_index % self.count == self.index

    def output_for(self, output: Path) -> Path:
        """This shard's ``--output``: ``X.jsonl`` -> ``X.shard-K-of-N.jsonl``.

        The shard tag goes before the suffix, so the sidecars of contracts §4
        follow it (``X.shard-0-of-4_failures.jsonl``, ...). An output that
        already names this shard (``X.shard-K.jsonl``, as a job script writes
        ``--output x.shard-$K.jsonl``) gets the full tag instead of a second
        one; one that names another shard is an error.
        """
        suffix = output.suffix or ".jsonl"
        stem = output.with_suffix("").name
        match = _SHARD_TAG_RE.search(stem)
        if match is not None:
            self._check_tag(output, int(match[1]), match[2])
            stem = stem[: match.start()]
        return output.with_name(f"{stem}.shard-{self.index}-of-{self.count}{suffix}")

    def _check_tag(self, output: Path, index: int, count: str | None) -> None:
        if index != self.index or (count is not None and int(count) != self.count):
            named = f"{index}" if count is None else f"{index}/{count}"
            raise ConfigError(
                f"--output {output} names shard {named}, but this run is shard {self}; "
                "name the output without a shard tag (one is added) or with this shard's"
            )

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(value: str) -> Shard:
    """Parse ``K/N`` (0 <= K < N)."""
    match = _SHARD_RE.match(value)
    if match is None:
        raise ConfigError(f"--shard {value!r}: expected K/N, e.g. 0/4")
    return Shard(int(match[1]), int(match[2]))


def shard_of_output(output: Path) -> Shard | None:
    """The shard an output path was named for by ``Shard.output_for``, if any."""
    match = _SHARD_NAME_RE.search(output.with_suffix("").name)
    if match is None:
        return None
    try:
        return Shard(int(match[1]), int(match[2]))
    except ConfigError:
        return None


def shard_from_env(env: Mapping[str, str]) -> Shard | None:
    """The shard a Slurm job array or a Kubernetes indexed Job assigns, else None."""
    if "SLURM_ARRAY_TASK_ID" in env:
        return _slurm_array_shard(env)
    if "JOB_COMPLETION_INDEX" in env or SHARD_COUNT_ENV in env:
        return _indexed_job_shard(env)
    return None


def resolve_shard(value: str | None, env: Mapping[str, str]) -> Shard | None:
    """``--shard`` as given: None (no sharding), ``auto`` (from the environment) or ``K/N``."""
    if value is None or not value.strip():
        return None
    if value.strip().lower() != AUTO:
        return parse_shard(value)
    shard = shard_from_env(env)
    if shard is None:
        raise ConfigError(
            "--shard auto: no shard in the environment (expected a Slurm job array, "
            f"or JOB_COMPLETION_INDEX with {SHARD_COUNT_ENV} in a Kubernetes indexed Job)"
        )
    return shard


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or not raw.strip():
        if default is None:
            raise ConfigError(f"shard from environment: {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"shard from environment: {name}={raw!r} is not an integer") from None


def _slurm_array_shard(env: Mapping[str, str]) -> Shard:
    task_id = _env_int(env, "SLURM_ARRAY_TASK_ID")
    count = _env_int(env, "SLURM_ARRAY_TASK_COUNT")
    first = _env_int(env, "SLURM_ARRAY_TASK_MIN", 0)
    step = _env_int(env, "SLURM_ARRAY_TASK_STEP", 1)
    offset = task_id - first
    if step < 1 or offset < 0 or offset % step:
        raise ConfigError(
            f"shard from Slurm array: task id {task_id} is not min {first} + a multiple of "
            f"step {step}; use a contiguous --array (e.g. 0-{count - 1}) or pass --shard K/N"
        )
    index = offset // step
    if index >= count:
        raise ConfigError(
            f"shard from Slurm array: task id {task_id} gives shard {index}, but the array has "
            f"{count} tasks; use a contiguous --array (e.g. 0-{count - 1}) or pass --shard K/N"
        )
    return Shard(index, count)


def _indexed_job_shard(env: Mapping[str, str]) -> Shard:
    index = _env_int(env, "JOB_COMPLETION_INDEX")
    count = _env_int(env, SHARD_COUNT_ENV)
    if not 0 <= index < count:
        raise ConfigError(
            f"shard from indexed Job: JOB_COMPLETION_INDEX={index} is outside "
            f"0..{SHARD_COUNT_ENV}-1={count - 1}; set {SHARD_COUNT_ENV} to the Job's completions"
        )
    return Shard(index, count)
