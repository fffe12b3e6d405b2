"""Big JSON off the event loop: a worker process validates, one worker thread joins.

Measured with ``bench/big_rows.py`` (its end-to-end runs with either worker,
and ``--offload-compare``): a thread that validates a big body holds
the GIL for each of the parser's C calls, and the loop waits for them; the
child process (``jsonworker.py``) holds no lock of ours. What crosses to it is
the body, written to a pipe with the GIL released; what comes back is where
each top-level value lies. The row's line is then made in one worker thread
from the body the loop already holds: its big values are not copied but
written from the body by ``writev(2)`` (``files.writer.Pieces``).

One thread and one process: the machine's other core serves the agents'
sockets and the loop, and one core validates over 500 MB/s, more than the
agents deliver.

A body from ``SPLIT_BYTES`` up to ``offload_bytes`` is split the same way on the
loop, where it costs less than a full parse and than the hops; a smaller one is
parsed whole.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from dispatcher.delivery.answers import classify_here
from dispatcher.delivery.client import Classified, classify_object
from dispatcher.delivery.faults import LocalFault, as_local_fault
from dispatcher.delivery.limits import Body
from dispatcher.rows.jsonworker import WorkerProcess
from dispatcher.rows.wire import Split, classify_big, wire_result

WORKERS = 1
# "process" (the default, see above) or "thread": where a big body is validated.
WORKER_KINDS = ("process", "thread")
WORKER_KIND = "process"

P = ParamSpec("P")
T = TypeVar("T")

_executor: ThreadPoolExecutor | None = None
# The thread that feeds the worker process waits on it: not the joining thread.
_feeder: ThreadPoolExecutor | None = None
_process = WorkerProcess()
# The child ends with its input; closing it first spares a warning at exit.
atexit.register(_process.close)


def worker_process() -> WorkerProcess:
    """The worker process big bodies go to (started by its first call)."""
    return _process


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="big-json")
    return _executor


def _feeding_pool() -> ThreadPoolExecutor:
    global _feeder
    if _feeder is None:
        _feeder = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="big-json-feed")
    return _feeder


async def off_loop(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run ``fn`` in a worker thread; our own faults there come back as ``LocalFault``.

    Whatever the worker raises is the dispatcher's (the agent's faults are
    values, not exceptions): §11 puts the rollout back instead of writing a
    failure row, and a fault that persists ends the run.
    """
    return await _run_in(_pool(), functools.partial(fn, *args, **kwargs))


async def _run_in(pool: ThreadPoolExecutor, call: Callable[[], T]) -> T:
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, call)
    except Exception as exc:
        fault = as_local_fault(exc)
        raise fault or LocalFault("bug", f"a worker raised {exc!r}") from exc


def classify_in_process(status: int, raw: Body) -> Classified:
    """``classify_big`` with the validation in the worker process (blocking: a thread calls it)."""
    answer = _process.split(raw)
    if isinstance(answer, Split):
        return classify_object(status, raw, wire_result(raw, answer))
    return answer


# From this size a 2xx body is split on the loop (its values kept as bytes), not
# parsed whole. ``bench/answer_paths.py --time``: the split, the row and its line
# take 0.89x the full parse's time at 16 KiB and 0.51x at 256 KiB, but 1.87x at
# 4 KiB, where its fixed costs (the number guard, the spans) outweigh it; the
# instruction counts (``--table``) agree.
SPLIT_BYTES = 16 * 1024


class AnswerClassifier:
    """Classes answers (``agents.classify_response``): a 2xx body over ``split_bytes``
    is kept as bytes (``wire.classify_big``), one over ``offload_bytes`` in a worker
    (``worker``: one of ``WORKER_KINDS``)."""

    def __init__(
        self, offload_bytes: int, worker: str | None = None, split_bytes: int = SPLIT_BYTES
    ) -> None:
        self.offload_bytes = offload_bytes
        # Parsed whole up to here: never past ``offload_bytes``, where the worker takes over.
        self.parse_bytes = min(split_bytes, offload_bytes)
        self.worker = worker or WORKER_KIND
        if self.worker not in WORKER_KINDS:
            raise ValueError(f"worker must be one of {WORKER_KINDS}, got {self.worker!r}")

    async def __call__(self, status: int, raw: Body) -> Classified:
        # An error status only reads an excerpt of its body; a body up to
        # ``offload_bytes`` is handled faster here than with a hop to a worker and
        # back. (In place, not through ``classify_on_loop``: one coroutine less per answer.)
        size = len(raw)
        if not 200 <= status < 300 or size <= self.parse_bytes:
            return classify_here(status, raw)
        if size <= self.offload_bytes:
            return classify_here(status, raw, classify_big)
        if self.worker == "thread":
            return await off_loop(classify_big, status, raw)
        return await _run_in(_feeding_pool(), functools.partial(classify_in_process, status, raw))
