"""Replica health (contracts §11): a circuit breaker per replica and the routing choice.

A replica that keeps failing to deliver (no HTTP answer, 429/502/503/504) is
ejected from routing: its breaker opens after ``failures_to_open``
consecutive not-delivered attempts, lets one probe through (half-open) after
a backoff that doubles up to a cap, and closes on a delivered answer. A dead
replica fails fast, so "fewest in flight" alone would send it most of the
work; routing therefore only considers replicas whose breaker admits a
request, and among them picks the fewest in flight.

Load: a replica may have a hard cap (``--replica-concurrency``, never
exceeded) and, with ``--concurrency auto``, an adaptive limit from its own
controller (``concurrency.AimdController``); routing prefers replicas under
their limit and never picks one at its cap.

Pure state and a clock: no I/O, so the rules are pinned on a fake clock.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import InitVar, dataclass, field
from enum import StrEnum

from dispatcher.delivery.adaptive import AimdController
from dispatcher.delivery.target import Target
from dispatcher.urls import redact_url, replica_names

Clock = Callable[[], float]


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerPolicy:
    failures_to_open: int = 5
    open_s: float = 1.0
    open_cap_s: float = 30.0


@dataclass
class Breaker:
    """One replica's circuit breaker; transitions are reported by the return values."""

    policy: BreakerPolicy
    clock: Clock
    state: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0
    open_for_s: float = 0.0
    reopen_at: float = 0.0
    probe_in_flight: bool = False
    # When every replica of an agent is open, how long that has lasted.
    opened_at: float | None = None

    def admits(self) -> bool:
        """May a request go to this replica now (a half-open one takes a single probe)?"""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN and self.clock() >= self.reopen_at:
            self.state = BreakerState.HALF_OPEN
        return self.state is BreakerState.HALF_OPEN and not self.probe_in_flight

    def on_send(self) -> bool:
        """A request goes out; True when it is a half-open probe."""
        if self.state is BreakerState.HALF_OPEN:
            self.probe_in_flight = True
            return True
        return False

    def on_delivered(self) -> bool:
        """An answer came back; True when this closed an open breaker."""
        was_open = self.state is not BreakerState.CLOSED
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.open_for_s = 0.0
        self.probe_in_flight = False
        self.opened_at = None
        return was_open

    def on_not_delivered(self) -> bool:
        """A not-delivered attempt; True when this opened the breaker."""
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN:
            # The probe failed: open again, for longer.
            self._open(min(self.policy.open_cap_s, max(self.policy.open_s, 2 * self.open_for_s)))
            return False
        if self.state is BreakerState.CLOSED and (
            self.consecutive_failures >= self.policy.failures_to_open
        ):
            self._open(self.policy.open_s)
            return True
        return False

    def hold_open(self) -> None:
        """Out of routing without a failure counted: only probes, after a backoff
        that doubles (up to its cap) each time it is held open again."""
        self._open(min(self.policy.open_cap_s, max(self.policy.open_s, 2 * self.open_for_s)))

    def on_abandoned(self) -> None:
        """The request ended without telling anything about the replica (cancelled, our fault)."""
        self.probe_in_flight = False

    def _open(self, open_for_s: float) -> None:
        now = self.clock()
        self.state = BreakerState.OPEN
        self.open_for_s = open_for_s
        self.reopen_at = now + open_for_s
        self.probe_in_flight = False
        if self.opened_at is None:
            self.opened_at = now


@dataclass
class ReplicaStats:
    """What happened at one replica this hop (for /status and the summary)."""

    sent: int = 0
    # Sent while the breaker was half-open: the only traffic an ejected replica gets.
    probes: int = 0
    delivered: int = 0
    not_delivered: int = 0
    opened: int = 0


@dataclass
class Replica:
    """One base URL of an agent, with its live in-flight count and its breaker."""

    agent: str
    url: str
    breaker: Breaker
    in_flight: int = 0
    stats: ReplicaStats = field(default_factory=ReplicaStats)
    cap: int | None = None
    controller: AimdController | None = None
    # It answered 404/405 to ``POST /run`` before any 2xx: a wrong URL, out of
    # routing until a probe finds ``/run`` there.
    no_run: bool = False
    # It answered 2xx to ``POST /run``: ``/run`` is served, and a 404 from it now
    # is its task's (a resources server's "not found", an ingress restarting).
    served_run: bool = False
    # ``POST {url}/run`` with its request head built once (credentials and all).
    run_target: Target = field(init=False)
    shown: InitVar[str | None] = None

    def __post_init__(self, shown: str | None) -> None:
        # Credentials stay in ``run_target`` only: ``url`` is what every view,
        # log, metric label and row shows, so it carries them masked.
        self.run_target = Target.of(f"{self.url}/run")
        self.url = shown if shown is not None else redact_url(self.url)

    @property
    def limit(self) -> int | None:
        """The adaptive limit (None without ``--concurrency auto``)."""
        return self.controller.limit if self.controller is not None else None

    def routable(self) -> bool:
        """May a rollout go here now: a ``/run`` served, and a breaker that admits it."""
        return not self.no_run and self.breaker.admits()

    def has_room(self) -> bool:
        return self.cap is None or self.in_flight < self.cap

    def under_limit(self) -> bool:
        limit = self.limit
        return limit is None or self.in_flight < limit

    def view(self) -> dict[str, object]:
        return {
            "state": self.breaker.state.value,
            "in_flight": self.in_flight,
            "limit": self.limit,
            "cap": self.cap,
            "sent": self.stats.sent,
            "probes": self.stats.probes,
            "delivered": self.stats.delivered,
            "not_delivered": self.stats.not_delivered,
            "opened": self.stats.opened,
            "no_run": self.no_run,
        }


class ReplicaSet:
    """The replicas of one agent and the routing choice between them."""

    def __init__(
        self,
        agent: str,
        urls: Iterable[str],
        policy: BreakerPolicy,
        clock: Clock = time.monotonic,
        *,
        cap: int | None = None,
        controller: Callable[[], AimdController] | None = None,
    ) -> None:
        self.agent = agent
        self._clock = clock
        urls = list(urls)
        self.replicas = [
            Replica(
                agent,
                url,
                Breaker(policy, clock),
                cap=cap,
                controller=_make(controller),
                shown=shown,
            )
            for url, shown in zip(urls, replica_names(urls), strict=True)
        ]
        # Ties rotate so equally idle replicas share the load evenly.
        self._turn = itertools.cycle(range(len(self.replicas)))

    def pick(self, avoid: Replica | None = None) -> Replica | None:
        """The admitting replica with room and the fewest in flight.

        Prefers one under its adaptive limit, and one other than ``avoid``.
        None when no breaker admits a request now, or every one that does is
        at its cap (``at_cap`` tells the two apart).
        """
        if len(self.replicas) == 1:  # most agents: the same answer, without the lists
            only = self.replicas[0]
            return only if only.routable() and only.has_room() else None
        start = next(self._turn)
        ordered = self.replicas[start:] + self.replicas[:start]
        ready = [r for r in ordered if r.routable() and r.has_room()]
        if avoid is not None and len(ready) > 1:
            ready = [r for r in ready if r is not avoid] or ready
        ready = [r for r in ready if r.under_limit()] or ready
        if not ready:
            return None
        return min(ready, key=lambda r: r.in_flight)

    def at_cap(self) -> bool:
        """Some breaker admits a request, but every such replica is at its cap."""
        admitting = [r for r in self.replicas if r.routable()]
        return bool(admitting) and not any(r.has_room() for r in admitting)

    def healthy_limit(self) -> int | None:
        """Sum of the adaptive limits of the replicas whose breaker is closed."""
        limits = [
            r.limit
            for r in self.replicas
            if r.limit is not None and r.breaker.state is BreakerState.CLOSED
        ]
        if not any(r.controller for r in self.replicas):
            return None
        return sum(limits)

    def next_admission_in_s(self) -> float:
        """Seconds until some open breaker lets a probe through (0 if one admits now)."""
        now = self._clock()
        waits = [
            max(0.0, r.breaker.reopen_at - now)
            for r in self.replicas
            if r.breaker.state is BreakerState.OPEN
        ]
        return min(waits, default=0.0)

    def down_for_s(self) -> float | None:
        """How long every replica has been open (None while any one is closed)."""
        # Asked before each rollout starts: a plain loop, no list or generator,
        # and out at the first closed replica (the usual answer).
        last_opened = -math.inf
        for replica in self.replicas:
            opened_at = replica.breaker.opened_at
            if opened_at is None:
                return None
            last_opened = max(last_opened, opened_at)
        return self._clock() - last_opened

    def open_replicas(self) -> list[Replica]:
        """The replicas whose breaker is not closed (the prober's to probe)."""
        return [r for r in self.replicas if r.breaker.state is not BreakerState.CLOSED]

    def all_no_run(self) -> bool:
        if len(self.replicas) == 1:  # most agents: no generator for each rollout
            return self.replicas[0].no_run
        return all(r.no_run for r in self.replicas)

    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]


def _make(factory: Callable[[], AimdController] | None) -> AimdController | None:
    return factory() if factory is not None else None
