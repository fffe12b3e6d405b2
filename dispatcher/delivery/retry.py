"""Retry timing for not-delivered attempts (contracts §11): full jitter, ``Retry-After`` kept."""

from __future__ import annotations

import random
from dataclasses import dataclass
from email.utils import parsedate_to_datetime


@dataclass(frozen=True)
class BackoffPolicy:
    base_s: float = 0.5
    cap_s: float = 30.0

    def delay_s(self, retry: int, rng: random.Random, retry_after_s: float | None = None) -> float:
        """Seconds before retry number ``retry`` (0-based): uniform in [0, min(cap, base·2^n)].

        Full jitter spreads a burst of failures over the whole window instead
        of synchronizing them; a ``Retry-After`` is a floor, never shortened.
        """
        ceiling = min(self.cap_s, self.base_s * (2.0 ** min(retry, 32)))
        delay = rng.uniform(0.0, ceiling)
        if retry_after_s is not None:
            delay = max(delay, retry_after_s)
        return delay

    def max_tries_within(self, deadline_s: float) -> float:
        """Tries a rollout can make within ``deadline_s`` at the mean jittered delay."""
        tries, elapsed, retry = 1, 0.0, 0
        while True:
            elapsed += min(self.cap_s, self.base_s * (2.0 ** min(retry, 32))) / 2.0
            if elapsed > deadline_s:
                return float(tries)
            tries += 1
            retry += 1


def parse_retry_after(value: str | None, now_epoch_s: float) -> float | None:
    """``Retry-After`` as seconds from now: delta-seconds or an HTTP date; None if absent or bad."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now_epoch_s)
