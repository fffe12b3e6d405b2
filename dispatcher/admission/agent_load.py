"""Per-agent load and health: who may be sent now, and what delivery saw of each agent.

``AgentLoad`` owns each agent's slot limiter (a fixed ``--agent-concurrency``
cap, or with ``--concurrency auto`` the sum of the agent's healthy replicas'
adaptive limits) and is the ``DeliveryObserver`` of ``agents.AgentClient``:
retries, breakers opening and closing, agents none of whose replicas can be
reached (named at once, and again when one comes back), agents down past the
delivery deadline (their rollouts are not started). Metrics and log events
for all of these are updated here and nowhere else. It also runs the
``Prober`` that lets an agent marked down come back by itself.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from typing import Any

import structlog

from dispatcher.admission.pool import Limiter
from dispatcher.aio import Wakeup
from dispatcher.delivery.client import AgentClient
from dispatcher.delivery.prober import Prober
from dispatcher.delivery.replicas import Replica
from dispatcher.settings.config import RunSettings
from dispatcher.telemetry.metrics import Metrics

log = structlog.get_logger("dispatcher.run")

ADAPT_TICK_S = 0.25
LIMIT_LOG_EVERY_S = 5.0


class AgentLoad:
    """Slot limiters per agent, their adaptive limits, and the agents' delivery health."""

    def __init__(self, settings: RunSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.slots: dict[str, Limiter] = {}
        self.retries: defaultdict[str, Counter[str]] = defaultdict(Counter)
        # Agents none of whose replicas can be reached now (every breaker open).
        self.agents_down: set[str] = set()
        # Fired when an agent comes back: a served job paused on it goes on.
        self.agent_back = Wakeup()
        self._agents: AgentClient | None = None
        self._limit_logged_at: dict[str, float] = {}
        # Agents whose rollouts this hop stopped starting (said once).
        self._said_down: set[str] = set()
        self._log = log.bind()

    def attach(self, agents: AgentClient) -> None:
        """The client whose replicas this watches (it takes this object as its observer)."""
        self._agents = agents
        self._log = log.bind()

    # ---- limits ----------------------------------------------------------------------

    def make_limiters(self) -> dict[str, Limiter]:
        """A slot limiter for each agent with a cap, or with an adaptive limit."""
        settings = self.settings
        for agent in settings.agents:
            cap = settings.agent_concurrency.get(agent)
            if settings.adaptive:
                ceiling = min(cap or settings.concurrency_max, settings.concurrency_max)
                self.slots[agent] = Limiter(ceiling)
            elif cap is not None:
                self.slots[agent] = Limiter(cap)
        for agent in self.slots:
            self.apply_limit(agent, reason="initial")
        return self.slots

    def apply_limit(self, agent: str, reason: str) -> None:
        """An agent's limit: its healthy replicas' adaptive limits, within min and its cap."""
        limiter = self.slots.get(agent)
        if limiter is None or self._agents is None:
            return
        healthy = self._agents.replica_sets[agent].healthy_limit()
        if healthy is not None:
            before = limiter.limit
            limiter.set_limit(max(self.settings.concurrency_min, healthy))
            if limiter.limit != before:
                self._log_limit(agent, before, limiter.limit, reason)
        self.metrics.concurrency_limit(agent, limiter.limit)

    def _log_limit(self, agent: str, before: int, after: int, reason: str) -> None:
        # At most one event per agent every few seconds: the limit moves every second.
        now = time.monotonic()
        if now - self._limit_logged_at.get(agent, -LIMIT_LOG_EVERY_S) < LIMIT_LOG_EVERY_S:
            return
        self._limit_logged_at[agent] = now
        self._log.info("concurrency_changed", agent=agent, limit=after, was=before, reason=reason)

    async def adapt(self) -> None:
        """Tick the replicas' controllers and carry their limits to the agents' slots."""
        assert self._agents is not None
        while True:
            await asyncio.sleep(ADAPT_TICK_S)
            for agent in self._agents.tick_controllers():
                self.apply_limit(agent, self._limit_reason(agent))

    def _limit_reason(self, agent: str) -> str:
        assert self._agents is not None
        reasons = [
            f"{r.url}: {r.controller.reason}"
            for r in self._agents.replica_sets[agent].replicas
            if r.controller is not None
        ]
        return "; ".join(reasons)

    def view(self, pool_concurrency: int | None) -> dict[str, Any]:
        """Per agent: the limit now, its cap, its replicas' limits (for /status)."""
        if self._agents is None:
            return {}
        view = {}
        for agent, replicas in self._agents.replica_sets.items():
            limiter = self.slots.get(agent)
            view[agent] = {
                "mode": "auto" if self.settings.adaptive else "fixed",
                "limit": limiter.limit if limiter is not None else pool_concurrency,
                "cap": self.settings.agent_concurrency.get(agent),
                "in_flight": sum(r.in_flight for r in replicas.replicas),
                "replica_cap": self.settings.replica_concurrency,
                "replica_limits": {r.url: r.limit for r in replicas.replicas},
                "reason": self._limit_reason(agent) if self.settings.adaptive else None,
            }
        return view

    # ---- delivery health (DeliveryObserver) --------------------------------------------

    def retrying(
        self, replica: Replica, rollout_id: str, reason: str, delay_s: float, retry: int
    ) -> None:
        # A plain str: the figures go to JSON, whose encoder takes no enum keys.
        reason = str(reason)
        self.retries[replica.agent][reason] += 1
        self.metrics.retried(replica.agent, reason)
        self._log.warning(
            "rollout_retry",
            rollout_id=rollout_id,
            agent=replica.agent,
            replica=replica.url,
            reason=reason,
            retry=retry + 1,
            delay_s=round(delay_s, 3),
        )

    def replica_changed(self, replica: Replica, opened: bool) -> None:
        self.metrics.replica_up(replica.agent, replica.url, not opened)
        # An open replica's share of an adaptive limit leaves with it.
        change = "opened" if opened else "closed"
        self.apply_limit(replica.agent, f"replica {replica.url} {change}")
        if not opened:
            self._log.warning("replica_closed", agent=replica.agent, replica=replica.url)
            self._agent_up(replica.agent)
            return
        self._log.warning(
            "replica_opened",
            agent=replica.agent,
            replica=replica.url,
            consecutive_failures=replica.breaker.consecutive_failures,
            retry_in_s=replica.breaker.open_for_s,
        )
        assert self._agents is not None
        if self._agents.down_for_s(replica.agent) is not None:
            self._agent_unreachable(replica.agent)

    def _agent_unreachable(self, agent: str) -> None:
        """Every replica's breaker is open: say so at once, not after the delivery deadline."""
        assert self._agents is not None
        urls = self._agents.replica_sets[agent].urls()
        self.agents_down.add(agent)
        self.metrics.agent_up(agent, False)
        self._log.error(
            "agent_unavailable",
            agent=agent,
            replicas=urls,
            message=f"agent {agent!r} unreachable: no replica answers ({', '.join(urls)})",
        )

    def _agent_up(self, agent: str) -> None:
        if agent not in self.agents_down:
            return
        self.agents_down.discard(agent)
        self._said_down.discard(agent)
        self.metrics.agent_up(agent, True)
        self._log.warning("agent_up", agent=agent)
        self.agent_back.fire()

    def replica_has_no_run(self, replica: Replica, status: int) -> None:
        self._log.error(
            "replica_has_no_run",
            agent=replica.agent,
            replica=replica.url,
            http_status=status,
            message=(
                f"agent {replica.agent!r}: {replica.url} answers {status} to POST /run; "
                "it gets no rollouts (give the base URL, the dispatcher appends /run)"
            ),
        )

    async def probe(self) -> None:
        """Probe the replicas whose breaker is open, for as long as the daemon lives."""
        assert self._agents is not None
        settings = self.settings
        await Prober(self._agents, settings.connect_timeout_s, settings.breaker_open_s).run()

    def is_down(self, agent: str) -> bool:
        """Every replica down past the delivery deadline: start none of the agent's rollouts."""
        assert self._agents is not None
        down_s = self._agents.down_for_s(agent)
        if down_s is None or down_s < self.settings.delivery_deadline_s:
            return False
        if agent not in self._said_down:
            self._said_down.add(agent)
            self._say_down(agent, down_s)
        return True

    def _say_down(self, agent: str, down_s: float) -> None:
        assert self._agents is not None
        urls = self._agents.replica_sets[agent].urls()
        self._log.error(
            "agent_down",
            agent=agent,
            replicas=urls,
            down_for_s=round(down_s, 3),
            message=(
                f"agent {agent!r}: every replica ({', '.join(urls)}) has failed to deliver "
                f"for {down_s:.1f} s; its remaining rollouts are not started "
                "(rerun the same command once it is back)"
            ),
        )

    def figures(self) -> dict[str, Any]:
        """Retries, replica health and agents down (for /status and the summary)."""
        agents = self._agents
        return {
            "retries": {agent: dict(reasons) for agent, reasons in self.retries.items()},
            "replicas": agents.replicas_view() if agents is not None else {},
            "agents_down": sorted(self.agents_down),
        }
