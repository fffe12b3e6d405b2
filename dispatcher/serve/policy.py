"""Step-control policies (contracts §13): a job's target, group filter and ordering.

A policy is three small parts, each chosen by a field of the job's body and
built here by ``policy_of``; ``step.py`` keeps the job's tally and asks them:

- ``Target``: when the job is satisfied, and whether a task of an agent may
  open a new group now (``Room``). ``GroupsTarget`` (``target_groups``, one
  quota for every agent), ``AgentQuotas`` (``target_groups_by_agent``, a quota
  per agent) and ``TokensTarget`` (``target_tokens``).
- ``GroupFilter``: whether a complete group teaches nothing, from its rows'
  rewards (``group_filter``).
- ``Ordering``: which outstanding rollout starts first: it makes the job's
  ``StartOrder`` (``admission/order.py``). ``SettingsOrder`` (the default) is the
  daemon's ``--start-order``: longest expected first from the task history, or
  input order; ``InputOrder`` keeps the task file's order whatever the daemon's.

A new policy implements one part and declares its job-body field in
``spec.py`` (``JobSpec``) and in ``policy_of``; nothing else changes.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dispatcher.admission.history import TaskHistory
from dispatcher.admission.order import StartOrder, start_order_for
from dispatcher.settings.config import RunSettings


class Room(enum.Enum):
    """What a target says of a rollout that would open a new group."""

    START = "start"  # open it now
    WAIT = "wait"  # not now: a group completing may make room (the job's one queue waits)
    DEFER = "defer"  # not now, but other agents' tasks may start meanwhile (held aside)
    SKIP = "skip"  # never in this job: its agent's quota is met, or it has none


@dataclass
class Tally:
    """A job's complete and open groups, as the target reads them."""

    # Kept groups (not filtered) that count toward the target, by agent.
    kept: Counter[str] = field(default_factory=Counter)
    # Kept groups beyond their agent's quota (open when the quota was met).
    surplus: Counter[str] = field(default_factory=Counter)
    # Open groups (a task started, not complete), by agent.
    open: Counter[str] = field(default_factory=Counter)
    # Generated tokens of the kept groups that count.
    tokens: int = 0


class Target(Protocol):
    """When a job is satisfied and whether it may open a group for ``agent``."""

    def room(self, agent: str, tally: Tally) -> Room: ...

    def counts(self, agent: str, tally: Tally) -> bool:
        """Whether a kept group of ``agent`` completing now counts toward the target."""
        ...

    def reached(self, tally: Tally) -> bool: ...

    def figures(self, tally: Tally) -> dict[str, Any]:
        """The target's part of the job's status."""
        ...


class GroupFilter(Protocol):
    def teaches_nothing(self, rewards: Sequence[Any]) -> bool: ...


class Ordering(Protocol):
    """The order in which a job's outstanding rollouts start: its ``StartOrder``, or
    None for input order (``admission.order.OrderFor``; ``Job`` calls it once)."""

    def start_order(
        self, settings: RunSettings, history: TaskHistory | None, whole_groups: bool
    ) -> StartOrder | None: ...


def _bound(target: int, overprovision: float | None) -> int:
    return math.ceil(target * (overprovision or 1.0))


@dataclass(frozen=True)
class GroupsTarget:
    """``target_groups`` N: satisfied at N kept groups; new groups start while kept +
    open < ceil(N x overprovision)."""

    target: int
    overprovision: float | None = None

    def room(self, agent: str, tally: Tally) -> Room:
        used = tally.kept.total() + tally.open.total()
        return Room.START if used < _bound(self.target, self.overprovision) else Room.WAIT

    def counts(self, agent: str, tally: Tally) -> bool:
        return True

    def reached(self, tally: Tally) -> bool:
        return tally.kept.total() >= self.target

    def figures(self, tally: Tally) -> dict[str, Any]:
        return {"target_groups": self.target}


@dataclass(frozen=True)
class AgentQuotas:
    """``target_groups_by_agent`` {agent: N}: exactly N kept groups of each agent. An
    agent's new groups start while its kept + open < ceil(N x overprovision); one
    with no room is held aside while the others start (capacity goes to the agents
    behind their quota, never the mix); once its quota is met none of its tasks
    starts. Its groups completing after that are surplus: durable, not counted."""

    quotas: Mapping[str, int]
    overprovision: float | None = None

    def room(self, agent: str, tally: Tally) -> Room:
        quota = self.quotas.get(agent, 0)
        if tally.kept[agent] >= quota:
            return Room.SKIP
        if tally.kept[agent] + tally.open[agent] >= _bound(quota, self.overprovision):
            return Room.DEFER
        return Room.START

    def counts(self, agent: str, tally: Tally) -> bool:
        return tally.kept[agent] < self.quotas.get(agent, 0)

    def reached(self, tally: Tally) -> bool:
        return all(tally.kept[agent] >= n for agent, n in self.quotas.items())

    def figures(self, tally: Tally) -> dict[str, Any]:
        return {
            "target_groups": sum(self.quotas.values()),
            "target_groups_by_agent": dict(self.quotas),
            "groups_kept_by_agent": {agent: tally.kept[agent] for agent in self.quotas},
            "groups_surplus": tally.surplus.total(),
        }


@dataclass(frozen=True)
class TokensTarget:
    """``target_tokens`` N: satisfied once the kept groups hold N generated tokens (the
    group that crosses N is the last one counted: within one group of N)."""

    target: int

    def room(self, agent: str, tally: Tally) -> Room:
        return Room.START

    def counts(self, agent: str, tally: Tally) -> bool:
        return True

    def reached(self, tally: Tally) -> bool:
        return tally.tokens >= self.target

    def figures(self, tally: Tally) -> dict[str, Any]:
        return {"target_tokens": self.target}


class NonzeroRewardStd:
    """``nonzero_reward_std``: a group whose rewards are all equal teaches nothing
    (its advantages are all zero); a missing reward counts as a value of its own."""

    def teaches_nothing(self, rewards: Sequence[Any]) -> bool:
        return len(set(map(_hashable, rewards))) <= 1


def _hashable(value: Any) -> Any:
    return value if isinstance(value, int | float | str | bool | None) else repr(value)


class SettingsOrder:
    """The default ordering: the daemon's ``--start-order`` (contracts §13, start order)."""

    def start_order(
        self, settings: RunSettings, history: TaskHistory | None, whole_groups: bool
    ) -> StartOrder | None:
        return start_order_for(settings, history, whole_groups)


class InputOrder:
    """The task file's order, whatever the daemon's ``--start-order``."""

    def start_order(
        self, settings: RunSettings, history: TaskHistory | None, whole_groups: bool
    ) -> StartOrder | None:
        return None


FILTERS: dict[str, GroupFilter] = {"nonzero_reward_std": NonzeroRewardStd()}


@dataclass(frozen=True)
class StepPolicy:
    """A job's step-control policy: its parts, as its body chose them."""

    target: Target | None = None
    group_filter: GroupFilter | None = None
    ordering: Ordering = field(default_factory=SettingsOrder)

    @property
    def needs_details(self) -> bool:
        """Whether group lines carry their agent and generated tokens (a target that
        reads them, after a restart too)."""
        return isinstance(self.target, AgentQuotas | TokensTarget)


class PolicyFields(Protocol):
    """The job-body fields a policy is built from (``spec.JobSpec``)."""

    @property
    def target_groups(self) -> int | None: ...

    @property
    def target_groups_by_agent(self) -> dict[str, int] | None: ...

    @property
    def target_tokens(self) -> int | None: ...

    @property
    def overprovision(self) -> float | None: ...

    @property
    def group_filter(self) -> str | None: ...


def policy_of(spec: PolicyFields) -> StepPolicy:
    """The policy a job's body asks for (its fields were validated: at most one target)."""
    target: Target | None = None
    if spec.target_groups is not None:
        target = GroupsTarget(spec.target_groups, spec.overprovision)
    elif spec.target_groups_by_agent is not None:
        target = AgentQuotas(dict(spec.target_groups_by_agent), spec.overprovision)
    elif spec.target_tokens is not None:
        target = TokensTarget(spec.target_tokens)
    chosen = FILTERS[spec.group_filter] if spec.group_filter is not None else None
    return StepPolicy(target, chosen)


def teaches_nothing(rewards: Sequence[Any]) -> bool:
    """``nonzero_reward_std``: True (filter the group out) when every reward is equal."""
    return NonzeroRewardStd().teaches_nothing(rewards)
