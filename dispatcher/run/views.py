"""What the daemon (``daemon.py``) reads of the parts it is given: the latency
view behind the drain margin and the live quantiles, and its jobs."""

from __future__ import annotations

from typing import Protocol


class LatencyView(Protocol):
    """Durations behind the drain margin and the live quantiles (contracts §8)."""

    def record(self, duration_s: float) -> None: ...
    def record_failure(self, duration_s: float) -> None: ...
    def record_drained(self) -> None: ...
    def quantile(self, q: float) -> float | None: ...
    def drain_margin(self, configured_s: float | None) -> float | None: ...


class JobView(Protocol):
    """What the daemon reads of its jobs (for the gauges and the budget's end); it
    tells them what happens through its events, never by calling into them."""

    def remaining(self) -> int: ...
    def at_agents(self) -> int: ...
