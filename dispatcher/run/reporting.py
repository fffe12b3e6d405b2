"""What a job tells: a ``rollout_finished`` event per attempt, and per hop its
``run_summary`` and the manifest's ``last_run``.

Functions of the figures a ``Job`` hands over; ``Recorder.record`` logs the first,
``Job.close`` logs the summary and writes ``last_run`` (``dispatcher status``
reads it to say why rollouts wrote no row).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import msgspec

from dispatcher.delivery.client import Attempt
from dispatcher.files import delivery_history as delivery
from dispatcher.files.atomic import write_manifest
from dispatcher.files.contracts import LastRun, is_terminal
from dispatcher.files.resume import OutputPaths
from dispatcher.latency.tracker import DispatchLatencyTracker
from dispatcher.outcome import Outcome
from dispatcher.run.daemon import Daemon, peak_rss_mb
from dispatcher.run.prepare import PreparedRun
from dispatcher.tasks.materialize import Rollout
from dispatcher.telemetry.event_log import EventLog

SUMMARY_QUANTILES = (0.5, 0.75, 0.95, 0.99)


class _Finished(msgspec.Struct, gc=False):
    """A ``rollout_finished`` event's fields, in the order the line shows them."""

    rollout_id: str
    task_index: int
    rollout_index: int
    attempt: int
    agent: str
    replica: str | None
    outcome: str
    final: bool
    duration_s: float
    retries: int
    http_status: int | None
    failure_message: str | None
    capture: dict[str, Any] | None


_FINISHED_KEYS = frozenset(_Finished.__struct_fields__)
# msgspec renders a float of 1e16 or more as 1e16, orjson (the log's renderer) as
# 1e+16: such a line, or one with a capture's figures, is left to orjson.
_ALIKE_BELOW = 1e16
_encode = msgspec.json.Encoder().encode


class RolloutFinishedLog:
    """The ``rollout_finished`` event of each attempt, on one bound logger: failures at
    warning, terminal ones at error, others at info. Its fields are a struct that
    msgspec renders (twice as fast as a dict through orjson), to the same text."""

    def __init__(self, log: Any) -> None:
        self._event = EventLog(log, "rollout_finished")

    def __call__(
        self,
        rollout: Rollout,
        outcome: Outcome,
        final: bool,
        duration_s: float,
        attempt: Attempt | None,
        row: dict[str, Any] | None,
        capture: dict[str, Any] | None,
    ) -> None:
        failure = attempt.failure if attempt is not None else None
        fields = _Finished(
            rollout.rollout_id,
            rollout.task_index,
            rollout.rollout_index,
            rollout.attempt_index,
            rollout.agent,
            attempt.replica if attempt else None,
            outcome._value_,
            final,
            round(duration_s, 4),
            attempt.retries if attempt else 0,
            failure.http_status if failure else None,
            failure.message if failure else None,
            capture or None,
        )
        level = logging.INFO if outcome is Outcome.SUCCESS else _level(outcome, row)
        event = self._event
        if (
            fields.capture is not None
            or not -_ALIKE_BELOW < fields.duration_s < _ALIKE_BELOW
            or not event.write_json(level, _encode(fields), _FINISHED_KEYS)
        ):
            event(level, msgspec.structs.asdict(fields))


def _level(outcome: Outcome, row: dict[str, Any] | None) -> int:
    if not outcome.writes_failure_row:
        return logging.INFO
    return logging.ERROR if row is not None and is_terminal(row) else logging.WARNING


def hop_summary(
    daemon: Daemon,
    tracker: DispatchLatencyTracker,
    outcomes: Counter[str],
    remaining: int,
    seconds: tuple[float, float],
) -> dict[str, Any]:
    """The hop's ``run_summary`` event: outcomes, rate, latency, delivery, the loop.
    ``seconds`` are the job's own (dispatching, since it opened), not the daemon's."""
    dispatch_s, elapsed_s = seconds
    successes = outcomes.get(Outcome.SUCCESS.value, 0)
    summary = {
        "outcomes": dict(outcomes),
        "remaining": remaining,
        "rollouts_per_hour": successes / dispatch_s * 3600.0 if dispatch_s > 0 else 0.0,
        "latency_s": {f"p{int(q * 100)}": tracker.quantile(q) for q in SUMMARY_QUANTILES},
        "elapsed_s": round(elapsed_s, 3),
        "dispatch_s": round(dispatch_s, 3),
        "event_loop_lag_p99_s": daemon.lag.p99_s(),
        "event_loop_lag_max_s": daemon.lag.max_s(),
        "peak_rss_mb": peak_rss_mb(),
        **daemon.delivery_figures(),
        **tracker.summary(),
    }
    if remaining > 0:
        summary["resume"] = "rerun the same command to run the remaining rollouts"
    return summary


def write_last_run(
    prepared: PreparedRun,
    summary: dict[str, Any],
    outcomes: Counter[str],
    exit_code: int,
    delivery_figures: dict[str, Any],
    *,
    durable: bool = True,
) -> None:
    """Record the hop in the manifest (blocking: call it in a thread); ``durable=False``:
    without fsync (``write_atomic``)."""
    finished_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    last_run = LastRun(
        finished_at=finished_at,
        exit_code=exit_code,
        # What `dispatcher status` needs to say why rollouts wrote no row.
        drained=outcomes.get(Outcome.DRAINED.value, 0),
        cancelled=outcomes.get(Outcome.CANCELLED.value, 0),
        kill_shaped=outcomes.get(Outcome.KILL_SHAPED.value, 0),
        summary=summary,
    )
    entry = delivery.history_entry(delivery_figures, finished_at)
    paths: OutputPaths = prepared.paths
    write_manifest(paths.manifest, prepared.record.ended_hop(last_run, entry), durable=durable)
