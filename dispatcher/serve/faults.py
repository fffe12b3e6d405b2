"""Faults of service mode: how they are told (one line) and whether the state
directory still takes writes (``/healthz``).

A job, a request or a write that fails is named in one line (``one_line``):
a job's ``error``, a stream's end line and an API error are read by people
and parsed by trainers. A write the disk refused (``is_disk_fault``) also
faults the state directory until a write works again.
"""

from __future__ import annotations

import asyncio
import errno
from typing import Any

import structlog

from dispatcher.errors import DispatcherError, OutputWriteError
from dispatcher.serve.registry import Registry

log = structlog.get_logger("dispatcher.serve")

# Errors of a file system that cannot take a write: the state directory is
# faulted (``/healthz``), a write API call answers 507.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})


def is_disk_fault(exc: BaseException) -> bool:
    if isinstance(exc, OutputWriteError):
        return True
    return isinstance(exc, OSError) and exc.errno in DISK_ERRNOS


def one_line(exc: BaseException) -> str:
    """An exception as one short line: an OSError as its message and file."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 500 else text[:497] + "..."


def log_crash(event: str, exc: BaseException, **fields: Any) -> None:
    """Log ``exc`` at error: a file the system refused (a full disk, a damaged
    file) in one line, anything else (a bug) with its traceback."""
    if isinstance(exc, OSError | DispatcherError):
        log.error(event, error=one_line(exc), **fields)
    else:
        log.error(event, error=one_line(exc), exc_info=exc, **fields)


class StateDirHealth:
    """Whether the state directory takes writes: faulted from a failed write until
    one succeeds again (``/healthz`` answers 503 meanwhile)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.error: str | None = None
        # Probes share one file: two at once would race for its temporary name.
        self._probing = asyncio.Lock()

    def failed(self, error: str) -> None:
        if self.error is None:
            log.error("state_dir_write_failed", error=error)
        self.error = error

    def wrote(self) -> None:
        if self.error is not None:
            log.info("state_dir_writable_again", was=self.error)
        self.error = None

    async def check(self) -> str | None:
        """The fault: a state directory gone or read-only (looked at each time, without
        a write), or a write that failed, after one probe write (a fault that
        cleared reports None)."""
        async with self._probing:
            missing = await asyncio.to_thread(self.registry.missing)
            if missing is not None:
                return missing
            if self.error is None:
                return None
            try:
                await asyncio.to_thread(self.registry.probe)
            except OSError:
                return self.error
            self.wrote()
            return None
