"""What a job writes for NeMo Gym Main's readers beside its rows (contracts §15).

- ``OmittedRows`` (``--record-omitted``): one failures-sidecar row per rollout
  this hop left without a result (drained, cancelled, kill-shaped), appended
  through the job's failures writer; ``drain`` waits for them before the
  writer closes.
- ``ProgressFiles``: ``X_status.json`` on the first durable row, then at most
  every ``STATUS_INTERVAL_S`` (``StatusThrottle``, with a clock tests set),
  and at the end of the hop with ``X_coverage.json``. The documents are built
  on the loop (the run state changes under it) and written in a thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import orjson
import structlog

from dispatcher import jsonx
from dispatcher.files import coverage
from dispatcher.files.atomic import write_json_atomic
from dispatcher.files.coverage import Omissions
from dispatcher.files.resume import OutputPaths, RunState
from dispatcher.files.writer import RowWriter
from dispatcher.outcome import Outcome
from dispatcher.rows.build import identity_keys
from dispatcher.rows.failure_record import OMITTED_CAUSES, omitted_row
from dispatcher.tasks.keys import DISPATCH_KEY, rollout_key
from dispatcher.tasks.materialize import Rollout

log = structlog.get_logger("dispatcher.run")

STATUS_INTERVAL_S = 5.0


class OmittedRows:
    """Appends the sidecar rows of rollouts left without a result; counts them."""

    def __init__(self, writer: RowWriter | None, run_id: str, state: RunState) -> None:
        # None: rows are not written (no --record-omitted), only counted.
        self._writer = writer
        self._run_id = run_id
        self._state = state
        self._pending: set[asyncio.Task[Any]] = set()
        self.total = 0
        self.without_attempts = 0

    def note(self, rollout: Rollout, cause: Outcome, duration_s: float | None) -> None:
        """Count the rollout as omitted by this hop and, with a writer, write its row."""
        if cause not in OMITTED_CAUSES:
            return
        self.total += 1
        key = rollout_key(rollout.task_index, rollout.rollout_index)
        self.without_attempts += key not in self._state.latest_failure
        if self._writer is None:
            return
        row = omitted_row(
            identity_keys(rollout, self._run_id), rollout.attempt_index, self._run_id, cause
        )
        if duration_s is not None:
            # How long it ran before it was cut off: resume starts the longest first.
            row[DISPATCH_KEY] = {
                "rollout_id": rollout.rollout_id,
                "duration_s": round(duration_s, 6),
            }
        line = jsonx.dumps(row, option=orjson.OPT_APPEND_NEWLINE)
        task = asyncio.ensure_future(self._writer.append_line(line))
        self._pending.add(task)
        task.add_done_callback(self._written)

    def _written(self, task: asyncio.Task[Any]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # The writer failed the job already; this row is evidence, not a result.
            log.warning("omitted_row_not_written", error=str(task.exception()))

    def omissions(self) -> Omissions:
        return Omissions(self.total, self.without_attempts)

    async def drain(self) -> None:
        """Wait until every queued row is written (or its writer failed)."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)


class StatusThrottle:
    """When ``X_status.json`` is refreshed: the first durable row, then at most every
    ``interval_s`` of ``clock``."""

    def __init__(
        self, interval_s: float = STATUS_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._last: float | None = None

    def due(self) -> bool:
        now = self._clock()
        if self._last is not None and now - self._last < self._interval_s:
            return False
        self._last = now
        return True


class ProgressFiles:
    """Keeps ``X_status.json`` fresh during a hop and writes ``X_coverage.json`` at its end."""

    def __init__(
        self,
        paths: OutputPaths,
        state: RunState,
        run_id: str | None,
        expected_by_agent: Mapping[str, int],
        throttle: StatusThrottle | None = None,
    ) -> None:
        self._paths = paths
        self._state = state
        self._run_id = run_id
        self._expected_by_agent = dict(expected_by_agent)
        self._throttle = throttle or StatusThrottle()
        self._writing: asyncio.Task[None] | None = None
        # False: written without fsync; the job's owner makes them durable before it
        # records the job final (a served job: ``Registry.save_final``).
        self.durable = True

    def row_written(self) -> None:
        """A row became durable: refresh the status file when it is due."""
        if self._writing is not None or not self._throttle.due():
            return
        body = self._status({})
        self._writing = asyncio.ensure_future(self._write((self._paths.status, body)))
        self._writing.add_done_callback(self._refreshed)

    def _refreshed(self, task: asyncio.Task[None]) -> None:
        self._writing = None
        if not task.cancelled() and task.exception() is not None:
            # Derived data: a failed refresh is logged, the end of the hop writes it again.
            log.warning(
                "status_file_failed", path=str(self._paths.status), error=str(task.exception())
            )

    async def finish(
        self, expected: int, omitted: Omissions, aggregation: Mapping[str, str]
    ) -> Callable[[], None]:
        """The hop's end: the write (blocking, ``OSError`` if not written) of the last
        status and the coverage, for the hop's own thread hop with its other files."""
        if self._writing is not None:
            await asyncio.gather(self._writing, return_exceptions=True)
        status = self._status(aggregation)
        covered = coverage.coverage(self._state, expected, omitted)
        return self._writer((self._paths.status, status), (self._paths.coverage, covered))

    def _status(self, aggregation: Mapping[str, str]) -> dict[str, Any]:
        return coverage.status(self._state, self._run_id, self._expected_by_agent, aggregation)

    async def _write(self, *files: tuple[Path, dict[str, Any]]) -> None:
        """Each file in turn, in one thread hop."""
        await asyncio.to_thread(self._writer(*files))

    def _writer(self, *files: tuple[Path, dict[str, Any]]) -> Callable[[], None]:
        durable = self.durable

        def write() -> None:
            for path, body in files:
                write_json_atomic(path, body, durable=durable)

        return write
