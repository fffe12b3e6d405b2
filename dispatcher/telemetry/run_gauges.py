"""Gauges read at scrape time from the run's settings and its replicas.

- ``dispatcher_rollout_timeout_seconds``: ``--rollout-timeout-s``; the "p95
  near the timeout" rule of ``config/prometheus/alerts.yml`` divides the live
  p95 by it. Absent when no timeout is set (the rule then stays silent).
- ``dispatcher_replica_rollouts_in_flight{agent,replica}``: rollouts in
  flight per replica, the split of ``dispatcher_rollouts_in_flight{agent}``.
  Read from the agent client's own counts when Prometheus scrapes, so the
  per-rollout path pays nothing for it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

InFlightByReplica = Callable[[], Mapping[str, Mapping[str, int]]]


class RunGauges(Collector):
    """Collects the configured limits and the per-replica in-flight counts of one run."""

    def __init__(self) -> None:
        self.rollout_timeout_s: float | None = None
        self.in_flight: InFlightByReplica | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        timeout = GaugeMetricFamily(
            "dispatcher_rollout_timeout_seconds", "The per-rollout timeout (--rollout-timeout-s)."
        )
        if self.rollout_timeout_s is not None:
            timeout.add_metric([], self.rollout_timeout_s)
        yield timeout
        replicas = GaugeMetricFamily(
            "dispatcher_replica_rollouts_in_flight",
            "Rollouts in flight per agent replica.",
            labels=["agent", "replica"],
        )
        for agent, by_url in (self.in_flight() if self.in_flight else {}).items():
            for url, count in by_url.items():
                replicas.add_metric([agent, url], count)
        yield replicas


# A registry refuses a second collector of the same name: one per registry.
_declared: weakref.WeakKeyDictionary[CollectorRegistry, RunGauges] = weakref.WeakKeyDictionary()


def declare_run_gauges(
    registry: CollectorRegistry, rollout_timeout_s: float | None, in_flight: InFlightByReplica
) -> None:
    """Register the gauges on ``registry`` once; a later run on the same registry updates them."""
    gauges = _declared.get(registry)
    if gauges is None:
        gauges = _declared[registry] = RunGauges()
        registry.register(gauges)
    gauges.rollout_timeout_s = rollout_timeout_s
    gauges.in_flight = in_flight
