"""The one definition of a quantile (contracts §8): linear interpolation between the
closest ranks of ascending values. The tracker, the live window, the report, the
stream delays, the loop lag and Gym's drain margin all read theirs from here."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def quantile_at(value_at: Callable[[int], float], count: int, q: float) -> float | None:
    """The q-quantile of ``count`` ascending values, ``value_at(i)`` the i-th (a sorted
    list's index, or a histogram's walk); None for none."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    if count == 0:
        return None
    position = q * (count - 1)
    lower = int(position)
    low = value_at(lower)
    if lower + 1 >= count:
        return low
    return low + (value_at(lower + 1) - low) * (position - lower)


def quantile(ordered: Sequence[float], q: float) -> float | None:
    """The q-quantile of an ascending sequence; None when it is empty."""
    return quantile_at(ordered.__getitem__, len(ordered), q)
