"""The service's own series: jobs by state, the policy version, the results stream's
delay, a submit's time to its answer, the admission pause, the step targets of the
jobs not final.

Bounded by design: one series per job state, never one per job (a job's own
figures are at ``GET /v1/jobs/<id>``). States with no job are exported as 0,
so a dashboard sees a job leave a state. The step series sum the jobs not
final: one series per agent of a quota (agents are the daemon's ``--agent``s).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from dispatcher.admission.pause import AdmissionPause
from dispatcher.latency.quantile import quantile
from dispatcher.lifecycle import JobState
from dispatcher.run.daemon import Daemon, peak_rss_mb

# JobState names "paced" (a running job held back by --max-off-policy-steps) itself.
JOB_STATES = tuple(state.value for state in JobState)


class ServiceGauges(Collector):
    def __init__(
        self, job_counts: Callable[[], Mapping[str, int]], policy_version: Callable[[], int | None]
    ) -> None:
        self._job_counts = job_counts
        self._policy_version = policy_version

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily(
            "dispatcher_jobs", "Jobs of the service by state.", labels=["state"]
        )
        counts = self._job_counts()
        for state in JOB_STATES:
            jobs.add_metric([state], counts.get(state, 0))
        yield jobs
        version = GaugeMetricFamily(
            "dispatcher_policy_version", "The trainer's policy version (POST /v1/policy)."
        )
        current = self._policy_version()
        if current is not None:
            version.add_metric([], current)
        yield version


class AdmissionGauges(Collector):
    """The admission pause (contracts §13), read when scraped: the seconds paused count
    the pause under way too."""

    def __init__(self, pause: AdmissionPause) -> None:
        self._pause = pause

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        pause = self._pause
        yield GaugeMetricFamily(
            "dispatcher_admission_paused",
            "1 while an admission pause stops every rollout from starting.",
            value=1 if pause.paused else 0,
        )
        yield CounterMetricFamily(
            "dispatcher_admission_pauses_total",
            "Admission pauses begun (POST /v1/admission).",
            value=pause.pauses,
        )
        yield CounterMetricFamily(
            "dispatcher_admission_paused_seconds_total",
            "Seconds during which admission was paused.",
            value=pause.paused_seconds(),
        )


@dataclass
class StepTotals:
    """The targets of the jobs not final, summed (``Service.step_totals`` in ``jobs.py``)."""

    kept_by_agent: Counter[str] = field(default_factory=Counter)
    quota_by_agent: Counter[str] = field(default_factory=Counter)
    tokens_kept: int = 0
    tokens_target: int = 0


class StepGauges(Collector):
    """Per-agent quotas (kept groups against quota) and token targets, read when scraped."""

    def __init__(self, totals: Callable[[], StepTotals]) -> None:
        self._totals = totals

    def collect(self) -> Iterator[GaugeMetricFamily]:
        totals = self._totals()
        kept = GaugeMetricFamily(
            "dispatcher_step_groups_kept",
            "Kept groups counting toward per-agent quotas, of the jobs not final.",
            labels=["agent"],
        )
        quota = GaugeMetricFamily(
            "dispatcher_step_groups_quota",
            "Per-agent quotas (target_groups_by_agent) of the jobs not final.",
            labels=["agent"],
        )
        for agent in sorted(totals.quota_by_agent):
            kept.add_metric([agent], totals.kept_by_agent[agent])
            quota.add_metric([agent], totals.quota_by_agent[agent])
        yield kept
        yield quota
        yield GaugeMetricFamily(
            "dispatcher_step_tokens_kept",
            "Generated tokens in the kept groups of the jobs with a token target, not final.",
            value=totals.tokens_kept,
        )
        yield GaugeMetricFamily(
            "dispatcher_step_tokens_target",
            "The token targets (target_tokens) of the jobs not final.",
            value=totals.tokens_target,
        )


# The delay goal is tens of milliseconds; the top buckets catch a stalled stream.
DELAY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def declare_service_metrics(
    registry: CollectorRegistry,
    job_counts: Callable[[], Mapping[str, int]],
    policy_version: Callable[[], int | None],
    pause: AdmissionPause,
    step_totals: Callable[[], StepTotals],
) -> Durations:
    """Register the service's series; returns the results' delays to observe."""
    registry.register(ServiceGauges(job_counts, policy_version))
    registry.register(AdmissionGauges(pause))
    registry.register(StepGauges(step_totals))
    histogram = Histogram(
        "dispatcher_results_delay_seconds",
        "From a row (or a group's last row) being durable to its delivery on a results stream.",
        ("mode",),
        buckets=DELAY_BUCKETS_S,
        registry=registry,
    )
    return Durations(histogram)


class Durations:
    """How long one kind of thing took (a submit's answer, a row's delivery): a
    histogram on ``/metrics``, the last ``window`` of them for ``/status``'s quantiles."""

    def __init__(self, histogram: Histogram, window: int = 10_000) -> None:
        self.histogram = histogram
        self.recent: deque[float] = deque(maxlen=window)

    def observe(self, seconds: float, *labels: str) -> None:
        """Record one; ``labels``: the histogram's own, where it has some."""
        (self.histogram.labels(*labels) if labels else self.histogram).observe(seconds)
        self.recent.append(seconds)

    def quantiles(self) -> dict[str, float | None]:
        """p50, p99 and max of the figures kept, for ``/status`` (None where none is)."""
        ordered = sorted(self.recent)
        return {
            "p50": quantile(ordered, 0.5),
            "p99": quantile(ordered, 0.99),
            "max": ordered[-1] if ordered else None,
        }


def submit_durations(registry: CollectorRegistry) -> Durations:
    """A submit's seconds from its handler's start (its body read) to its answer: 201
    once its job is journaled, 200 for the same body again. The daemon's own share
    of what its client waits, the loop's queue before the handler aside."""
    histogram = Histogram(
        "dispatcher_submit_seconds",
        "From a POST /v1/jobs handler's start (its body read) to its answer (201 once "
        "the job is journaled, 200 for the same body again).",
        buckets=DELAY_BUCKETS_S,
        registry=registry,
    )
    return Durations(histogram)


class ServiceView(Protocol):
    """What ``/status`` reads of the service (``jobs.Service``), named here so this
    module need not import the one that imports it."""

    @property
    def daemon(self) -> Daemon: ...
    @property
    def max_off_policy_steps(self) -> Any: ...
    @property
    def compaction(self) -> Any: ...
    @property
    def streams(self) -> Any: ...
    @property
    def bodies(self) -> Any: ...
    def running(self) -> Sequence[Any]: ...
    def job_counts(self) -> dict[str, int]: ...
    def delay_quantiles(self) -> dict[str, float | None]: ...
    @property
    def submit_times(self) -> Durations: ...


def service_status(service: ServiceView) -> dict[str, Any]:
    """The daemon's ``/status``: its figures and the service's (jobs, streams, delays)."""
    daemon = service.daemon
    running = service.running()
    progress = Counter[str]()
    for job in running:
        progress.update({k: v or 0 for k, v in job.progress().items()})
    outcomes = Counter[str]()
    for job in running:
        outcomes.update(job.outcomes)
    return {
        "state": str(daemon.phase.state),
        "elapsed_s": round(daemon.elapsed_s(), 3),
        "policy_version": daemon.policy_version(),
        "max_off_policy_steps": service.max_off_policy_steps,
        "jobs": service.job_counts(),
        # Jobs held in memory whole (running); a final one holds a few fields.
        "jobs_running_in_memory": len(running),
        # Settled jobs folded into archives (contracts §12), not in "jobs".
        "jobs_archived": service.compaction.archived if service.compaction else 0,
        # What clients hold of the daemon now, against its bounds (contracts §12).
        "streams_open": service.streams.open,
        "request_bytes_held": service.bodies.held,
        "requests_waiting": service.bodies.waiting,
        "progress": dict(progress),
        "outcomes": dict(outcomes),
        "rollouts_per_hour": daemon.metrics.rollouts_per_hour(),
        "latency_s": daemon.latency_quantiles(),
        "drain_margin_s": daemon.drain_margin(),
        "budget_remaining_s": daemon.budget.remaining_s(),
        "in_flight_by_agent": daemon.in_flight_by_agent(),
        "committing": daemon.commit_queue.committing,
        # Jobs whose next rollout waits for a slot of the shared pool.
        "slot_waiters": daemon.slot_waiters(),
        **daemon.delivery_figures(),
        "metrics_url": daemon.metrics_endpoint.url if daemon.metrics_endpoint else None,
        "results_delay_s": service.delay_quantiles(),
        # POST /v1/jobs answered (201 or 200): the last 10,000.
        "submit_s": service.submit_times.quantiles(),
        "event_loop_lag_p99_s": daemon.lag.p99_s(),
        "event_loop_lag_max_s": daemon.lag.max_s(),
        "peak_rss_mb": peak_rss_mb(),
    }
