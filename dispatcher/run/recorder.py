"""The one place a job counts how its rollouts ended (contracts §5, §8, §15).

``Recorder.record`` takes every outcome a job's flights land with (and
``not_started`` every rollout the job did not start): it counts it, feeds the
latency views, decides finality by the one rule, tells service mode of final
rollouts, logs ``rollout_finished``, keeps the run's state current for the
coverage and status files, notes rollouts left without a result
(``--record-omitted``), and says when counted failures pass
``--max-failure-fraction`` and when a finished run has nothing to show but
one kind of failure.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from dispatcher.delivery.answers import Attempt
from dispatcher.errors import DispatcherError
from dispatcher.files.resume import RunState, final_after_failure, spends_attempt
from dispatcher.files.writer import RowWriter
from dispatcher.outcome import Outcome
from dispatcher.run.daemon import Daemon
from dispatcher.run.gym_files import OmittedRows, ProgressFiles
from dispatcher.run.prepare import PreparedRun
from dispatcher.run.reporting import RolloutFinishedLog
from dispatcher.run.views import LatencyView
from dispatcher.settings.config import RunSettings
from dispatcher.tasks.keys import AGENT_REF, rollout_key
from dispatcher.tasks.materialize import Rollout

# Called with (rollout, outcome, seq, row facts) for each final outcome: service
# mode's results stream and group bookkeeping.
FinalHook = Callable[[Rollout, Outcome, "int | None", "dict[str, Any] | None"], None]


class FailureLimitExceeded(DispatcherError):
    """Counted failures passed ``--max-failure-fraction`` of the expected rollouts."""


class NothingSucceeded(DispatcherError):
    """Every rollout is final, none succeeded, and all failed the same way (contracts §10):
    a broken agent or a wrong setting, never a finished run (exit 1, job ``failed``)."""


class Recorder:
    """Counts a job's outcomes; see the module docstring."""

    def __init__(
        self,
        settings: RunSettings,
        daemon: Daemon,
        views: tuple[LatencyView, ...],
        on_final: FinalHook | None,
        log: Any,
    ) -> None:
        self.settings = settings
        self.daemon = daemon
        self._metrics = daemon.metrics
        self.outcomes: Counter[str] = Counter()
        self.final_this_run = 0
        # Failures this hop that spent an attempt (the failure limit's count).
        self.counted_failures = 0
        self._views = views
        self._on_final = on_final
        self.log = log
        self._log_finished = RolloutFinishedLog(log)
        # Attached once the run's files are open.
        self.state: RunState | None = None
        self.omitted: OmittedRows | None = None
        self.files: ProgressFiles | None = None
        self._expected = 0

    def attach(self, prepared: PreparedRun, failures: RowWriter) -> str:
        """Keep the run's state current and write what NeMo Gym Main reads; the run's id."""
        run_id = prepared.record.run_id or ""
        state, materialized = prepared.state, prepared.materialized
        writer = failures if self.settings.record_omitted else None
        self.state, self._expected = state, materialized.rollouts
        self.omitted = OmittedRows(writer, run_id, state)
        self.files = ProgressFiles(prepared.paths, state, run_id, materialized.rollouts_by_agent)
        return run_id

    async def drain(self) -> None:
        """Wait for the omitted rollouts' rows (before the failures writer closes)."""
        if self.omitted is not None:
            await self.omitted.drain()

    async def finish(self, aggregation: dict[str, str]) -> Callable[[], None]:
        """The write (blocking, ``OSError`` if not written) of the hop's last status
        file and its coverage file."""
        if self.files is not None and self.omitted is not None:
            return await self.files.finish(self._expected, self.omitted.omissions(), aggregation)
        return lambda: None

    def record(
        self,
        rollout: Rollout,
        outcome: Outcome,
        duration_s: float,
        attempt: Attempt | None = None,
        row: dict[str, Any] | None = None,
        capture: dict[str, Any] | None = None,
        seq: int | None = None,
    ) -> None:
        # Once per rollout: ``Outcome.value`` is a property, ``_value_`` the attribute.
        value = outcome._value_
        self.outcomes[value] += 1
        self._record_latency(outcome, duration_s)
        final = outcome is Outcome.SUCCESS or self._is_final(rollout, outcome, row)
        if final:
            self.final_this_run += 1
            if self._on_final is not None:
                self._on_final(rollout, outcome, seq, row)
        self._keep_state(rollout, outcome, row, duration_s)
        self._metrics.rollout_finished(rollout.agent, value, duration_s)
        self.daemon.release_session(rollout)
        self._log_finished(rollout, outcome, final, duration_s, attempt, row, capture)

    def not_started(self, rollout: Rollout, outcome: Outcome) -> None:
        """A rollout this hop did not start (the budget drained it, its agent is down)."""
        self.outcomes[outcome.value] += 1
        if outcome is Outcome.DRAINED:
            for view in self._views:
                view.record_drained()
            self.daemon.metrics.rollout_drained()
            if self.omitted is not None:
                self.omitted.note(rollout, outcome, None)

    def _record_latency(self, outcome: Outcome, duration_s: float) -> None:
        if outcome is Outcome.SUCCESS:
            for view in self._views:
                view.record(duration_s)
        elif outcome.writes_failure_row:
            for view in self._views:
                view.record_failure(duration_s)

    def _is_final(self, rollout: Rollout, outcome: Outcome, row: dict[str, Any] | None) -> bool:
        if outcome is Outcome.SUCCESS:
            return True
        if not outcome.writes_failure_row or row is None:
            return False
        # Its counted failures, not its attempt index: an index skips the attempts
        # killed hops sent and the ones not delivered (contracts §5).
        earlier = (
            rollout.attempt_index
            if self.state is None
            else self.state.failed_attempts.get(rollout.key, 0)
        )
        return final_after_failure(row, earlier, self.settings.attempt_cap)

    def _keep_state(
        self, rollout: Rollout, outcome: Outcome, row: dict[str, Any] | None, duration_s: float
    ) -> None:
        """The run's state as its files now say it: what coverage and status read."""
        state = self.state
        if state is None:
            return
        if row is None:
            if self.omitted is not None and outcome is not Outcome.REQUEUED:
                self.omitted.note(rollout, outcome, duration_s)
            return
        key = rollout_key(rollout.task_index, rollout.rollout_index)
        if outcome is Outcome.SUCCESS:
            state.add_success(key, rollout.agent, row.get("reward"), row.get("mask_sample"))
        else:
            state.add_failure(key, {**row, AGENT_REF: {"name": rollout.agent}})
            self.counted_failures += spends_attempt(row)
        if self.files is not None:
            self.files.row_written()

    def failure_limit(self) -> FailureLimitExceeded | None:
        """The error that stops the job once counted failures exceed the limit, else None."""
        fraction = self.settings.max_failure_fraction
        if fraction is None or self.counted_failures <= fraction * self._expected:
            return None
        return FailureLimitExceeded(
            f"--max-failure-fraction {fraction}: {self.counted_failures} counted failures "
            f"of {self._expected} expected rollouts this hop exceed the limit "
            f"({fraction * self._expected:g}); no rollout starts any more"
        )
