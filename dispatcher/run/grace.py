"""The shutdown grace: rollouts at agents get a while to answer, then are cancelled.

Used by a ``Job`` at the budget's end, on a stop and when it closes. A cancelled
rollout writes no row (contracts §4): it runs again on resume. A rollout whose
agent answered is past the grace's reach (``Stage.ANSWERED``): its row is written.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from typing import Any

from dispatcher.lifecycle import Stage
from dispatcher.run.flight import Flight, Landing

# How often the grace looks for rollouts gone back to waiting to retry.
SETTLE_LOOK_S = 0.1


async def settle(
    flights: Collection[Flight],
    grace_s: float,
    reason: str,
    log: Any,
    spare: Stage = Stage.ANSWERED,
) -> None:
    """Give ``flights`` at agents ``grace_s`` to answer, then cancel the rest.

    ``flights`` is the job's live set, read again at each step. A rollout only
    waiting to retry (a backoff, no replica up) runs nowhere: it is cancelled at
    once, not given the grace. Flights at ``spare`` or past it are never
    cancelled: by default those whose agent answered, whose rows are written
    whatever the grace (contracts §10; they wait only for the commits ahead of
    them in the bounded commit queue). A cancelled or failed job spares only
    its commits under way.
    """
    started = time.monotonic()
    deadline = started + grace_s
    while True:
        # One whose answer was "not delivered" meanwhile goes back to waiting:
        # look again at each short step of the grace.
        await cancel(_tasks(flights, Stage.WAITING), reason, log)
        at_agents = _tasks(flights, Stage.AT_AGENT)
        if not at_agents or time.monotonic() >= deadline:
            break
        step_s = min(SETTLE_LOOK_S, deadline - time.monotonic())
        await asyncio.wait(at_agents, timeout=max(0.0, step_s))
    left = {f.task for f in flights if f.stage < spare and f.task}
    await cancel(left, reason, log, waited_s=time.monotonic() - started)


def _tasks(flights: Collection[Flight], stage: Stage) -> set[asyncio.Task[Landing]]:
    return {f.task for f in flights if f.stage is stage and f.task is not None}


async def cancel(
    tasks: set[asyncio.Task[Landing]], reason: str, log: Any, waited_s: float = 0.0
) -> None:
    """Cancel ``tasks`` and wait for them; ``waited_s``: how long the grace gave them."""
    if not tasks:
        return
    for task in tasks:
        task.cancel(reason)
    await asyncio.wait(tasks)
    log.warning("rollouts_cancelled", count=len(tasks), reason=reason, waited_s=round(waited_s, 3))
