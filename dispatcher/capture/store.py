"""Capture files and write claims under one capture directory (contracts §6).

Layout::

    <capture_dir>/<rollout_id>.capture.jsonl      one exchange per line
    <capture_dir>/<rollout_id>.capture.incomplete a write failed; some calls are missing
    <capture_dir>/claims/<rollout_id>/<claim>     one empty file per write not yet durable

Why one claim *file* per write, in a directory per rollout:

- A claim must be visible to a dispatcher in another process or on another
  host that shares the directory. Creating and unlinking a file are the only
  primitives every shared filesystem (NFS, Lustre, GPFS) orders for all
  clients; counters need locks, and ``flock`` is unreliable over NFS.
- Each write owns its own claim file, named after host, process and a
  counter, so concurrent writers never contend and a release never needs a
  read-modify-write.
- Checking a rollout lists only ``claims/<rollout_id>/``, which holds that
  rollout's in-flight writes (almost always none, so the directory is absent),
  never the capture directory with one file per rollout of the run.
- The directory is removed with the last claim; a writer that loses that race
  sees ``ENOENT`` on create and makes the directory again.

A claim is taken while the model call is forwarded, is in place before the
agent sees any byte of the answer, and is released after the call's line is
fsynced (or after the ``.incomplete`` marker is written). So once the agent has
its answer, "no claim" means "every line of this rollout is durable".
A process killed mid-write leaves its claim behind: finalization then gives up
after its wait limit with the ``model_call_capture_pending`` gap, and the next
dispatch of that rollout id clears the leftover.

Attribute caching on NFS clients can delay how soon another host sees a claim
appear or vanish; the wait limit bounds the cost of the latter, and mounting
the capture directory with ``lookupcache=positive`` (or ``noac``) narrows the former.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import os
import shutil
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog

from dispatcher.tasks.keys import is_valid_rollout_id

log = structlog.get_logger(__name__)

CLAIMS_DIR = "claims"

BeforeWrite = Callable[[str], Awaitable[None]]
_T = TypeVar("_T")


def capture_path(capture_dir: Path, rollout_id: str) -> Path:
    return capture_dir / f"{rollout_id}.capture.jsonl"


def incomplete_path(capture_dir: Path, rollout_id: str) -> Path:
    return capture_dir / f"{rollout_id}.capture.incomplete"


def claims_path(capture_dir: Path, rollout_id: str) -> Path:
    return capture_dir / CLAIMS_DIR / rollout_id


# --- blocking primitives (call them in a thread) -----------------------------------------


def create_claim(capture_dir: Path, rollout_id: str, name: str) -> Path:
    """Create one claim file; durable enough for other hosts once this returns."""
    directory = claims_path(capture_dir, rollout_id)
    path = directory / name
    # Each retry means another writer's release won a race; under heavy load
    # that can happen a few times in a row, never indefinitely.
    for _ in range(64):
        # Not exist_ok=True: that re-checks is_dir() after EEXIST and raises if
        # a release removed the directory in between. Here the open below
        # notices a vanished directory and the loop makes it again.
        with contextlib.suppress(FileExistsError):
            directory.mkdir(parents=True)
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            return path
        except FileNotFoundError:
            # Another writer's release removed the directory between mkdir and open.
            continue
    raise OSError(errno.EAGAIN, "claims directory keeps disappearing", str(directory))


def release_claim(path: Path) -> None:
    """Remove a claim, and its rollout's claims directory when it was the last one."""
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        # ENOTEMPTY (another write in flight) or ENOENT are both fine.
        path.parent.rmdir()


def has_claims(capture_dir: Path, rollout_id: str) -> bool:
    """True while some write of this rollout is not yet durable; lists only its own claims."""
    try:
        with os.scandir(claims_path(capture_dir, rollout_id)) as entries:
            return any(True for _ in entries)
    except FileNotFoundError:
        return False


def append_line(path: Path, line: bytes) -> None:
    """Append one whole line and make it durable before returning."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(line)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


def mark_incomplete(capture_dir: Path, rollout_id: str) -> None:
    append_line(incomplete_path(capture_dir, rollout_id), b"")


def clear_rollouts(capture_dir: Path, rollout_ids: Iterable[str]) -> None:
    """Remove capture files, markers and claims of exactly these rollout ids."""
    for rollout_id in rollout_ids:
        if not is_valid_rollout_id(rollout_id):
            raise ValueError(f"not a rollout id: {rollout_id!r}")
        capture_path(capture_dir, rollout_id).unlink(missing_ok=True)
        incomplete_path(capture_dir, rollout_id).unlink(missing_ok=True)
        claims = claims_path(capture_dir, rollout_id)
        if claims.exists():
            shutil.rmtree(claims, ignore_errors=True)


# --- the proxy's writer ------------------------------------------------------------------


@dataclass
class _LockEntry:
    lock: asyncio.Lock
    users: int = 0


class _RolloutLocks:
    """One asyncio lock per rollout id, dropped as soon as nobody holds or waits for it."""

    def __init__(self) -> None:
        self._entries: dict[str, _LockEntry] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _LockEntry(asyncio.Lock())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)


class CaptureStore:
    """Claims, serialized durable appends and failure markers for one capture directory.

    ``before_write`` runs before each record is written; tests use it to hold a
    write back deterministically.
    """

    def __init__(self, capture_dir: Path, *, before_write: BeforeWrite | None = None) -> None:
        self.capture_dir = capture_dir
        self._before_write = before_write
        self._locks = _RolloutLocks()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._claim_prefix = f"{socket.gethostname()}.{os.getpid()}"
        self._claim_seq = itertools.count()

    def claim(self, rollout_id: str) -> asyncio.Future[Path | None]:
        """Start claiming a write for ``rollout_id``; the future gives the claim file.

        Claiming runs while the call is forwarded; the proxy awaits the future
        before the agent can see any byte of the answer. It resolves to None
        (logged) when the directory refuses the claim.
        """
        return self._track(self._create_claim(rollout_id))

    def commit(
        self, rollout_id: str, claim: asyncio.Future[Path | None], encode: Callable[[], bytes]
    ) -> None:
        """Write one record in the background; the claim is released once it is durable.

        The write runs in its own task, so it completes even when the request
        that produced it is cancelled or its client has gone away.
        """
        self._track(self._write(rollout_id, claim, encode))

    async def aclose(self) -> None:
        """Wait for every claim and write still in flight (server shutdown)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def pending_writes(self) -> int:
        """Claims and writes not finished yet."""
        return len(self._tasks)

    @property
    def rollouts_writing(self) -> int:
        """Rollouts holding a write lock; idle ones are dropped, so this stays small."""
        return len(self._locks)

    def _track(self, work: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _create_claim(self, rollout_id: str) -> Path | None:
        name = f"{self._claim_prefix}.{next(self._claim_seq)}.claim"
        try:
            return await asyncio.to_thread(create_claim, self.capture_dir, rollout_id, name)
        except OSError as exc:
            log.error("capture_claim_failed", rollout_id=rollout_id, error=str(exc))
            return None

    async def _write(
        self, rollout_id: str, claiming: asyncio.Future[Path | None], encode: Callable[[], bytes]
    ) -> None:
        claim = await claiming
        durable = False
        try:
            if self._before_write is not None:
                await self._before_write(rollout_id)
            async with self._locks.hold(rollout_id):
                path = capture_path(self.capture_dir, rollout_id)
                await asyncio.to_thread(_encode_and_append, path, encode)
            durable = True
        except Exception as exc:
            log.error("capture_write_failed", rollout_id=rollout_id, error=repr(exc))
            durable = await self._mark_incomplete(rollout_id)
        finally:
            # A claim stays when neither the record nor the marker is on disk: the
            # dispatcher then reports the rollout as pending rather than complete.
            if claim is not None and durable:
                await asyncio.to_thread(_release_quietly, claim)

    async def _mark_incomplete(self, rollout_id: str) -> bool:
        try:
            await asyncio.to_thread(mark_incomplete, self.capture_dir, rollout_id)
        except OSError as exc:
            log.error("capture_marker_failed", rollout_id=rollout_id, error=str(exc))
            return False
        return True


def _encode_and_append(path: Path, encode: Callable[[], bytes]) -> None:
    append_line(path, encode())


def _release_quietly(claim: Path) -> None:
    try:
        release_claim(claim)
    except OSError as exc:
        log.warning("capture_claim_release_failed", claim=str(claim), error=str(exc))
