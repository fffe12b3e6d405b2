"""A job's figures and the end of its hop, mixed into ``Job`` (``job.py``): what is
expected, done and remaining, the pace and ETA, the summary, the final state and
exit code, Gym's aggregate file and the manifest's ``last_run``. It reads the
job's state and changes none of it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from dispatcher.admission.order import StartOrder
from dispatcher.errors import DispatcherError, ExitCode
from dispatcher.files.resume import OutputPaths
from dispatcher.lifecycle import JobState
from dispatcher.run.aggregate import WithoutRoute, aggregate_metrics, aggregate_metrics_path
from dispatcher.run.recorder import FailureLimitExceeded, Recorder
from dispatcher.run.reporting import hop_summary, write_last_run
from dispatcher.telemetry.progress import estimate_eta_s

if TYPE_CHECKING:
    from dispatcher.latency.tracker import DispatchLatencyTracker
    from dispatcher.run.daemon import Daemon
    from dispatcher.run.flight import Flight
    from dispatcher.run.prepare import PreparedRun
    from dispatcher.settings.config import RunSettings


@dataclass(frozen=True)
class HopEnd:
    """How a job records the end of a hop. ``durable=False``: its ``end_files`` are
    written without fsync, and the job's owner makes them durable before it records
    the job final (a served job, ``Registry.save_final``). ``session``: the owner's
    HTTP session for Gym's aggregate call, its connections kept between jobs;
    ``without``: the agents without the route it remembers between jobs."""

    durable: bool = True
    session: aiohttp.ClientSession | None = None
    without: WithoutRoute | None = None


class JobFigures:
    """The figures and the end-of-hop records of a ``Job``, from the state it owns."""

    daemon: Daemon
    settings: RunSettings
    tracker: DispatchLatencyTracker
    recorder: Recorder
    prepared: PreparedRun | None
    fatal: DispatcherError | None
    flights: set[Flight]
    _at_agents: int
    _cancel_reason: str | None
    _opened_at: float | None
    _dispatch_started: float | None
    _dispatch_ended: float | None
    order: StartOrder | None
    end: HopEnd

    # ---- the end of the hop -------------------------------------------------------------

    def _final_state(self) -> JobState:
        if self.fatal is not None or self.daemon.fatal is not None:
            return JobState.FAILED
        if self._cancel_reason is not None:
            return JobState.CANCELLED
        return JobState.DONE if self.remaining() == 0 else JobState.INCOMPLETE

    async def _write_aggregate_metrics(self) -> dict[str, str]:
        """Gym's end-of-run file, once every rollout has its final row (a hop that leaves
        work for a rerun would only write numbers the next hop replaces); each agent's
        aggregation status for the status file."""
        if self.fatal is not None or self.prepared is None or self.remaining() > 0:
            return {}
        aggregated = await aggregate_metrics(
            self.prepared.paths.output,
            self.settings.agents,
            session=self.end.session,
            durable=self.end.durable,
            without=self.end.without,
        )
        return aggregated.states(self.settings.agents)

    def exit_code(self) -> ExitCode:
        """The hop's exit code; raises the error that failed it."""
        error = self.fatal or self.daemon.fatal
        if error is not None:
            raise error
        return self._final_exit_code()

    def _final_exit_code(self) -> ExitCode:
        return ExitCode.RESUMABLE if self.remaining() > 0 else ExitCode.DONE

    # ---- outcomes (counted in ``recorder.py``) -------------------------------------

    @property
    def outcomes(self) -> Counter[str]:
        return self.recorder.outcomes

    # ---- figures ----------------------------------------------------------------------

    def expected(self) -> int | None:
        return self.prepared.materialized.rollouts if self.prepared is not None else None

    def remaining(self) -> int:
        prepared = self.prepared
        if prepared is None:
            return 0
        final = prepared.already_final + self.recorder.final_this_run
        return max(0, prepared.materialized.rollouts - final)

    @property
    def final_this_run(self) -> int:
        """Rollouts this hop made final."""
        return self.recorder.final_this_run

    def at_agents(self) -> int:
        return self._at_agents

    def committing(self) -> int:
        return len(self.flights) - self._at_agents

    def progress(self) -> dict[str, Any]:
        expected = self.expected()
        remaining = self.remaining()
        return {
            "expected": expected,
            "done": (expected or 0) - remaining,
            "remaining": remaining,
            "in_flight": self.at_agents(),
            "committing": self.committing(),
        }

    def eta_s(self, rollouts_per_hour: float) -> float | None:
        return estimate_eta_s(self.remaining(), rollouts_per_hour)

    def dispatch_seconds(self) -> float:
        """How long this hop of the job has dispatched (or did)."""
        if self._dispatch_started is None:
            return 0.0
        return (self._dispatch_ended or self.daemon.clock()) - self._dispatch_started

    def rollouts_per_hour(self) -> float:
        """The job's own pace: its outcomes of this hop over its own dispatch time."""
        elapsed_s = self.dispatch_seconds()
        return sum(self.outcomes.values()) / elapsed_s * 3600.0 if elapsed_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        opened = self._opened_at
        elapsed_s = 0.0 if opened is None else self.daemon.clock() - opened
        summary = hop_summary(
            self.daemon,
            self.tracker,
            self.outcomes,
            self.remaining(),
            (self.dispatch_seconds(), elapsed_s),
        )
        if self.order is not None:
            summary["start_order"] = self.order.figures()
        if isinstance(self.fatal, FailureLimitExceeded):
            summary["failure_limit_exceeded"] = str(self.fatal)
        return summary

    def _write_end_files(self, write_files: Callable[[], None], summary: dict[str, Any]) -> None:
        """The hop's status and coverage files (``write_files``), then its manifest's
        ``last_run``, in one thread hop (blocking)."""
        write_files()
        assert self.prepared is not None
        error = self.fatal or self.daemon.fatal
        exit_code = int(error.exit_code if error else self._final_exit_code())
        figures = self.daemon.delivery_figures()
        write_last_run(
            self.prepared, summary, self.outcomes, exit_code, figures, durable=self.end.durable
        )


def end_files(output: Path) -> list[Path]:
    """What the end of a hop writes beside its rows ``output``: its manifest, status,
    coverage and aggregate files (some may be absent)."""
    paths = OutputPaths.for_output(output)
    return [paths.manifest, paths.status, paths.coverage, aggregate_metrics_path(output)]
