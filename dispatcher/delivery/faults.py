"""The dispatcher's own faults (contracts §11): never a failure row, never an attempt spent.

Running out of file descriptors, memory or socket buffers, or a bug in our
code while handling an answer, says nothing about the task. The rollout goes
back to the queue, the pool shrinks (``scheduler.Limiter``) until the fault
clears, and a fault that keeps happening with no delivered answer in between
for ``persist_s`` ends the run with exit 1 naming it.
"""

from __future__ import annotations

import errno
import resource
import time
from collections.abc import Callable

from dispatcher.errors import DispatcherError

_LOCAL_ERRNOS = {
    errno.EMFILE: "too many open files",
    errno.ENFILE: "system file table full",
    errno.ENOBUFS: "no socket buffer space",
    errno.ENOMEM: "out of memory",
}


class LocalFault(Exception):
    """Raised where an attempt failed because of this process, not the agent.

    ``kind`` is short and bounded (a metric label); ``message`` names the fault
    for the operator.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def as_local_fault(exc: BaseException) -> LocalFault | None:
    """``exc`` as a ``LocalFault`` when it is the dispatcher's own fault, else None."""
    if isinstance(exc, LocalFault):
        return exc
    if isinstance(exc, MemoryError):
        return LocalFault("MemoryError", "out of memory (MemoryError)")
    number = _errno_of(exc)
    if number not in _LOCAL_ERRNOS:
        return None
    kind = errno.errorcode[number]
    message = f"{_LOCAL_ERRNOS[number]} ({kind})"
    if number in (errno.EMFILE, errno.ENFILE):
        message += f": the file-descriptor limit (ulimit -n) is {fd_limit()}"
    return LocalFault(kind, message)


def _errno_of(exc: BaseException) -> int | None:
    if isinstance(exc, OSError):
        return exc.errno
    cause = exc.__cause__ or exc.__context__
    return _errno_of(cause) if isinstance(cause, OSError) else None


def fd_limit() -> int:
    """This process's soft RLIMIT_NOFILE (``ulimit -n``)."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class FaultPersisted(DispatcherError):
    """Our own fault did not clear: the run stops (exit 1) naming it."""


class LocalFaultPolicy:
    """Decides when our own faults have persisted long enough to end the run."""

    def __init__(self, persist_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._persist_s = persist_s
        self._clock = clock
        self._first_at: float | None = None
        self.count = 0

    def on_fault(self, fault: LocalFault) -> None:
        """Count a fault; raises ``FaultPersisted`` when faults have lasted ``persist_s``."""
        self.count += 1
        now = self._clock()
        if self._first_at is None:
            self._first_at = now
        elif now - self._first_at >= self._persist_s:
            raise FaultPersisted(
                f"the dispatcher's own fault persisted for {now - self._first_at:.0f} s "
                f"with no answer delivered: {fault.message}"
            )

    def on_delivered(self) -> None:
        self._first_at = None
