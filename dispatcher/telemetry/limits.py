"""The run's configured limits as gauges, so alert rules can compare live figures to them.

``dispatcher_rollout_timeout_seconds`` is ``--rollout-timeout-s``: the
"p95 near the timeout" rule of ``config/prometheus/alerts.yml`` divides the
live p95 by it. Absent when no timeout is set (the rule then stays silent).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry


class RunLimits(Collector):
    """Collects the configured limits of one run."""

    def __init__(self, rollout_timeout_s: float | None) -> None:
        self.rollout_timeout_s = rollout_timeout_s

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "dispatcher_rollout_timeout_seconds", "The per-rollout timeout (--rollout-timeout-s)."
        )
        if self.rollout_timeout_s is not None:
            family.add_metric([], self.rollout_timeout_s)
        yield family


# A registry refuses a second collector of the same name: one per registry.
_declared: weakref.WeakKeyDictionary[CollectorRegistry, RunLimits] = weakref.WeakKeyDictionary()


def declare_run_limits(registry: CollectorRegistry, rollout_timeout_s: float | None) -> None:
    """Register the limits on ``registry`` once; a later run on the same registry updates them."""
    limits = _declared.get(registry)
    if limits is None:
        limits = _declared[registry] = RunLimits(rollout_timeout_s)
        registry.register(limits)
    limits.rollout_timeout_s = rollout_timeout_s
