"""The shutdown grace: rollouts at agents get a while to answer, then are cancelled.

Used by a ``Job`` at the budget's end, on a stop and when it closes. A cancelled
rollout writes no row (contracts §4): it runs again on resume.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from typing import Any

from dispatcher.run.flight import Flight, Landing

# How often the grace looks for rollouts gone back to waiting to retry.
SETTLE_LOOK_S = 0.1


async def settle(flights: Collection[Flight], grace_s: float, reason: str, log: Any) -> None:
    """Give ``flights`` at agents ``grace_s`` to answer, then cancel the rest.

    ``flights`` is the job's live set, read again at each step. A rollout only
    waiting to retry (a backoff, no replica up) runs nowhere: it is cancelled at
    once, not given the grace.
    """
    deadline = time.monotonic() + grace_s
    while True:
        # One whose answer was "not delivered" meanwhile goes back to waiting:
        # look again at each short step of the grace.
        waiting = {f.task for f in flights if f.at_agent and not f.sending and f.task}
        await cancel(waiting, reason, log)
        at_agents = {f.task for f in flights if f.at_agent and f.task is not None}
        if not at_agents or time.monotonic() >= deadline:
            break
        step_s = min(SETTLE_LOOK_S, deadline - time.monotonic())
        await asyncio.wait(at_agents, timeout=max(0.0, step_s))
    await cancel({f.task for f in flights if f.at_agent and f.task}, reason, log)


async def cancel(tasks: set[asyncio.Task[Landing]], reason: str, log: Any) -> None:
    if not tasks:
        return
    for task in tasks:
        task.cancel(reason)
    await asyncio.wait(tasks)
    log.warning("rollouts_cancelled", count=len(tasks), reason=reason)
