"""Which upstream a model call goes to: by the rollout it belongs to (contracts §6).

Only the dispatcher knows which calls are one rollout's (the ``/ng-rollout/<id>/``
prefix) and which rollouts share a prompt (the repeats of one task: a *group*).
Replicas that keep a prefix cache reuse it when a rollout's growing conversation,
and its siblings' shared prompt, come back to them:

- ``round_robin``: per call, the baseline. Its sessions are known all the same (as
  where their first call went), so their release reaches the upstream.
- ``session``: a rollout's first call goes to the least loaded upstream (fewest
  live sessions, then fewest calls in flight, then fewest calls so far); its later
  calls follow it.
- ``group``: a rollout's first call goes where its group went; its later calls
  follow it.

The margin, under both: an upstream with more than ``margin`` calls in flight above
the least loaded one (under ``group``, the calls of the rollout's own group not counted) is
passed over, at every call, not only at a rollout's first:
the call goes to the upstream with the fewest calls in flight, and its rollout's pin
moves there (its conversation is cached there from this call on); a group stays where
its prompt is cached. A pin never becomes a hot spot: a slow replica keeps no more than
``margin`` calls above the rest, whatever was pinned to it before it slowed (consistent
hashing without load awareness is how one published run fell from 98 % to 5 % prefix
hits).

A call that cannot connect goes to the next upstream and the pin moves with it.
Sessions end when the dispatcher releases them (``release``) or, past
``max_sessions``, oldest first; group pins are kept for ``max_groups``, oldest
first. Memory stays bounded whatever the agents send.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum


class RoutePolicy(StrEnum):
    ROUND_ROBIN = "round_robin"
    SESSION = "session"
    GROUP = "group"


DEFAULT_MARGIN = 4
DEFAULT_MAX_SESSIONS = 100_000
DEFAULT_MAX_GROUPS = 100_000

# Identity headers on every forwarded call of a rollout (the proxy's replace an agent's):
# a router in front of the engines can route by them.
SESSION_HEADER = "X-Session-ID"
GROUP_HEADER = "X-Prefix-Group"
# The proxy's routes by which the dispatcher releases sessions: one rollout's
# (``/ng-release/<id>``), or several in one call (``POST /ng-release``, their ids in
# ``session_ids``).
RELEASE_PATH = "/ng-release"
RELEASE_PREFIX = RELEASE_PATH + "/"

# The per-hop token that makes a capture id of a rollout id (keys.CAPTURE_TOKEN_LEN).
_TOKEN_PATTERN = r"\.[0-9a-f]{8}"
# "<task>-<rollout>[-a<attempt>][.<hop token>]": the dispatcher's own rollout ids
# (contracts §2, §6). The group is the task within its hop: "<task>.<token>".
_DISPATCHER_ID = re.compile(rf"(?P<task>\d+)-\d+(?:-a\d+)?(?P<token>{_TOKEN_PATTERN})?")
_TOKEN = re.compile(_TOKEN_PATTERN + "$")


def group_of(rollout_id: str) -> str:
    """The prefix group of a rollout: its task (within its hop) for the dispatcher's ids;
    a row's own ``_ng_rollout_id`` names no siblings, so it is its own group."""
    match = _DISPATCHER_ID.fullmatch(rollout_id)
    if match is None:
        return rollout_id
    return f"t{match['task']}{match['token'] or ''}"


@dataclass
class Upstream:
    """One model server (or engine) the proxy forwards to, with its live load."""

    url: str
    in_flight: int = 0
    sessions: int = 0
    calls: int = 0
    # From the answers' usage: prompt tokens, and those the upstream had cached.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # Calls of rollouts pinned here sent elsewhere: it was past the margin.
    passed_over: int = 0


class Router:
    """Picks an upstream per call, pins sessions and groups; see the module docstring."""

    def __init__(
        self,
        urls: list[str],
        policy: RoutePolicy,
        margin: int = DEFAULT_MARGIN,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_groups: int = DEFAULT_MAX_GROUPS,
    ) -> None:
        if not urls:
            raise ValueError("at least one upstream")
        self.upstreams = [Upstream(url.rstrip("/")) for url in urls]
        self.policy = policy
        self.margin = margin
        self._max_sessions = max_sessions
        self._max_groups = max_groups
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._groups: OrderedDict[str, int] = OrderedDict()
        # Calls in flight per (group, upstream): a group's own calls are no load against
        # its siblings (group policy only; an entry lives while it has a call).
        self._group_calls: dict[tuple[str, int], int] = {}
        self._next = 0

    @property
    def live_sessions(self) -> int:
        return len(self._sessions)

    def pick(self, rollout_id: str) -> int:
        """The upstream for this rollout's next call (its index)."""
        pinned = self._sessions.get(rollout_id)
        if self.policy is RoutePolicy.ROUND_ROBIN or len(self.upstreams) == 1:
            # Per call; the session is still known (where its first call went), so that
            # its end reaches the upstream: a router in front of engines, most often.
            index = self._round_robin()
            if pinned is None:
                self._pin(rollout_id, index)
            return index
        if pinned is None:
            if self.policy is RoutePolicy.GROUP:
                pinned = self._for_group(group_of(rollout_id))
            else:
                pinned = self._least_loaded()
        chosen = pinned
        if self._overloaded(pinned, rollout_id):
            # Its later calls follow it: the pin moves (the group's stays).
            chosen = self._fewest_in_flight()
            self.upstreams[pinned].passed_over += 1
        if self._sessions.get(rollout_id) != chosen:
            self._pin(rollout_id, chosen)
        return chosen

    def any(self) -> int:
        """The upstream for a call that names no rollout: round robin."""
        return self._round_robin()

    def after(self, index: int) -> int:
        """The upstream after ``index``, for a call that names no rollout."""
        return (index + 1) % len(self.upstreams)

    def started(self, index: int, rollout_id: str | None = None) -> None:
        upstream = self.upstreams[index]
        upstream.in_flight += 1
        upstream.calls += 1
        if rollout_id is not None and self.policy is RoutePolicy.GROUP:
            key = (group_of(rollout_id), index)
            self._group_calls[key] = self._group_calls.get(key, 0) + 1

    def ended(self, index: int, rollout_id: str | None = None) -> None:
        self.upstreams[index].in_flight -= 1
        if rollout_id is not None and self.policy is RoutePolicy.GROUP:
            key = (group_of(rollout_id), index)
            left = self._group_calls.pop(key, 1) - 1
            if left:
                self._group_calls[key] = left

    def unreachable(self, rollout_id: str, index: int) -> int:
        """The next upstream after ``index`` for a call that could not connect; the
        rollout's (and its group's) pin moves with it."""
        following = (index + 1) % len(self.upstreams)
        if rollout_id in self._sessions:
            self._pin(rollout_id, following)
        if self.policy is RoutePolicy.GROUP:
            self._remember(self._groups, group_of(rollout_id), following, self._max_groups)
        return following

    def release(self, rollout_id: str) -> str | None:
        """Forget a rollout's session (its rollout ended): the session's id, or None if
        it had none. The dispatcher names a rollout by its capture id (``<rollout
        id>.<token>``), which an agent may have called under, or under the rollout id."""
        for session_id in (rollout_id, _TOKEN.sub("", rollout_id)):
            index = self._sessions.pop(session_id, None)
            if index is not None:
                self.upstreams[index].sessions -= 1
                return session_id
        return None

    # ---- choosing -----------------------------------------------------------------

    def _round_robin(self) -> int:
        index = self._next % len(self.upstreams)
        self._next = index + 1
        return index

    def _least_loaded(self) -> int:
        # Ties (idle upstreams, most often) go to the one that took the fewest calls so
        # far: by position, the first upstreams took every new group while the last idled.
        loads = [(u.sessions, u.in_flight, u.calls, i) for i, u in enumerate(self.upstreams)]
        return min(loads)[3]

    def _fewest_in_flight(self) -> int:
        loads = [(u.in_flight, u.sessions, i) for i, u in enumerate(self.upstreams)]
        return min(loads)[2]

    def _for_group(self, group: str) -> int:
        # An overloaded group's rollouts go elsewhere (``pick``); the group stays where
        # its prefix is cached (moving the pin made every overflow a cold start on the
        # new upstream). Elsewhere is the fewest calls in flight, what overloaded means:
        # by live sessions first, the overloaded upstream itself could be the one chosen.
        pinned = self._groups.get(group)
        if pinned is None:
            pinned = self._least_loaded()
        self._remember(self._groups, group, pinned, self._max_groups)
        return pinned

    def _overloaded(self, pinned: int, rollout_id: str) -> bool:
        """More than ``margin`` calls in flight above the least loaded other upstream,
        its siblings' own calls not counted: a group keeps its repeats together by
        design, so an upstream holding one more group than the others is a group's
        calls above them (8 for 8 repeats); against a margin of 4 that moved rollouts
        off their cached prefix all the time where only other groups' calls are a
        pile-up."""
        loads = [u.in_flight for u in self.upstreams]
        least = min(load for i, load in enumerate(loads) if i != pinned)
        siblings = 0
        if self.policy is RoutePolicy.GROUP:
            siblings = self._group_calls.get((group_of(rollout_id), pinned), 0)
        return loads[pinned] - siblings > least + self.margin

    # ---- bookkeeping ----------------------------------------------------------------

    def _pin(self, rollout_id: str, index: int) -> None:
        earlier = self._sessions.get(rollout_id)
        if earlier is not None:
            self.upstreams[earlier].sessions -= 1
        self.upstreams[index].sessions += 1
        self._sessions[rollout_id] = index
        self._sessions.move_to_end(rollout_id)
        while len(self._sessions) > self._max_sessions:
            _, oldest = self._sessions.popitem(last=False)
            self.upstreams[oldest].sessions -= 1

    @staticmethod
    def _remember(pins: OrderedDict[str, int], key: str, index: int, limit: int) -> None:
        pins[key] = index
        pins.move_to_end(key)
        while len(pins) > limit:
            pins.popitem(last=False)
