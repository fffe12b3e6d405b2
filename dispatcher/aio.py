"""Stopping background tasks: one way, used by the service and its telemetry."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel a task and wait for it, re-raising a crash it had.

    `asyncio.wait` rather than `await task`: the task's CancelledError must not
    escape, while a cancellation of the caller itself still propagates.
    """
    if task is None:
        return
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled() and (error := task.exception()) is not None:
        raise error
