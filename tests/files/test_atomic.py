"""Atomic writes (files/writer.py ``write_atomic``): two writers of one file never
share a temporary file; readers see one whole version or the other."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from dispatcher.files.atomic import temp_path, write_atomic, write_json_atomic
from dispatcher.serve import registry


def test_two_writers_of_one_file_each_write_whole_through_their_own_temporary(
    tmp_path: Path,
) -> None:
    # The second writer runs while the first is half-way (as a thread would):
    # with one fixed temporary name it truncated and renamed the first's file.
    path = tmp_path / "manifest.json"
    first = {"writer": "first", "pad": "x" * 100_000}

    def chunks() -> Iterator[bytes]:
        data = orjson.dumps(first)
        yield data[:50_000]
        write_json_atomic(path, {"writer": "second"})
        yield data[50_000:]

    write_atomic(path, chunks())
    assert orjson.loads(path.read_bytes()) == first
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "job.json"
    write_atomic(path, [b"old"])

    def broken() -> Iterator[bytes]:
        yield b"new, half"
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_atomic(path, broken())
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["job.json"]


def test_a_submission_cut_in_its_atomic_writes_is_known_by_its_temporaries(
    tmp_path: Path,
) -> None:
    # A kill between a job's rows and its record leaves their temporaries: the
    # folder is reused, not taken for a job's files.
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / registry.ROWS_FILE).write_bytes(b"{}\n")
    temp_path(folder / "job.json").write_bytes(b"{")
    temp_path(folder / registry.ROWS_FILE).write_bytes(b"{")
    assert not registry._holds_files(folder)
    (folder / "rollouts.jsonl").write_bytes(b"{}\n")
    assert registry._holds_files(folder)
