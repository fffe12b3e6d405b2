"""The checks of a run's paths before anything is written (``run/prepare.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatcher.errors import ConfigError
from dispatcher.files.resume import OutputPaths
from dispatcher.files.writer import LineIndex
from dispatcher.run import prepare
from dispatcher.run.prepare import check_run_paths, prepare_and_open
from dispatcher.settings.config import RunSettings
from tests.helpers import write_tasks


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


@pytest.mark.parametrize("fsync", ["batch", "never"])
def test_a_rows_file_is_fsynced_before_its_index_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: str
) -> None:
    """What an index holds, a stream shows, and a stream shows only durable lines
    (contracts §12): a kill may have left a hop's last rows in the page cache only."""
    tasks, output = write_tasks(tmp_path / "tasks.jsonl", 2), tmp_path / "out" / "rows.jsonl"
    output.parent.mkdir()
    agents = {"sim": ["http://127.0.0.1:9"]}
    settings = RunSettings(input=tasks, output=output, agents=agents, fsync=fsync)  # type: ignore[arg-type]

    def open_and_close(indexes: tuple[LineIndex | None, LineIndex | None]) -> None:
        prepared, fds = prepare_and_open(settings, None, True, indexes, lambda _: None)
        prepared.lock.release()
        for fd in fds:
            os.close(fd)

    open_and_close((None, None))
    output.write_text('{"_ng_task_index": 0, "_ng_rollout_index": 0, "reward": 1.0}\n')
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(
        prepare, "fsync_file", lambda path: events.append(("fsync", Path(path).name))
    )
    real_load = LineIndex.load

    def load(index: LineIndex, path: Path) -> None:
        events.append(("load", Path(path).name))
        real_load(index, path)

    monkeypatch.setattr(LineIndex, "load", load)
    indexes = (LineIndex(), LineIndex())
    open_and_close(indexes)
    loads = [event for event in events if event[0] == "load"]
    assert loads == [("load", "rows.jsonl"), ("load", "rows_failures.jsonl")]
    synced = [("fsync", "rows.jsonl")] if fsync != "never" else []
    at = events.index(("load", "rows.jsonl"))
    assert [e for e in events[:at] if e == ("fsync", "rows.jsonl")] == synced
    assert len(indexes[0]) == 1
