"""``dispatcher run``: one job on a daemon of its own, from startup to its exit code.

Reading order: ``Dispatcher.run`` is the table of contents: the listener
(``daemon.py``), the job's files (``job.py``), the agents' session and the
telemetry, then dispatch until every rollout settles or a stop, then the
ordered shutdown, which the exit stack runs in reverse: the job's files
first, the listener last. Data flow: materialized rows → pool (slot, drain
check) → ``Flight`` (agent call, then commit: capture merge, one append, then
the rollout counts) → ``Job.record`` → tracker and metrics.

Crash-only: the output files are the only state. Graceful shutdown only
saves time; a kill -9 anywhere loses nothing that was acknowledged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import structlog

from dispatcher.errors import ExitCode
from dispatcher.latency.tracker import DispatchLatencyTracker
from dispatcher.lifecycle import Phase
from dispatcher.run.daemon import Daemon
from dispatcher.run.job import Job
from dispatcher.settings.config import RunSettings
from dispatcher.telemetry.metrics import Metrics

log = structlog.get_logger("dispatcher.run")


class Dispatcher:
    """A daemon running exactly one job: ``dispatcher run``."""

    def __init__(
        self,
        settings: RunSettings,
        *,
        budget_s: float | None,
        shard_filter: Callable[[int], bool] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        # The daemon's live view is the job's exact tracker: there is one job.
        self.tracker = DispatchLatencyTracker()
        self.daemon = Daemon(settings, budget_s=budget_s, latency=self.tracker, metrics=metrics)
        self.metrics = self.daemon.metrics
        self.job = Job(self.daemon, settings, shard_filter=shard_filter, tracker=self.tracker)

    @property
    def state(self) -> str:
        return str(self.daemon.phase.state)

    async def run(self) -> ExitCode:
        """Run to completion or to a stop; return the process exit code."""
        daemon, job = self.daemon, self.job
        async with contextlib.AsyncExitStack() as stack:
            await daemon.listen(self.status, daemon.healthy)
            stack.push_async_callback(daemon.close)
            await job.open()
            # Every later line, stdlib records included, carries the run id.
            structlog.contextvars.bind_contextvars(run_id=job.started_event()["run_id"])
            stack.push_async_callback(job.close)
            await daemon.start(self.status)
            if daemon.metrics_endpoint is not None:
                log.info("metrics_listening", url=daemon.metrics_endpoint.url)
            log.info(
                "run_started",
                **job.started_event(),
                concurrency=daemon.concurrency,
                dispatch_budget_s=self.settings.dispatch_budget_s,
                delivery_deadline_s=self.settings.delivery_deadline_s,
            )
            daemon.begin_dispatch()
            daemon.watch_agents_reached(self.settings.wait_for_agents_s)
            await job.dispatch()
            daemon.phase.advance(Phase.SHUTTING_DOWN)
        return job.exit_code()

    def remaining(self) -> int:
        return self.job.remaining()

    def summary(self) -> dict[str, Any]:
        return self.job.summary()

    def status(self) -> dict[str, Any]:
        """The live snapshot behind /status, progress events and the summary."""
        daemon, job = self.daemon, self.job
        prepared = job.prepared
        rate = daemon.metrics.rollouts_per_hour()
        return {
            "run_id": prepared.record.run_id if prepared else None,
            "state": self.state,
            "elapsed_s": round(daemon.elapsed_s(), 3),
            "progress": job.progress(),
            "outcomes": dict(job.outcomes),
            "rollouts_per_hour": rate,
            "latency_s": daemon.latency_quantiles(),
            "drain_margin_s": daemon.drain_margin(),
            "budget_remaining_s": daemon.budget.remaining_s(),
            "eta_s": job.eta_s(rate),
            "in_flight_by_agent": daemon.in_flight_by_agent(),
            "drained": self.tracker.drained,
            **daemon.delivery_figures(),
            "metrics_url": daemon.metrics_endpoint.url if daemon.metrics_endpoint else None,
        }
