"""The process: what every job of a daemon shares (contracts §9, §11, §12).

``Daemon`` owns the listener (/metrics, /healthz, /status and, in service
mode, the jobs API), the signal handlers, the HTTP session to the agents, the
agents' health and limits, the slot pool, the commit queue, the budget, the
live latency view, the metrics and the loop-lag monitor. Jobs (``job.py``)
own their files and state and borrow these parts. ``dispatcher run`` is one
job on a daemon of its own (``one_job.py``); ``dispatcher serve`` runs any
number (``serve/``).

Startup is an exit stack: whatever started is stopped again, in reverse
order, when a later step fails or the daemon closes, and the listener stops
last so a final scrape sees the end state.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import ssl
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import structlog

from dispatcher.admission.agent_load import AgentLoad
from dispatcher.admission.bytebudget import CommitQueue
from dispatcher.admission.pause import AdmissionPause
from dispatcher.admission.pool import Budget, RolloutPool
from dispatcher.aio import Wakeup, cancel_and_wait
from dispatcher.capture.release import SessionReleaser
from dispatcher.delivery.agent_errors import AgentsNeverReached, never_reached_message
from dispatcher.delivery.client import AgentClient
from dispatcher.delivery.faults import FaultPersisted, LocalFault, LocalFaultPolicy, fd_limit
from dispatcher.delivery.http1_pool import Http1Pool
from dispatcher.errors import ConfigError, DispatcherError, ExitCode
from dispatcher.lifecycle import Lifecycle, Phase
from dispatcher.run.delivery_policy import delivery_policy
from dispatcher.run.policy_clock import PolicyClock
from dispatcher.run.views import JobView, LatencyView
from dispatcher.settings.config import RunSettings
from dispatcher.tasks.materialize import Rollout
from dispatcher.telemetry.discovery import MetricsEndpoint, resolve_listen
from dispatcher.telemetry.lag import LoopLagMonitor
from dispatcher.telemetry.logs import flush_logs
from dispatcher.telemetry.metrics import Metrics
from dispatcher.telemetry.progress import ProgressLine, progress_fields
from dispatcher.telemetry.run_gauges import declare_run_gauges

if TYPE_CHECKING:
    from dispatcher.telemetry.server import Routes

log = structlog.get_logger("dispatcher.run")

# Descriptors kept back from the concurrency cap: output files, the log, the
# metrics listener and its scrapes, capture reads, the loop's own.
FD_RESERVE = 64
QUANTILES = (0.5, 0.75, 0.95, 0.99)

StatusFn = Callable[[], Mapping[str, Any]]


class Daemon:
    """Owns the process-wide parts; jobs run on it (see the module docstring)."""

    def __init__(
        self,
        settings: RunSettings,
        *,
        budget_s: float | None,
        latency: LatencyView,
        metrics: Metrics | None = None,
        pause: AdmissionPause | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.latency = latency
        self.phase = Lifecycle(Phase.STARTING)
        self.stop_requested = asyncio.Event()
        self.fatal: DispatcherError | None = None
        self.jobs: set[JobView] = set()
        # Events jobs watch: the budget ran out (they give their rollouts at
        # agents the grace, then cancel them), and the process is stopping.
        self.budget_spent = asyncio.Event()
        self.load = AgentLoad(settings, self.metrics)
        self.lag = LoopLagMonitor(self.metrics)
        self.budget = Budget(None)
        self.commit_queue = CommitQueue(
            max(256, 4 * (settings.pool_concurrency or 64)), settings.commit_queue_bytes
        )
        self.concurrency = settings.pool_concurrency
        self.metrics_endpoint: MetricsEndpoint | None = None
        self.releaser: SessionReleaser | None = None
        # Service mode: a daemon whose budget is spent stops (its jobs resume
        # on the next allocation); a run's job settles its drained rollouts itself.
        self.stop_at_budget_end = False
        # The policy version V of service mode (contracts §12); None: not a trainer's daemon.
        self.policy: PolicyClock | None = None
        # Service mode's admission pause (contracts §13), on the pool.
        self.pause = pause or AdmissionPause()
        # Fired each time a rollout leaves its agent (waiting for nothing in flight).
        self.left_agent = Wakeup()
        self._budget_s = budget_s
        self._fault_policy = LocalFaultPolicy(settings.local_fault_persist_s)
        self._stack = contextlib.AsyncExitStack()
        self._sigint_count = 0
        self._started_monotonic = self.clock()
        # Made by ``start``; a signal or an error can come before they exist.
        self._agents: AgentClient | None = None
        self._pool: RolloutPool | None = None

    @property
    def agents(self) -> AgentClient:
        assert self._agents is not None, "the daemon has not started"
        return self._agents

    @property
    def pool(self) -> RolloutPool:
        assert self._pool is not None, "the daemon has not started"
        return self._pool

    # ---- startup ------------------------------------------------------------------

    async def listen(
        self,
        status: StatusFn,
        healthy: Callable[[], bool],
        routes: Routes | None = None,
        max_body_bytes: int | None = None,
        *,
        tls: ssl.SSLContext | None = None,
        header_timeout_s: float | None = None,
        flag: str = "--metrics-listen",
    ) -> None:
        """Bind the listener and install the signal handlers: the first steps.

        The port first: if it is taken, stop before touching any file. The
        handlers next: a SIGTERM while jobs prepare must still end in an
        orderly exit 75, not in death by signal. ``flag`` is the one the user typed
        the address with, for the error when it cannot be bound.
        """
        await self._start_http(status, healthy, routes, max_body_bytes, tls, header_timeout_s, flag)
        self._install_signal_handlers()

    async def start(self, status: StatusFn) -> None:
        """The session to the agents, the pool and the telemetry loops."""
        self.concurrency = self._usable_concurrency()
        # The rollout timeout, when set, bounds a call. The connect timeout
        # keeps a black-holed address from hanging one. Every connection a wave
        # of calls opened is kept for the next wave: with fewer kept, each wave
        # at 10,000 in flight reconnected 9 in 10 calls.
        pool = Http1Pool(
            connect_timeout_s=self.settings.connect_timeout_s,
            max_idle=self.concurrency or fd_limit(),
        )
        self._stack.push_async_callback(pool.close)
        self._agents = AgentClient(
            self.settings.agents, pool, delivery_policy(self.settings), self.load
        )
        self.load.attach(self._agents)
        if self._agents.suspendable is not None:
            self.pause.listeners.append(self._agents.suspendable.set_paused)
        self._pool = RolloutPool(
            self.concurrency, self.budget, self.drain_margin, self.load.make_limiters(), self.pause
        )
        self._stack.push_async_callback(self.pause.close)
        self.metrics.pool_limit(self.concurrency)
        self.metrics.declare_agents(self.settings.agents)
        self.metrics.declare_replicas(self.settings.agents)
        declare_run_gauges(
            self.metrics.registry, self.settings.rollout_timeout_s, self._agents.in_flight
        )
        self._spawn(self.lag.run(), "loop-lag")
        progress_line = ProgressLine(enabled=self.settings.log_format == "console" or None)
        self._spawn(progress_line.run(status), "progress-line")
        self._spawn(self._tick(status), "ticker")
        self._spawn(self.load.probe(), "prober")
        self._start_releaser()

    def _start_releaser(self) -> None:
        if self.settings.capture_proxy_url is None:
            return
        releaser = self.releaser = SessionReleaser(self.settings.capture_proxy_url)
        releaser.start()
        # Closed first at shutdown: a rollout that ended during it is told too.
        self._stack.push_async_callback(releaser.close)

    def release_session(self, rollout: Rollout) -> None:
        """An attempt of ``rollout`` ended: the capture proxy may forget its session."""
        if self.releaser is not None:
            self.releaser.release(rollout.capture_id or rollout.rollout_id)

    def begin_dispatch(self) -> None:
        """Fix the budget's deadline (it counts from here, not from startup) and run."""
        self.budget = Budget(self._budget_s)
        self.pool.budget = self.budget
        self.metrics.dispatch_started()
        self.phase.advance(Phase.RUNNING)
        self._spawn(self._watch_budget(), "budget")
        if self.settings.adaptive:
            self._spawn(self.load.adapt(), "adapt")

    def watch_agents_reached(self, window_s: float) -> None:
        """Fail the run (exit 2) when, ``window_s`` after its first try, an agent that
        was sent rollouts has had no replica accept a connection: a typo'd port would
        otherwise be retried until the delivery deadline. An agent lost later is
        retried as before."""
        self._spawn(self._agents_reached(window_s), "agents-reached")

    async def _agents_reached(self, window_s: float) -> None:
        # From the first try, not from now: a slow start must not judge an agent
        # before anything was sent to it.
        await self.agents.first_try.wait()
        await asyncio.sleep(window_s)
        unreached = self.agents.never_reached()
        if unreached:
            self.fail(AgentsNeverReached(never_reached_message(unreached, window_s)))

    def _spawn(self, coro: Any, name: str) -> None:
        """Run a background task the daemon owns: cancelled and awaited at close; if it
        dies before, the daemon fails at once (exit 1, naming it), never silently."""
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._task_ended)
        # Its crash was reported by ``_task_ended``: stopping it raises nothing.
        self._stack.push_async_callback(cancel_and_wait, task, reraise=False)

    def _task_ended(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or (exc := task.exception()) is None:
            return
        log.error("background_task_died", task=task.get_name(), exc_info=exc)
        self.fail(DispatcherError(f"the daemon's {task.get_name()} task died: {exc!r}"))

    async def close(self) -> None:
        """Stop what ``listen`` and ``start`` started, in reverse order."""
        self.phase.advance(Phase.SHUTTING_DOWN)
        await self._stack.aclose()
        self.phase.advance(Phase.FINISHED)

    # ---- the live view ------------------------------------------------------------

    def drain_margin(self) -> float | None:
        return self.latency.drain_margin(self.settings.drain_margin_s)

    def latency_quantiles(self) -> dict[str, float | None]:
        return {f"p{int(q * 100)}": self.latency.quantile(q) for q in QUANTILES}

    def policy_version(self) -> int | None:
        return self.policy.version if self.policy is not None else None

    @staticmethod
    def clock() -> float:
        """Monotonic seconds, which the daemon's and each job's elapsed figures are read
        from (one place, so a test can move it)."""
        return time.monotonic()

    def elapsed_s(self) -> float:
        return self.clock() - self._started_monotonic

    def delivery_figures(self) -> dict[str, Any]:
        """Retries, replica health and our own faults: for /status, the summary and status."""
        slots = self._pool.slots if self._pool is not None else None
        return {
            "pool_limit": slots.limit if slots is not None else self.concurrency,
            "concurrency": self.load.view(self.concurrency),
            **self.load.figures(),
            "local_faults": self._fault_policy.count,
        }

    def slot_waiters(self) -> int:
        slots = self._pool.slots if self._pool is not None else None
        return slots.waiting if slots is not None else 0

    def in_flight_by_agent(self) -> dict[str, dict[str, int]]:
        return self._agents.in_flight() if self._agents is not None else {}

    def healthy(self) -> bool:
        return not self.phase.at_least(Phase.DRAINING)

    def remaining(self) -> int:
        return sum(job.remaining() for job in self.jobs)

    def at_agents(self) -> int:
        """Rollouts of every job at their agents now."""
        return sum(job.at_agents() for job in self.jobs)

    # ---- the dispatcher's own faults (contracts §11) ----------------------------------

    def local_fault(self, fault: LocalFault, rollout_id: str) -> bool:
        """Count our own fault and halve the pool; False once it has lasted too long."""
        self.metrics.local_fault(fault.kind)
        slots = self._pool.slots if self._pool is not None else None
        limit = slots.shrink() if slots is not None else None
        self.metrics.pool_limit(limit)
        log.warning(
            "local_fault", fault=fault.message, kind=fault.kind, rollout_id=rollout_id,
            pool_limit=limit,
        )  # fmt: skip
        try:
            self._fault_policy.on_fault(fault)
        except FaultPersisted as exc:
            self.fail(exc)
            return False
        return True

    def handled_answer(self) -> None:
        self._fault_policy.on_delivered()
        slots = self._pool.slots if self._pool is not None else None
        if slots is not None and slots.limit < slots.ceiling:
            slots.grow()
            self.metrics.pool_limit(slots.limit)

    def fail(self, error: DispatcherError) -> None:
        """A fault of the process itself: every job stops."""
        if self.fatal is None:
            self.fatal = error
            log.error("run_failed", error=str(error))
        self.stop_requested.set()

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

    # ---- stopping -------------------------------------------------------------------

    async def _watch_budget(self) -> None:
        """When the budget runs out, say so: jobs settle their rollouts at agents (a
        run's job drains the rest), or, in service mode, the daemon stops."""
        remaining_s = self.budget.remaining_s()
        if remaining_s is None:
            return
        await asyncio.sleep(max(0.0, remaining_s))
        in_flight = sum(job.at_agents() for job in self.jobs)
        if in_flight:
            log.warning(
                "budget_exhausted", in_flight=in_flight, grace_s=self.settings.shutdown_grace_s
            )
        if self.stop_at_budget_end:
            # Each job's close gives its rollouts at agents the same grace.
            self.stop_requested.set()
        else:
            self.budget_spent.set()

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._handle_signal, sig)
            self._stack.callback(loop.remove_signal_handler, sig)

    def _handle_signal(self, sig: signal.Signals) -> None:
        """Record intent only; a second SIGINT exits at once."""
        if sig == signal.SIGINT:
            self._sigint_count += 1
            if self._sigint_count > 1:
                self._exit_now()
        if not self.stop_requested.is_set():
            log.warning(
                "shutdown_requested", signal=sig.name, grace_s=self.settings.shutdown_grace_s
            )
            self.phase.advance(Phase.DRAINING)
            self.stop_requested.set()

    def _exit_now(self) -> None:
        # At once, as a kill -9 would (crash-only): a batch cut half-way leaves a
        # torn tail that resume repairs, and a row counts as written only once
        # its batch is durable, so nothing acknowledged is lost.
        log.warning("exit_now", reason="second SIGINT")
        flush_logs()
        os._exit(ExitCode.RESUMABLE)

    # ---- telemetry ------------------------------------------------------------------

    async def _start_http(
        self,
        status: StatusFn,
        healthy: Callable[[], bool],
        routes: Routes | None,
        max_body_bytes: int | None,
        tls: ssl.SSLContext | None,
        header_timeout_s: float | None,
        flag: str,
    ) -> None:
        listen = resolve_listen(self.settings.metrics_listen)
        if listen is None:
            return
        # The HTTP server (aiohttp.web, ~25 ms of CPU to import) is loaded only when the
        # process listens: a run with `--metrics-listen off` never needs it.
        from dispatcher.telemetry.server import start_http_server

        host, port = listen
        try:
            runner, bound = await start_http_server(
                host,
                port,
                metrics=self.metrics,
                status=status,
                healthy=healthy,
                routes=routes,
                max_body_bytes=max_body_bytes,
                ssl_context=tls,
                header_timeout_s=header_timeout_s,
            )
        except OSError as exc:
            raise ConfigError(
                f"{flag} {self.settings.metrics_listen}: cannot listen ({exc.strerror})"
            ) from None
        scheme = "https" if tls is not None else "http"
        self.metrics_endpoint = endpoint = MetricsEndpoint(host, bound, scheme=scheme)
        self._stack.push_async_callback(runner.cleanup)
        self._stack.callback(endpoint.withdraw)
        # Runs before the listener stops: a final scrape sees the end state.
        self._stack.callback(self.update_gauges)

    async def _tick(self, status: StatusFn) -> None:
        """Refresh the gauges every second and log progress every interval."""
        interval_s = self.settings.progress_interval_s
        next_progress = time.monotonic() + interval_s
        while True:
            self.update_gauges()
            if time.monotonic() >= next_progress:
                next_progress += interval_s
                log.info("progress", **progress_fields(status()))
            # An interval under a second must not be stretched to the gauge tick.
            await asyncio.sleep(min(1.0, interval_s))

    def update_gauges(self) -> None:
        self.metrics.update(
            quantiles={q: self.latency.quantile(q) for q in (0.5, 0.75, 0.95)},
            drain_margin_s=self.drain_margin(),
            budget_remaining_s=self.budget.remaining_s(),
            remaining=self.remaining(),
        )


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
