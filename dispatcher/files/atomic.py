"""Files written whole (contracts §4): the run lock, atomic replacement through a
unique temporary name, the manifest, moving a finished run's files aside, and
folders removed whole.

A file replaced atomically is written under a temporary name of its own (two
writers never share one), fsynced, renamed over its target and its directory
fsynced: a reader sees the old file or the new one, never a part.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson
import structlog
from pydantic import ValidationError

from dispatcher import jsonx
from dispatcher.errors import ConfigError
from dispatcher.files.contracts import RunManifest
from dispatcher.files.resume import OutputPaths

log = structlog.get_logger(__name__)

# Folders one ``rm`` removes (its arguments stay far below the system's bound).
RM_FOLDERS = 512


class RunLock:
    """An exclusive ``flock`` on ``X_run.lock`` for the whole run; it dies with the process."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self.created = False

    def acquire(self) -> None:
        self.created = not self.path.exists()
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConfigError(f"{self.path}: cannot create the run lock: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise ConfigError(
                f"{self.path}: another dispatcher{holder} is already running on this output"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self, *, remove: bool = False) -> None:
        if self._fd is None:
            return
        if remove:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        os.close(self._fd)
        self._fd = None


# What ``write_atomic`` gathers of its chunks before each write.
WRITE_BYTES = 64 * 1024


def _read_pid(fd: int) -> str:
    try:
        pid = os.pread(fd, 32, 0).decode().strip()
    except OSError:
        return ""
    return f" (pid {pid})" if pid.isdigit() else ""


TEMP_SUFFIX = ".tmp"


def temp_path(path: Path) -> Path:
    """A name no other write uses, beside ``path`` (a rename stays in one filesystem):
    ``.NAME.<random>.tmp``, hidden, and known by ``is_temp_of``."""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}{TEMP_SUFFIX}")


def is_temp_of(name: str, target: str) -> bool:
    """Whether ``name`` is a temporary file of a write to ``target`` (``temp_path``)."""
    return name.startswith(f".{target}.") and name.endswith(TEMP_SUFFIX)


def _replace(tmp: Path, path: Path) -> None:
    try:
        os.replace(tmp, path)
    except OSError as exc:
        # Name the file that could not be replaced, not the temporary.
        raise type(exc)(exc.errno, exc.strerror, str(path)) from exc


def _create_temp(path: Path) -> tuple[Path, int]:
    while True:
        tmp = temp_path(path)
        try:
            # O_EXCL: a name taken (never, at 48 random bits) is never shared.
            # Mode 0o666 under the umask, as a plain open would give the file.
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
            return tmp, os.open(tmp, flags, 0o666)
        except FileExistsError:
            continue


def write_json_atomic(path: Path, data: Mapping[str, Any], *, durable: bool = True) -> None:
    """``data`` as indented JSON, written atomically (``write_atomic``)."""
    text = jsonx.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
    write_atomic(path, [text], durable=durable)


def write_atomic(path: Path, chunks: Iterable[bytes], *, durable: bool = True) -> None:
    """Write, fsync, rename, fsync the directory (blocking): readers see the old
    file or the new one, never a part. ``durable=False`` skips both fsyncs, for a
    file that something already durable can write again after a crash (the
    service's journal of submissions): readers still see it whole or not at all.

    Each write has a temporary file of its own (``temp_path``): two writers of one
    file (a thread and the loop, two processes) each rename a whole file, the last
    one wins; with one fixed name the second truncated and renamed the first's.
    """
    tmp, fd = _create_temp(path)
    try:
        try:
            # Written in pieces of WRITE_BYTES to the descriptor itself: a file object
            # over it asked the kernel two more things (is it a terminal, where is it)
            # for every small file written.
            held: list[bytes] = []
            size = 0
            for chunk in chunks:
                held.append(chunk)
                size += len(chunk)
                if size >= WRITE_BYTES:
                    write_fully(fd, b"".join(held))
                    held, size = [], 0
            if held:
                write_fully(fd, b"".join(held))
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        _replace(tmp, path)
    except BaseException:
        # A full disk must not leave a half-written temporary file taking its space.
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(path.parent)


def write_fully(fd: int, data: bytes | bytearray | memoryview) -> None:
    """All of ``data`` to ``fd``: ``os.write`` may take part of it (a pipe, a signal)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def fsync_file(path: Path) -> None:
    """Make a file's written bytes durable (blocking)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (names created, renamed, removed) durable."""
    fsync_file(path)


def make_dirs(folder: Path) -> None:
    """``folder`` and its missing parents made, each new one's name made durable in its
    parent (blocking): a power cut must not take a folder, and the files synced in
    it, away with a name never synced. One made meanwhile by another is theirs."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    if not missing and not folder.is_dir():
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(folder))
    for new in reversed(missing):
        try:
            new.mkdir()
        except FileExistsError:
            continue
        fsync_dir(new.parent)


def read_manifest(path: Path) -> RunManifest | None:
    """The manifest a run resumes from (None when absent); a bad one is a ``ConfigError``."""
    try:
        data = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"{path}: manifest is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: manifest is not a JSON object")
    try:
        return RunManifest.parse(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(part) for part in first["loc"][:2])
        raise ConfigError(
            f"{path}: manifest key {key!r}: {first['msg']}; rerun with --fresh to start over"
        ) from None


def write_manifest(path: Path, manifest: RunManifest, *, durable: bool = True) -> None:
    write_json_atomic(path, manifest.to_json(), durable=durable)


def move_aside(paths: OutputPaths) -> Path | None:
    """``--fresh``: move an earlier run's files into a dated folder; never delete them."""
    existing = [p for p in paths.all() if p.exists() and p != paths.lock]
    if not existing:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    folder = paths.output.with_name(f"{paths.output.stem}_previous_{stamp}")
    suffix = 1
    while folder.exists():
        suffix += 1
        folder = folder.with_name(f"{paths.output.stem}_previous_{stamp}_{suffix}")
    folder.mkdir()
    for path in existing:
        os.replace(path, folder / path.name)
    fsync_dir(paths.output.parent)
    return folder


def remove_folders(folders: list[Path]) -> None:
    """The folders and everything in them, by ``rm -rf`` (``shutil.rmtree`` each where
    there is no ``rm``; blocking).

    Not ``shutil.rmtree`` in this thread: it makes a few system calls a file, and each
    one gives the interpreter's lock to the loop and waits to take it back. 1,000
    folders of 17 files took it 16 to 19 s beside a thread running Python (``rm``: 3 s);
    the folds of bench/many_jobs.py fell behind the jobs settling, and the settled
    jobs waiting for one grew without bound (16,000 after 55,000 jobs, ~400 bytes of
    objects each, and the daemon's RSS with them: ``serve/archive.py``). One ``rm``
    removes up to ``RM_FOLDERS`` folders."""
    for first in range(0, len(folders), RM_FOLDERS):
        chunk = folders[first : first + RM_FOLDERS]
        try:
            done = subprocess.run(
                ["rm", "-rf", "--", *map(str, chunk)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                check=False,
            )
        except FileNotFoundError:  # no ``rm``
            for folder in chunk:
                remove_folder(folder)
            continue
        if done.returncode != 0:
            why = done.stderr.decode(errors="replace").strip().splitlines()
            raise OSError(f"rm -rf of {len(chunk)} job folders: {why[0] if why else done}")


def remove_folder(folder: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(folder)
