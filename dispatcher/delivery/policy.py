"""What the agents' client (``client.py``) is given: the deadlines and retry rules of
a run's agent calls (``DeliveryPolicy``), the observer it tells of retries and
replica health, and a rollout's ``Progress`` (is its request at a replica now)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from dispatcher.delivery.adaptive import AimdPolicy
from dispatcher.delivery.answers import Classifier
from dispatcher.delivery.limits import ResponseLimits
from dispatcher.delivery.replicas import BreakerPolicy, Replica
from dispatcher.delivery.retry import BackoffPolicy


@dataclass(frozen=True)
class DeliveryPolicy:
    """Deadlines and retry rules of one run's agent calls (settings, in seconds)."""

    deadline_s: float = 600.0
    rollout_timeout_s: float | None = None
    # ``--pause-deadlines``: the rollout timeout stops while admission is paused.
    pause_deadlines: bool = False
    first_byte_timeout_s: float | None = None
    limits: ResponseLimits = field(default_factory=ResponseLimits)
    backoff: BackoffPolicy = field(default_factory=BackoffPolicy)
    breaker: BreakerPolicy = field(default_factory=BreakerPolicy)
    # Load (``adaptive.py``): hard caps and the adaptive controllers' rules.
    replica_cap: int | None = None
    max_starts_per_s: float | None = None
    aimd: AimdPolicy | None = None
    # How answers are classed; None: on the loop (``classify_on_loop``).
    classify: Classifier | None = None


class DeliveryObserver(Protocol):
    """Told about retries and replica health (``load.AgentLoad`` makes metrics and logs of them)."""

    def retrying(
        self, replica: Replica, rollout_id: str, reason: str, delay_s: float, retry: int
    ) -> None: ...

    def replica_changed(self, replica: Replica, opened: bool) -> None: ...

    def replica_has_no_run(self, replica: Replica, status: int) -> None: ...


class Progress(Protocol):
    """Whether a rollout's request is at a replica now (see ``AgentClient.run``)."""

    sending: bool


class Sending:
    """A ``Progress`` of its own, for a caller that keeps none."""

    __slots__ = ("sending",)

    def __init__(self) -> None:
        self.sending = False
