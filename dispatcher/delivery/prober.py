"""The daemon's prober: an agent marked down comes back by itself.

Probes (``probe.py``) every replica whose breaker is open, once its backoff
is over, through ``AgentClient.probe``, for as long as the daemon lives.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from dispatcher.delivery.client import AgentClient
from dispatcher.delivery.replicas import BreakerState

# Never look again sooner than this: a breaker's probe in flight ends on its own.
MIN_LOOK_S = 0.01


class Prober:
    """Probes every replica whose breaker is open, once its backoff is over (half-open).

    Without it an agent whose every replica is open gets no traffic once its
    rollouts are no longer started, so no breaker would ever half-open again.
    The breaker keeps the rule: a failed probe reopens it for twice as long
    (up to its cap), an answer closes it.
    """

    def __init__(
        self,
        agents: AgentClient,
        timeout_s: float,
        idle_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._agents = agents
        self._timeout_s = timeout_s
        # How often to look when no breaker is open.
        self._idle_s = idle_s
        self._clock = clock

    async def run(self) -> None:
        while True:
            due = self._agents.due_for_probe()
            if due:
                await asyncio.gather(*(self._agents.probe(r, self._timeout_s) for r in due))
            await asyncio.sleep(self.next_look_in_s())

    def next_look_in_s(self) -> float:
        """Until the first open breaker's backoff ends, at most ``idle_s``."""
        now = self._clock()
        waits = [
            r.breaker.reopen_at - now
            for replicas in self._agents.replica_sets.values()
            for r in replicas.open_replicas()
            if r.breaker.state is BreakerState.OPEN
        ]
        return max(MIN_LOOK_S, min([self._idle_s, *waits]))
