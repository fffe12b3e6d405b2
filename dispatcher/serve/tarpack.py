"""A fold's tar (``archive.py``): job folders as ``<job_id>/<file>`` members, the bytes
``tarfile`` writes for them (PAX format), and where each file's bytes are.

A fold runs in a thread beside the daemon's loop, and every system call it makes
gives the interpreter's lock away and waits to take it back from the loop. With
``tarfile`` a file was about seven (a buffered ``open``: its stat, tty check and
seek; two reads; the close) and the tar went out in small writes: a fold of
1,000 jobs of ten files each took the lock back some 70,000 times. Here a file
is four calls (open, stat, read, close), and the tar is written a MiB at a time,
by one ``writev`` of the pieces already in memory (the files' bytes as read, their
headers, their padding): no buffer is grown and copied into, whose reallocations
left the daemon's heap fragmented after every fold.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from dispatcher.files.writer import writev_all

# The tar is written in pieces of about this size, each one ``writev`` of at most
# ``WRITE_PIECES`` buffers (the system's bound is 1,024).
WRITE_BYTES = 1 << 20
WRITE_PIECES = 512
_ZEROS = bytes(2 * tarfile.RECORDSIZE)


def write_tar(out: int, folders: Iterable[tuple[str, Path]]) -> list[dict[str, list[int]]]:
    """Each ``(job_id, folder)``'s files as members of the tar written to the file
    descriptor ``out`` (blocking); for each folder, where each of its files' bytes
    are in the tar: ``{name: [offset, size]}``."""
    where: list[dict[str, list[int]]] = []
    pieces: list[bytes] = []
    written = pending = 0
    for job_id, folder in folders:
        members: dict[str, list[int]] = {}
        for name in _files(folder):
            data, mtime = _read(folder / name)
            info = tarfile.TarInfo(f"{job_id}/{name}")
            info.size, info.mtime, info.mode = len(data), int(mtime), 0o644
            header = info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
            members[name] = [written + pending + len(header), len(data)]
            padding = _ZEROS[: -len(data) % tarfile.BLOCKSIZE]
            pieces += (header, data, padding)
            pending += len(header) + len(data) + len(padding)
            if pending >= WRITE_BYTES or len(pieces) >= WRITE_PIECES:
                writev_all(out, pieces)
                written, pending, pieces = written + pending, 0, []
        where.append(members)
    # The end of the archive: two zero blocks, then zeros to a whole record.
    end = written + pending + 2 * tarfile.BLOCKSIZE
    pieces.append(_ZEROS[: 2 * tarfile.BLOCKSIZE + -end % tarfile.RECORDSIZE])
    writev_all(out, pieces)
    return where


def _files(folder: Path) -> Iterator[str]:
    """The files of a job's folder, their names relative to it, sorted."""
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names):
            yield str((Path(root) / name).relative_to(folder))


def _read(path: Path) -> tuple[bytes, float]:
    """A file's bytes and its modification time."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        found = os.fstat(fd)
        data = os.read(fd, found.st_size)
        while len(data) < found.st_size:
            more = os.read(fd, found.st_size - len(data))
            if not more:
                raise OSError(f"{path}: shorter than its size while it was archived")
            data += more
        return data, found.st_mtime
    finally:
        os.close(fd)
