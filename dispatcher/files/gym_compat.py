"""Adopting an output directory that NeMo Gym's own collector wrote.

Gym writes the same ``X.jsonl``, ``X_failures.jsonl`` and
``X_materialized_inputs.jsonl`` as we do, but no ``X_manifest.json``. Without
a manifest, output rows normally stop a run (nothing proves they belong to it).
Gym's materialized inputs are that proof: when they hold exactly the rollouts
(task index, rollout index, request) this run materializes, the directory is
the same run, its rows and failures become ours, and resume goes on from them.
Any other difference is refused, naming what differs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import structlog

from dispatcher.errors import ConfigError
from dispatcher.tasks.keys import ROLLOUT_INDEX, TASK_INDEX

log = structlog.get_logger(__name__)

Signature = frozenset[tuple[int, int, str]]
BACKUP_SUFFIX = ".gym"


def gym_signature(materialized: Path) -> Signature | None:
    """What Gym's materialized inputs say the run is; None when there are none to read."""
    if not materialized.exists() or materialized.stat().st_size == 0:
        return None
    keys: set[tuple[int, int, str]] = set()
    with materialized.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                keys.add(_key(_loaded(line), materialized, number))
    return frozenset(keys)


def _loaded(line: bytes) -> Any:
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return None


def _key(row: Any, path: Path, number: int) -> tuple[int, int, str]:
    if not isinstance(row, dict):
        raise ConfigError(f"{path}:{number}: not a JSON object, so the run cannot be adopted")
    task, rollout = row.get(TASK_INDEX), row.get(ROLLOUT_INDEX)
    if not isinstance(task, int) or not isinstance(rollout, int):
        raise ConfigError(f"{path}:{number}: no _ng_task_index/_ng_rollout_index to adopt by")
    request = orjson.dumps(row.get("responses_create_params"), option=orjson.OPT_SORT_KEYS)
    return task, rollout, hashlib.sha256(request).hexdigest()


@contextlib.contextmanager
def adoption(materialized: Path, manifest: Path, gym: Signature | None) -> Iterator[None]:
    """Around materializing over Gym's file: keep Gym's aside, adopt the run when ours
    matches it, and put Gym's back on a mismatch or on any error, so a refused run
    leaves Gym's directory as it found it."""
    if gym is None:
        yield
        return
    backup = materialized.with_name(materialized.name + BACKUP_SUFFIX)
    os.replace(materialized, backup)
    try:
        yield
        _check_adoptable(gym, materialized, manifest)
    except BaseException:
        os.replace(backup, materialized)
        raise
    backup.unlink()
    log.info("gym_output_adopted", folder=str(materialized.parent), rollouts=len(gym))


def _check_adoptable(gym: Signature, materialized: Path, manifest: Path) -> None:
    ours = gym_signature(materialized) or frozenset()
    if ours == gym:
        return
    missing, extra = len(gym - ours), len(ours - gym)
    raise ConfigError(
        f"{materialized.parent}: output rows of a run without {manifest.name} (NeMo Gym's?) "
        "whose materialized inputs differ from this run's "
        f"({missing} of its rollouts not in this run, {extra} of this run's not in it); "
        "rerun with --fresh to move its files aside"
    )
