"""The checks of a run's paths before anything is written (``run/prepare.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatcher.errors import ConfigError
from dispatcher.files.resume import OutputPaths
from dispatcher.run.prepare import check_run_paths


def test_a_run_file_that_is_the_task_file_through_a_symlinked_folder_is_refused(
    tmp_path: Path,
) -> None:
    tasks = tmp_path / "data" / "x_coverage.json"
    tasks.parent.mkdir()
    tasks.write_bytes(b"{}\n")
    # The output's folder is the task file's, by another name.
    (tmp_path / "out").symlink_to(tmp_path / "data")
    paths = OutputPaths.for_output(tmp_path / "out" / "x.jsonl")
    with pytest.raises(ConfigError, match="the same file as"):
        check_run_paths(tasks, paths)


def test_the_paths_check_takes_a_stat_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A served job's start checks its paths: one stat of each run file and the
    # task file's, not a stat per component of every path resolved.
    tasks = tmp_path / "a" / "b" / "c" / "input.jsonl"
    tasks.parent.mkdir(parents=True)
    tasks.write_bytes(b"{}\n")
    paths = OutputPaths.for_output(tasks.parent / "rollouts.jsonl")
    paths.output.write_bytes(b"")
    calls: list[str] = []
    real_stat, real_lstat = os.stat, os.lstat

    def stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        calls.append(str(path))
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    def lstat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        calls.append(str(path))
        return real_lstat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(os, "lstat", lstat)
    check_run_paths(tasks, paths)
    assert len(calls) <= len(paths.all()) + 1, calls
