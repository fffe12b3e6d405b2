"""Big JSON off the event loop: one worker thread.

A thread, not a process (``bench/big_rows.py --offload-compare`` measures
both): the work handed over is splitting a body at its top level and joining
a row's bytes, a few milliseconds per megabyte, while a process would copy
every body there and every row back through a pipe. The cost of a thread is
the GIL: the loop may wait for the splitter's longest single C call (about
17 ms for a 20 MB body).

One worker: with two, the loop competes with a second worker for the GIL
each time the first lets go of it, and waits for two calls instead of one.
One core splits over 500 MB/s, more than the agents' sockets deliver, and
the pool's size bounds how many big bodies are being expanded at once.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from dispatcher.agents import Classified, classify_on_loop
from dispatcher.faults import LocalFault, as_local_fault
from dispatcher.rowbytes import classify_big

WORKERS = 1

P = ParamSpec("P")
T = TypeVar("T")

_executor: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="big-json")
    return _executor


async def off_loop(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run ``fn`` in a worker thread; our own faults there come back as ``LocalFault``.

    Whatever the worker raises is the dispatcher's (the agent's faults are
    values, not exceptions): A11 puts the rollout back instead of writing a
    failure row, and a fault that persists ends the run.
    """
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(_pool(), functools.partial(fn, *args, **kwargs))
    except Exception as exc:
        fault = as_local_fault(exc)
        raise fault or LocalFault("bug", f"a worker raised {exc!r}") from exc


class AnswerClassifier:
    """Classes answers (``agents.classify_response``), a body over ``offload_bytes`` in a worker."""

    def __init__(self, offload_bytes: int) -> None:
        self.offload_bytes = offload_bytes

    async def __call__(self, status: int, raw: bytes) -> Classified:
        # A small body parses faster than a hop to a thread and back.
        if len(raw) <= self.offload_bytes:
            return await classify_on_loop(status, raw)
        return await off_loop(classify_big, status, raw)
