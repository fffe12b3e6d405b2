"""A fold's tar (``serve/tarpack.py``): the bytes ``tarfile`` writes for the same folders,
and where each file's bytes are."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from dispatcher.serve import tarpack


def folder(root: Path, job_id: str, sizes: dict[str, int]) -> Path:
    path = root / job_id
    for name, size in sizes.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(bytes((i * 7 + len(name)) % 251 for i in range(size)))
    return path


def walked(path: Path) -> list[str]:
    """The folder's files in the fold's order: each folder's files, then its folders."""
    found = []
    for root, dirs, names in os.walk(path):
        dirs.sort()
        found += [str((Path(root) / name).relative_to(path)) for name in sorted(names)]
    return found


def by_tarfile(folders: list[tuple[str, Path]]) -> bytes:
    """The tar as ``tarfile`` writes it for these folders (the fold's former writer)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for job_id, path in folders:
            for name in walked(path):
                found = (path / name).stat()
                info = tarfile.TarInfo(f"{job_id}/{name}")
                info.size, info.mtime, info.mode = found.st_size, int(found.st_mtime), 0o644
                with (path / name).open("rb") as f:
                    tar.addfile(info, f)
    return out.getvalue()


def test_the_tar_is_the_one_tarfile_writes_and_says_where_each_file_is(tmp_path: Path) -> None:
    sizes = {"job.json": 300, "empty": 0, "block": 512, "over": 513, "a/nested.jsonl": 5000}
    # A name longer than a ustar header holds: a PAX header of its own.
    long_id = "job-" + "x" * 120
    folders = [
        ("group-0", folder(tmp_path, "group-0", sizes)),
        (long_id, folder(tmp_path, long_id, {"rollouts.jsonl": 70_000})),
    ]
    out = tmp_path / "x.tar"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        where = tarpack.write_tar(fd, folders)
    finally:
        os.close(fd)
    data = out.read_bytes()
    assert data == by_tarfile(folders)
    for (_, path), members in zip(folders, where, strict=True):
        for name, (offset, size) in members.items():
            assert data[offset : offset + size] == (path / name).read_bytes()
    assert list(where[0]) == ["block", "empty", "job.json", "over", "a/nested.jsonl"]


def test_a_tar_bigger_than_a_write_is_written_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tarpack, "WRITE_BYTES", 1024)
    monkeypatch.setattr(tarpack, "WRITE_PIECES", 4)
    # A system that takes at most 300 bytes a call: the rest of a piece goes next.
    real_writev = os.writev
    monkeypatch.setattr(
        tarpack.os, "writev", lambda fd, views: real_writev(fd, [bytes(b"".join(views)[:300])])
    )
    folders = [(f"g{n}", folder(tmp_path, f"g{n}", {"rows": 700 * n})) for n in range(6)]
    out = tmp_path / "x.tar"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        tarpack.write_tar(fd, folders)
    finally:
        os.close(fd)
    assert out.read_bytes() == by_tarfile(folders)
