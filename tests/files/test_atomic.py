"""Atomic writes (files/writer.py ``write_atomic``): two writers of one file never
share a temporary file; readers see one whole version or the other."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from dispatcher.files import atomic
from dispatcher.files.atomic import WRITE_BYTES, temp_path, write_atomic, write_json_atomic
from dispatcher.serve import registry
from dispatcher.serve.registry import Registry


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


def test_a_small_file_is_one_write_and_a_stream_is_written_in_bounded_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A job's record and rows are a few small chunks: one write of the descriptor,
    # no file object (whose opening asks the kernel two more things). A long
    # stream of chunks is still written a piece at a time, never held whole.
    writes: list[int] = []
    real_write = os.write

    def write(fd: int, data: Any) -> int:
        writes.append(len(data))
        return real_write(fd, data)

    def fdopen(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("no file object")

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fdopen", fdopen)
    write_atomic(tmp_path / "job.json", [b'{"a":', b"1}", b"\n"], durable=False)
    assert writes == [8] and (tmp_path / "job.json").read_bytes() == b'{"a":1}\n'
    writes.clear()
    line = b"x" * 1000 + b"\n"
    write_atomic(tmp_path / "big.jsonl", (line for _ in range(1000)))
    assert (tmp_path / "big.jsonl").read_bytes() == line * 1000
    assert sum(writes) == len(line) * 1000
    assert max(writes) <= WRITE_BYTES + len(line) and len(writes) > 1


def test_folders_made_have_their_names_synced_in_their_parents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A name never synced in its parent may be gone after a power cut, with every
    # file synced inside it: the state directory, the journal's and the archive's
    # folders, a run's output directory.
    synced: list[Path] = []
    monkeypatch.setattr(atomic, "fsync_dir", synced.append)
    Registry(tmp_path / "new" / "state").lock()
    assert synced == [tmp_path, tmp_path / "new", tmp_path / "new" / "state"]
    synced.clear()
    atomic.make_dirs(tmp_path / "new")
    assert synced == []
