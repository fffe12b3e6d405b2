"""The daemon: one ``Dispatcher`` owns a run from startup to its exit code.

Reading order: ``run`` is the table of contents (startup, main loop,
shutdown). Data flow: materialized rows → pool (slot, drain check) → agent
call with timeout → commit (capture merge, one append, then the rollout
counts) → tracker and metrics, updated in ``_record`` and nowhere else.

Crash-only: the output files are the only state. Graceful shutdown only
saves time; a kill -9 anywhere loses nothing that was acknowledged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from typing import Any, BinaryIO

import aiohttp
import structlog
from aiohttp import web

from dispatcher import jsonx
from dispatcher.agents import AgentClient, Attempt, DeliveryPolicy
from dispatcher.aio import cancel_and_wait
from dispatcher.backoff import BackoffPolicy
from dispatcher.bytebudget import ByteBudget
from dispatcher.capture.finalize import (
    clear_rollout_captures,
)
from dispatcher.concurrency import AimdPolicy
from dispatcher.config import RunSettings
from dispatcher.errors import ConfigError, DispatcherError, ExitCode, OutputWriteError
from dispatcher.faults import FaultPersisted, LocalFault, LocalFaultPolicy, as_local_fault, fd_limit
from dispatcher.finalizer import Finalizer
from dispatcher.latency import DispatchLatencyTracker
from dispatcher.limits import ResponseLimits
from dispatcher.load import AgentLoad
from dispatcher.offload import AnswerClassifier
from dispatcher.ops import delivery
from dispatcher.ops.aggregate import write_aggregate_metrics
from dispatcher.outcome import Outcome
from dispatcher.prepare import PreparedRun, prepare_run
from dispatcher.replicas import BreakerPolicy
from dispatcher.rows import is_terminal
from dispatcher.scheduler import Admission, Budget, RolloutPool
from dispatcher.state import RunState
from dispatcher.store import RowWriter, write_json_atomic
from dispatcher.tasks import Rollout, materialized_key, new_capture_token
from dispatcher.telemetry.discovery import (
    MetricsEndpoint,
    resolve_listen,
    sd_file_for,
    target_labels,
)
from dispatcher.telemetry.lag import LoopLagMonitor
from dispatcher.telemetry.logs import flush_logs
from dispatcher.telemetry.metrics import Metrics
from dispatcher.telemetry.progress import ProgressLine, estimate_eta_s, progress_fields
from dispatcher.telemetry.run_gauges import declare_run_gauges
from dispatcher.telemetry.server import start_http_server

log = structlog.get_logger("dispatcher.run")

READ_BATCH_ROWS = 512
# Descriptors kept back from the concurrency cap: output files, the log, the
# metrics listener and its scrapes, capture reads, the loop's own.
FD_RESERVE = 64
DEFAULT_FIRST_BYTE_TIMEOUT_S = 7200.0
START_BURST = 8
QUANTILES = (0.5, 0.75, 0.95, 0.99)


class Dispatcher:
    """Owns one run: the pool, the writers, the tracker, the metrics and the stop flags."""

    def __init__(
        self,
        settings: RunSettings,
        *,
        budget_s: float | None,
        shard_filter: Callable[[int], bool] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        self._budget_s = budget_s
        self._shard_filter = shard_filter
        self.metrics = metrics or Metrics()
        self.tracker = DispatchLatencyTracker()
        self.outcomes: Counter[str] = Counter()
        self.state = "starting"
        self._prepared: PreparedRun | None = None
        self._stop_requested = asyncio.Event()
        self._fatal: DispatcherError | None = None
        self._final_this_run = 0
        self._commits: set[asyncio.Task[None]] = set()
        self._commit_slots = asyncio.Semaphore(max(256, 4 * (settings.pool_concurrency or 64)))
        # Rows waiting for their commit, bounded by the bytes they hold; the
        # slots above bound their count.
        self._commit_bytes = ByteBudget(settings.commit_queue_bytes)
        self._finalizer = Finalizer(settings, self.metrics)
        self._started_monotonic = time.monotonic()
        self._budget = Budget(None)
        self._background: list[asyncio.Task[None]] = []
        self._sigint_count = 0
        self._dispatch_started: float | None = None
        self._dispatch_ended: float | None = None
        # Bound once, after logging is configured: the module-level proxy
        # would rebuild a logger on every call of the per-rollout hot path.
        self._log = log.bind()
        # Parts made during startup; None until then (a signal or an error can
        # come before they exist).
        self._http: web.AppRunner | None = None
        self.metrics_endpoint: MetricsEndpoint | None = None
        self._pool: RolloutPool | None = None
        self._agents: AgentClient | None = None
        self._writers: tuple[RowWriter, ...] = ()
        self._lag = LoopLagMonitor(self.metrics)
        # DESIGN A11: rollouts our own faults put back, and what delivery saw.
        self._concurrency = settings.pool_concurrency
        self._requeued: deque[Rollout] = deque()
        self._live = 0
        self._wake_producer = asyncio.Event()
        self._fault_policy = LocalFaultPolicy(settings.local_fault_persist_s)
        self._load = AgentLoad(settings, self.metrics)
        # One per hop: scopes each attempt's model-call capture (capture/scope.py).
        self._capture_token = new_capture_token() if settings.capture_dir is not None else None

    # ---- the table of contents -------------------------------------------------

    async def run(self) -> ExitCode:
        """Run to completion or to a stop; return the process exit code."""
        await self._startup()
        try:
            await self._main_loop()
        finally:
            await self._shutdown()
        return self._exit_code()

    async def _startup(self) -> None:
        # The metrics port first: if it is taken, stop before touching any file.
        await self._start_http()
        # Before reading the state, which can take seconds: a SIGTERM meanwhile
        # must still end in an orderly exit 75, not in death by signal.
        self._install_signal_handlers()
        try:
            self._prepared = await asyncio.to_thread(prepare_run, self.settings, self._shard_filter)
        except BaseException:
            await self._stop_http()
            raise
        prepared = self._prepared
        # Every later line, stdlib records included, carries the run id.
        structlog.contextvars.bind_contextvars(run_id=prepared.manifest["run_id"])
        self._concurrency = self._usable_concurrency()
        await asyncio.to_thread(self._publish_metrics_endpoint, prepared)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self._concurrency or 0),
            # No total: the rollout timeout, when set, bounds a call. The
            # connect timeout keeps a black-holed address from hanging one.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.settings.connect_timeout_s),
        )
        self._agents = AgentClient(
            self.settings.agents, self._session, delivery_policy(self.settings), self._load
        )
        self._load.attach(self._agents)
        self._output = RowWriter(prepared.paths.output, self.settings.fsync, **self._batching())
        self._failures = RowWriter(prepared.paths.failures, self.settings.fsync, **self._batching())
        self._writers = (self._output, self._failures)
        for writer in self._writers:
            writer.open()
        await self._start_telemetry()
        if self.metrics_endpoint is not None:
            log.info("metrics_listening", url=self.metrics_endpoint.url)
        log.info(
            "run_started",
            run_id=prepared.manifest["run_id"],
            hop=prepared.manifest["hops"],
            resumed=prepared.resumed,
            expected=prepared.materialized.rollouts,
            already_final=prepared.already_final,
            concurrency=self._concurrency,
            dispatch_budget_s=self._budget_s,
            delivery_deadline_s=self.settings.delivery_deadline_s,
            output=str(prepared.paths.output),
        )

    async def _main_loop(self) -> None:
        # The budget's deadline is fixed when dispatch starts, not at startup.
        self._budget = Budget(self._budget_s)
        self.metrics.dispatch_started()
        self._dispatch_started = time.monotonic()
        self.state = "running"
        self._pool = RolloutPool(
            self._concurrency,
            self._budget,
            self._drain_margin,
            self._run_rollout,
            self._load.make_limiters(),
        )
        self.metrics.pool_limit(self._concurrency)
        self._background.append(asyncio.create_task(self._watch_budget(), name="budget"))
        if self.settings.adaptive:
            self._background.append(asyncio.create_task(self._load.adapt(), name="adapt"))
        producer = asyncio.create_task(self._produce(), name="producer")
        await self._until_stopped(producer)
        if producer.done() and not producer.cancelled() and producer.exception() is None:
            idle = asyncio.create_task(self._pool.wait_idle(), name="wait-idle")
            await self._until_stopped(idle)
        await cancel_and_wait(producer)
        self._dispatch_ended = time.monotonic()

    async def _shutdown(self) -> None:
        self.state = "shutting_down"
        # 1. Let in-flight rollouts finish within the grace period; cancel the rest
        #    (no row: they run on resume).
        # After a fatal error (a failed write) nothing more can be written: no grace.
        grace_s = 0.0 if self._fatal is not None else self.settings.shutdown_grace_s
        pool = self._pool
        if pool is not None and not await pool.wait_idle(grace_s):
            cancelled = await pool.cancel_all("shutdown grace period ended")
            log.warning("rollouts_cancelled", count=cancelled, reason="shutdown grace ended")
        # 2. Commits under way are never cancelled: wait for them.
        if self._commits:
            await asyncio.wait(set(self._commits))
        # 3. Flush and close the writers; only now is every counted row on disk.
        await self._output.close()
        await self._failures.close()
        await self._session.close()
        await self._write_aggregate_metrics()
        # 4. Record this hop in the manifest and tell the operator.
        self.state = "finished"
        summary = self.summary()
        await asyncio.to_thread(self._write_last_run, summary)
        log.info("run_summary", **summary)
        # 5. Stop serving metrics last, so a final scrape can see the end state.
        for task in self._background:
            await cancel_and_wait(task)
        await self._stop_telemetry()
        assert self._prepared is not None
        self._prepared.lock.release()

    async def _write_aggregate_metrics(self) -> None:
        # Gym's end-of-run file, once every rollout has its final row (a hop that
        # leaves work for a rerun would only write numbers the next hop replaces).
        if self._fatal is None and self._prepared is not None and self.remaining() == 0:
            await write_aggregate_metrics(self._prepared.paths.output, self.settings.agents)

    # ---- producing rollouts ----------------------------------------------------

    async def _produce(self) -> None:
        pool = self._pool
        assert pool is not None
        started = 0
        async for rollout in self._to_start():
            if self._stop_requested.is_set():
                return
            if self._load.is_down(rollout.agent):
                self._record_not_started(Outcome.AGENT_DOWN)
                continue
            if await pool.admit(rollout) is Admission.DRAINED:
                self._record_not_started(Outcome.DRAINED)
                continue
            started += 1
            if started % START_BURST == 0:
                # Starting hundreds of rollouts in one loop iteration (at
                # startup, or when many slots free at once) would stall every
                # other rollout's I/O: yield between small bursts.
                await asyncio.sleep(0)

    async def _to_start(self) -> AsyncIterator[Rollout]:
        """The task file's pending rollouts, with requeued ones first; ends when all settle."""
        async for rollout in self._pending_rollouts():
            while self._requeued:
                yield await self._take_requeued()
            yield rollout
        # The file is read: what remains is what our own faults put back.
        while True:
            while self._requeued:
                yield await self._take_requeued()
            if self._live == 0:
                return
            self._wake_producer.clear()
            await self._wake_producer.wait()

    async def _take_requeued(self) -> Rollout:
        rollout = self._requeued.popleft()
        # Whatever the faulted try left in the capture dir is not this attempt's.
        await self._clear_captures([rollout])
        return rollout

    async def _pending_rollouts(self) -> AsyncIterator[Rollout]:
        """Rollouts still to run, in input order, read in batches off the event loop."""
        assert self._prepared is not None
        state = self._prepared.state
        with self._prepared.paths.materialized.open("rb") as f:
            while True:
                batch = await asyncio.to_thread(_read_batch, f, state, self._capture_token)
                if batch is None:
                    return
                await self._clear_captures(batch)
                for rollout in batch:
                    yield rollout

    async def _clear_captures(self, batch: list[Rollout]) -> None:
        if self.settings.capture_dir is None or not batch:
            return
        await clear_rollout_captures(self.settings.capture_dir, [r.rollout_id for r in batch])

    def _drain_margin(self) -> float | None:
        return self.tracker.drain_margin(self.settings.drain_margin_s)

    # ---- one rollout -----------------------------------------------------------

    async def _run_rollout(self, rollout: Rollout) -> None:
        self.metrics.rollout_started(rollout.agent)
        self._live += 1
        try:
            await self._deliver_and_commit(rollout)
        finally:
            self._live -= 1
            if self._live == 0:
                self._wake_producer.set()

    async def _deliver_and_commit(self, rollout: Rollout) -> None:
        assert self._agents is not None and self._pool is not None
        started = time.perf_counter()
        try:
            attempt = await self._agents.run(rollout.agent, rollout.body, rollout.rollout_id)
        except asyncio.CancelledError:
            self._record(rollout, Outcome.CANCELLED, time.perf_counter() - started)
            raise
        except LocalFault as fault:
            self._requeue(rollout, fault, time.perf_counter() - started)
            return
        # The slot is for the agent: it frees as soon as the agent has answered,
        # while the row waits for its capture and group commit. A shutdown only
        # cancels rollouts still holding a slot, so an answer is never lost
        # between the agent and the file. Commit slots and bytes bound that
        # backlog (backpressure if the disk stalls or rows are huge).
        try:
            await self._enter_commit_queue(attempt)
        except asyncio.CancelledError:
            self._record(rollout, Outcome.CANCELLED, attempt.duration_s, attempt)
            raise
        task = asyncio.current_task()
        assert task is not None
        self._commits.add(task)
        self._pool.leave()
        try:
            await self._commit(rollout, attempt)
        except Exception as exc:
            self._fail(DispatcherError(f"committing {rollout.rollout_id} failed: {exc!r}"))
            raise
        finally:
            self._commits.discard(task)
            self._commit_bytes.release(attempt.body_bytes)
            self._commit_slots.release()

    async def _enter_commit_queue(self, attempt: Attempt) -> None:
        await self._commit_slots.acquire()
        try:
            await self._commit_bytes.acquire(attempt.body_bytes)
        except BaseException:
            self._commit_slots.release()
            raise

    async def _commit(self, rollout: Rollout, attempt: Attempt) -> None:
        try:
            line, row, capture = await self._finalizer.finalize(rollout, attempt)
        except Exception as exc:
            # A bug of ours (or our memory) while handling an answer: not the
            # agent's failure, so no row; the rollout runs again.
            fault = as_local_fault(exc) or LocalFault("bug", f"handling an answer raised {exc!r}")
            log.error("answer_handling_failed", rollout_id=rollout.rollout_id, exc_info=exc)
            self._requeue(rollout, fault, attempt.duration_s)
            return
        try:
            if line is not None:
                writer = self._output if attempt.outcome is Outcome.SUCCESS else self._failures
                await writer.append_line(line)
        except OutputWriteError as exc:
            self._fail(exc)
            self._record(rollout, Outcome.CANCELLED, attempt.duration_s)
            return
        self._handled_answer()
        self._record(rollout, attempt.outcome, attempt.duration_s, attempt, row, capture)

    # ---- the dispatcher's own faults (DESIGN A11) ----------------------------------

    def _requeue(self, rollout: Rollout, fault: LocalFault, duration_s: float) -> None:
        """Put a rollout back after our own fault: no row, no attempt spent, a smaller pool."""
        self._record(rollout, Outcome.REQUEUED, duration_s)
        self.metrics.local_fault(fault.kind)
        slots = self._pool.slots if self._pool is not None else None
        limit = slots.shrink() if slots is not None else None
        self.metrics.pool_limit(limit)
        log.warning(
            "local_fault",
            fault=fault.message,
            kind=fault.kind,
            rollout_id=rollout.rollout_id,
            pool_limit=limit,
        )
        try:
            self._fault_policy.on_fault(fault)
        except FaultPersisted as exc:
            self._fail(exc)
            return
        self._requeued.append(rollout)
        self._wake_producer.set()

    def _handled_answer(self) -> None:
        self._fault_policy.on_delivered()
        slots = self._pool.slots if self._pool is not None else None
        if slots is not None and slots.limit < slots.ceiling:
            slots.grow()
            self.metrics.pool_limit(slots.limit)

    def _usable_concurrency(self) -> int | None:
        """The concurrency, capped so sockets cannot run this process out of descriptors."""
        wanted = self.settings.pool_concurrency
        usable = fd_limit() - _open_fds() - FD_RESERVE
        if wanted is None or wanted <= usable:
            return wanted
        capped = max(1, usable)
        log.warning(
            "concurrency_capped",
            concurrency=wanted,
            capped_to=capped,
            reason=f"the file-descriptor limit (ulimit -n) is {fd_limit()}",
        )
        return capped

    async def _watch_budget(self) -> None:
        """When the budget runs out, in-flight rollouts get the grace, then are cancelled."""
        remaining_s = self._budget.remaining_s()
        pool = self._pool
        if remaining_s is None or pool is None:
            return
        await asyncio.sleep(max(0.0, remaining_s))
        if not pool.in_flight:
            return
        grace_s = self.settings.shutdown_grace_s
        log.warning("budget_exhausted", in_flight=len(pool.in_flight), grace_s=grace_s)
        if not await pool.wait_idle(grace_s):
            cancelled = await pool.cancel_all("dispatch budget exhausted")
            log.warning("rollouts_cancelled", count=cancelled, reason="dispatch budget exhausted")

    # ---- the one place outcomes are counted ------------------------------------

    def _record(
        self,
        rollout: Rollout,
        outcome: Outcome,
        duration_s: float,
        attempt: Attempt | None = None,
        row: dict[str, Any] | None = None,
        capture: dict[str, Any] | None = None,
    ) -> None:
        self.outcomes[outcome.value] += 1
        if outcome is Outcome.SUCCESS:
            self.tracker.record(duration_s)
        elif outcome.writes_failure_row:
            self.tracker.record_failure(duration_s)
        final = self._is_final(rollout, outcome, row)
        if final:
            self._final_this_run += 1
        self.metrics.rollout_finished(rollout.agent, outcome.value, duration_s)
        failure = attempt.failure if attempt is not None else None
        self._log.log(
            _log_level(outcome, row),
            "rollout_finished",
            rollout_id=rollout.rollout_id,
            task_index=rollout.task_index,
            rollout_index=rollout.rollout_index,
            attempt=rollout.attempt_index,
            agent=rollout.agent,
            replica=attempt.replica if attempt else None,
            outcome=outcome.value,
            final=final,
            duration_s=round(duration_s, 4),
            retries=attempt.retries if attempt else 0,
            http_status=failure.http_status if failure else None,
            failure_message=failure.message if failure else None,
            capture=capture or None,
        )

    def _is_final(self, rollout: Rollout, outcome: Outcome, row: dict[str, Any] | None) -> bool:
        if outcome is Outcome.SUCCESS:
            return True
        if not outcome.writes_failure_row or row is None:
            return False
        return is_terminal(row) or rollout.attempt_index + 1 >= self.settings.max_attempts

    def _record_not_started(self, outcome: Outcome) -> None:
        self.outcomes[outcome.value] += 1
        if outcome is Outcome.DRAINED:
            self.tracker.record_drained()
            self.metrics.rollout_drained()

    # ---- stopping ----------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._handle_signal, signal.SIGTERM)
        loop.add_signal_handler(signal.SIGINT, self._handle_signal, signal.SIGINT)

    def _handle_signal(self, sig: signal.Signals) -> None:
        """Record intent only; a second SIGINT exits at once."""
        if sig == signal.SIGINT:
            self._sigint_count += 1
            if self._sigint_count > 1:
                self._exit_now()
        if not self._stop_requested.is_set():
            log.warning(
                "shutdown_requested", signal=sig.name, grace_s=self.settings.shutdown_grace_s
            )
            self.state = "draining"
            self._stop_requested.set()

    def _exit_now(self) -> None:
        # Take each writer's I/O lock so no batch is cut half-way, then leave.
        for writer in self._writers:
            writer.io_lock.acquire(timeout=5)
        log.warning("exit_now", reason="second SIGINT")
        flush_logs()
        os._exit(ExitCode.RESUMABLE)

    def _fail(self, error: DispatcherError) -> None:
        if self._fatal is None:
            self._fatal = error
            log.error("run_failed", error=str(error))
        self._stop_requested.set()

    async def _until_stopped(self, task: asyncio.Task[Any]) -> None:
        stop = asyncio.create_task(self._stop_requested.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        await cancel_and_wait(stop)
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]

    def _exit_code(self) -> ExitCode:
        if self._fatal is not None:
            raise self._fatal
        return self._final_exit_code()

    def _final_exit_code(self) -> ExitCode:
        return ExitCode.RESUMABLE if self.remaining() > 0 else ExitCode.DONE

    # ---- figures -------------------------------------------------------------------

    def remaining(self) -> int:
        prepared = self._prepared
        if prepared is None:
            return 0
        final = prepared.already_final + self._final_this_run
        return max(0, prepared.materialized.rollouts - final)

    def status(self) -> dict[str, Any]:
        """The live snapshot behind /status, progress events and the summary."""
        prepared = self._prepared
        expected = prepared.materialized.rollouts if prepared else None
        remaining = self.remaining()
        rate = self.metrics.rollouts_per_hour()
        in_flight = len(self._pool.in_flight) if self._pool is not None else 0
        return {
            "run_id": prepared.manifest["run_id"] if prepared else None,
            "state": self.state,
            "elapsed_s": round(time.monotonic() - self._started_monotonic, 3),
            "progress": {
                "expected": expected,
                "done": (expected or 0) - remaining,
                "remaining": remaining,
                "in_flight": in_flight,
                "committing": len(self._commits),
            },
            "outcomes": dict(self.outcomes),
            "rollouts_per_hour": rate,
            "latency_s": self._latency_quantiles(),
            "drain_margin_s": self._drain_margin(),
            "budget_remaining_s": self._budget.remaining_s(),
            "eta_s": estimate_eta_s(remaining, rate),
            "in_flight_by_agent": self._agents.in_flight() if self._agents is not None else {},
            "drained": self.tracker.drained,
            **self._delivery_figures(),
            "metrics_url": self.metrics_endpoint.url if self.metrics_endpoint else None,
        }

    def _delivery_figures(self) -> dict[str, Any]:
        """Retries, replica health and our own faults: for /status, the summary and status."""
        slots = self._pool.slots if self._pool is not None else None
        return {
            "pool_limit": slots.limit if slots is not None else self._concurrency,
            "concurrency": self._load.view(self._concurrency),
            **self._load.figures(),
            "local_faults": self._fault_policy.count,
        }

    def _latency_quantiles(self) -> dict[str, float | None]:
        return {f"p{int(q * 100)}": self.tracker.quantile(q) for q in QUANTILES}

    def summary(self) -> dict[str, Any]:
        elapsed_s = time.monotonic() - self._started_monotonic
        dispatch_s = self._dispatch_seconds()
        successes = self.outcomes.get(Outcome.SUCCESS.value, 0)
        summary = {
            "outcomes": dict(self.outcomes),
            "remaining": self.remaining(),
            "rollouts_per_hour": successes / dispatch_s * 3600.0 if dispatch_s > 0 else 0.0,
            "latency_s": self._latency_quantiles(),
            "elapsed_s": round(elapsed_s, 3),
            "dispatch_s": round(dispatch_s, 3),
            "event_loop_lag_p99_s": self._lag.p99_s(),
            "event_loop_lag_max_s": self._lag.max_s(),
            "peak_rss_mb": peak_rss_mb(),
            **self._delivery_figures(),
            **self.tracker.summary(),
        }
        if self.remaining() > 0:
            summary["resume"] = "rerun the same command to run the remaining rollouts"
        return summary

    def _dispatch_seconds(self) -> float:
        if self._dispatch_started is None:
            return 0.0
        return (self._dispatch_ended or time.monotonic()) - self._dispatch_started

    # ---- telemetry plumbing --------------------------------------------------------

    def _batching(self) -> dict[str, Any]:
        return {
            "interval_s": self.settings.fsync_batch_interval_s,
            "max_rows": self.settings.fsync_batch_rows,
        }

    async def _start_http(self) -> None:
        listen = resolve_listen(self.settings.metrics_listen)
        if listen is None:
            return
        host, port = listen
        try:
            self._http, self.metrics_port = await start_http_server(
                host, port, metrics=self.metrics, status=self.status, healthy=self._healthy
            )
        except OSError as exc:
            raise ConfigError(
                f"--metrics-listen {self.settings.metrics_listen}: cannot listen ({exc.strerror})"
            ) from None
        self.metrics_endpoint = MetricsEndpoint(host, self.metrics_port)

    def _publish_metrics_endpoint(self, prepared: PreparedRun) -> None:
        """Record the endpoint in the manifest and the Prometheus target file (blocking)."""
        endpoint = self.metrics_endpoint
        if endpoint is None:
            return
        prepared.manifest["metrics_url"] = endpoint.url
        write_json_atomic(prepared.paths.manifest, prepared.manifest)
        output = prepared.paths.output
        labels = target_labels(prepared.manifest, output, self.settings.shard)
        endpoint.publish(sd_file_for(output, self.settings.metrics_sd_dir), labels)

    async def _stop_http(self) -> None:
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.withdraw()
        if self._http is not None:
            await self._http.cleanup()
            self._http = None

    async def _start_telemetry(self) -> None:
        self.metrics.declare_agents(self.settings.agents)
        self.metrics.declare_replicas(self.settings.agents)
        assert self._agents is not None
        declare_run_gauges(
            self.metrics.registry, self.settings.rollout_timeout_s, self._agents.in_flight
        )
        await self._lag.start()
        self._progress_line = ProgressLine(enabled=self.settings.log_format == "console" or None)
        await self._progress_line.start(self.status)
        self._background.append(asyncio.create_task(self._tick(), name="ticker"))

    def _healthy(self) -> bool:
        return self.state in ("starting", "running")

    async def _tick(self) -> None:
        """Refresh the gauges every second and log progress every interval."""
        interval_s = self.settings.progress_interval_s
        next_progress = time.monotonic() + interval_s
        while True:
            self._update_gauges()
            if time.monotonic() >= next_progress:
                next_progress += interval_s
                log.info("progress", **progress_fields(self.status()))
            # An interval under a second must not be stretched to the gauge tick.
            await asyncio.sleep(min(1.0, interval_s))

    def _update_gauges(self) -> None:
        self.metrics.update(
            quantiles={q: self.tracker.quantile(q) for q in (0.5, 0.75, 0.95)},
            drain_margin_s=self._drain_margin(),
            budget_remaining_s=self._budget.remaining_s(),
            remaining=self.remaining(),
        )

    async def _stop_telemetry(self) -> None:
        self._update_gauges()
        await self._progress_line.stop()
        await self._lag.stop()
        await self._stop_http()

    def _write_last_run(self, summary: dict[str, Any]) -> None:
        assert self._prepared is not None
        manifest = dict(self._prepared.manifest)
        finished_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        manifest[delivery.HISTORY_KEY] = delivery.appended(
            manifest, delivery.history_entry(self._delivery_figures(), finished_at)
        )
        manifest["last_run"] = {
            "finished_at": finished_at,
            "exit_code": int(self._fatal.exit_code if self._fatal else self._final_exit_code()),
            # What `dispatcher status` needs to say why rollouts wrote no row.
            "drained": self.outcomes.get(Outcome.DRAINED.value, 0),
            "cancelled": self.outcomes.get(Outcome.CANCELLED.value, 0),
            "kill_shaped": self.outcomes.get(Outcome.KILL_SHAPED.value, 0),
            "summary": summary,
        }
        write_json_atomic(self._prepared.paths.manifest, manifest)


def delivery_policy(settings: RunSettings) -> DeliveryPolicy:
    """The agent calls' deadlines and retry rules, from the settings."""
    first_byte_s = settings.first_byte_timeout_s
    if first_byte_s is None and settings.rollout_timeout_s is None:
        # Without a rollout timeout nothing else bounds a silent agent.
        first_byte_s = DEFAULT_FIRST_BYTE_TIMEOUT_S
    return DeliveryPolicy(
        classify=AnswerClassifier(settings.offload_bytes),
        deadline_s=settings.delivery_deadline_s,
        rollout_timeout_s=settings.rollout_timeout_s,
        first_byte_timeout_s=first_byte_s,
        limits=ResponseLimits(settings.max_response_bytes, settings.response_read_timeout_s),
        backoff=BackoffPolicy(settings.retry_backoff_base_s, settings.retry_backoff_cap_s),
        breaker=BreakerPolicy(
            settings.breaker_failures, settings.breaker_open_s, settings.breaker_open_cap_s
        ),
        replica_cap=settings.replica_concurrency,
        max_starts_per_s=settings.max_starts_per_s,
        aimd=AimdPolicy(maximum=settings.concurrency_max) if settings.adaptive else None,
    )


def _log_level(outcome: Outcome, row: dict[str, Any] | None) -> int:
    """Failures at warning, terminal ones at error; everything else at info."""
    if not outcome.writes_failure_row:
        return logging.INFO
    return logging.ERROR if row is not None and is_terminal(row) else logging.WARNING


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def peak_rss_mb() -> float | None:
    """This process's peak resident memory since exec (Linux ``VmHWM``), in MB."""
    # ru_maxrss would also count the parent's memory copied by fork before exec.
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return round(int(line.split()[1]) / 1024.0, 1)
    except OSError:
        pass
    return None


def _read_batch(
    f: BinaryIO, state: RunState, capture_token: str | None = None
) -> list[Rollout] | None:
    """Up to READ_BATCH_ROWS rollouts not yet final (in a thread); None at the end."""
    batch: list[Rollout] = []
    for _ in range(READ_BATCH_ROWS * 8):
        line = f.readline()
        if not line:
            return batch or None
        # Most rows are final on a late resume: find their key without parsing them.
        key = materialized_key(line)
        if state.is_final(key):
            continue
        row = jsonx.loads(line)
        batch.append(Rollout.from_materialized(row, state.attempt_index(key), capture_token))
        if len(batch) >= READ_BATCH_ROWS:
            break
    return batch
