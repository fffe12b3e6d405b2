"""A drop-in for trainers that call NeMo Gym's Python API (contracts §15).

NeMo RL drives Gym in-process through ``RolloutCollectionHelper().run_examples(
examples)``; the same loop runs on ``dispatcher serve`` by changing one line::

    from dispatcher.client.gym import RolloutCollectionHelper

    helper = RolloutCollectionHelper()  # DISPATCHER_URL, else a daemon of its own
    for future in helper.run_examples(examples):
        row, result = await future  # in completion order, as Gym's

``run_examples`` (Gym 0.7.0's and Main's signature) returns an iterator of
``len(examples)`` awaitables, each resolving to ``(row, result)`` in
completion order; ``row`` is the caller's example, the same object.
``result`` is what the agent's ``/run`` answered, without the keys the
dispatcher owns or rewrites (``DISPATCHER_KEYS``: the identity keys
``_ng_task_index``, ``_ng_rollout_index``, ``agent_ref`` and the others of
contracts §3, ``_ng_seq``, the policy versions, ``_ng_run_id``, and the
capture view ``ng_trajectory``/``ng_perf``/``ng_model_call_capture``). An agent
that echoes its request has the identity keys in its own answer; they are in
``row``. The full durable row stays in the job's output on the daemon. An
answer carrying ``_ng_failure_class`` is a failure here (contracts §3),
where Gym hands it back as a result.

Behind it, the examples are a job on the daemon (``num_repeats`` 1), streamed
back as rows become durable. The first ``await`` submits it. Rows go to the
agents as the dispatcher sends them (contracts §1, §3): an example without
``_ng_task_index`` gets one of its own; ``_ng_rollout_index`` is the
dispatcher's (0, 1, ... per task within the job). Jobs are submitted with
``max_attempts`` 1 (the helper's ``max_attempts``): Gym's helper never
retries a rollout, its caller does. The daemon resumes as for any job
(contracts §5, §11).

Gym's keyword arguments:

- ``max_resident_tasks``: at most that many examples resident, as Gym
  counts them: started and not yet taken by the trainer (a result waiting
  to be taken holds its slot). All are one job, its rows on one stream,
  whose ``admit`` (contracts §12) is the window, raised by one as the trainer
  takes each result (a message on the job's admit channel, no answer
  awaited; a request on a daemon without one). ``ValueError`` below 1, as Gym.
- ``dispatch_budget_s``, ``drain_margin_s``: an example not admitted when
  less than the margin is left of the budget (counted from this call) never
  runs and resolves to Gym's drained result (``_ng_failure_class``
  ``"cancelled"``, ``_ng_no_persist``, ``_ng_dispatch_drained``); the job is
  cancelled once what it started is in. Without a margin it adapts to the
  p75 of the rollouts' durations once five are in, as Gym. Each example is
  checked as it is admitted, as Gym checks a task it starts.
- ``route_failures_to_sidecar``: a rollout that ended failed (its attempts
  spent, or a terminal failure), known as its failure row is durable (the
  daemon streams it), resolves to Gym's failure result (``_ng_failure_class``,
  ``_ng_failure_type``, ``_ng_failure_message``, ``_ng_failure_http_status``,
  ``_ng_failure_response_body``, from that row); without it its awaitable
  raises ``RolloutFailed``, then, with the last attempt's HTTP status.
- ``latency_tracker``: Gym's ``DispatchLatencyTracker`` (anything with
  ``record(seconds)`` and ``record_drained()``) gets each rollout's duration.
- ``head_server_config``: with a URL (or ``DISPATCHER_URL``) not used, the
  daemon's agents come from its own flags; without one, the head server
  whose agents the helper's own daemon runs (None: Gym's default, the
  ``head_server`` of Gym's global config).
- ``semaphore``: not used: the daemon's ``--concurrency`` bounds requests.
- ``environment_server_name``: only None; rows route by ``agent_ref``.

A job refused as bigger than ``--max-body-bytes`` (413) is cut into jobs of
half its bytes, the bound kept; an example too big alone resolves to the 413.

A job that ends cancelled or incomplete resolves its unrun examples to the
drained result; a job that fails raises ``ClientError`` from theirs.
``Completions.aclose()`` stops early: the jobs still running are cancelled.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from typing import Any

from dispatcher.client.aio import AsyncClient
from dispatcher.client.embedded import EmbeddedDaemon, head_server_url
from dispatcher.client.gym_collection import Collection
from dispatcher.client.gym_plan import (
    DISPATCHER_KEYS,
    Completions,
    LatencyTracker,
    Options,
    RolloutFailed,
    agent_result,
    drained_result,
)

__all__ = [
    "DISPATCHER_KEYS",
    "Completions",
    "RolloutCollectionHelper",
    "RolloutFailed",
    "agent_result",
    "drained_result",
]


class RolloutCollectionHelper:
    """Gym's ``RolloutCollectionHelper`` on ``dispatcher serve`` (see the module).

    ``url``: the daemon's; default ``DISPATCHER_URL``; without either, a daemon of
    the helper's own is started on loopback (``client/embedded.py``): its
    process here, importing, its service at the first ``run_examples``, which
    names the head server; stopped by ``close()`` or at exit.
    ``token``: the daemon's API token (default ``DISPATCHER_API_TOKEN``);
    ``max_attempts``: each job's attempt cap (contracts §12), 1 by default as
    Gym's helper never retries (the trainer's own retry budgets apply); None
    leaves the daemon's ``--max-attempts``; ``client_options`` go to
    ``AsyncClient`` (timeouts, TLS).
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        max_attempts: int | None = 1,
        **client_options: Any,
    ) -> None:
        if max_attempts is not None and max_attempts < 1:
            raise ValueError("max_attempts must be >= 1 (or None for the daemon's)")
        self.url = url or os.environ.get("DISPATCHER_URL") or None
        self._token = token
        self._max_attempts = max_attempts
        self._client_options = client_options
        self._starting = threading.Lock()
        # Its own daemon starts now, importing while the trainer sets up: the
        # imports are most of its start (client/embedded.py).
        self._daemon = EmbeddedDaemon.spawn() if self.url is None else None

    @property
    def daemon(self) -> EmbeddedDaemon | None:
        """The helper's own daemon, once started (None with a URL)."""
        return self._daemon

    def close(self) -> None:
        """Stop the helper's own daemon, if it started one (blocking; idempotent)."""
        if self._daemon is not None:
            self._daemon.stop()

    def __enter__(self) -> RolloutCollectionHelper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run_examples(
        self,
        examples: list[dict[str, Any]],
        head_server_config: Any = None,
        semaphore: Any = None,
        route_failures_to_sidecar: bool = False,
        environment_server_name: str | None = None,
        *,
        max_resident_tasks: int | None = None,
        dispatch_budget_s: float | None = None,
        drain_margin_s: float | None = None,
        latency_tracker: LatencyTracker | None = None,
    ) -> Completions:
        """An iterator of awaitables, one per example, each ``(row, result)`` (Gym's contract)."""
        if max_resident_tasks is not None and max_resident_tasks < 1:
            raise ValueError("max_resident_tasks must be >= 1")
        if environment_server_name is not None:
            raise ValueError(
                "environment_server_name: the dispatcher routes rows by agent_ref only; "
                "give the agent each row runs on"
            )
        options = Options(
            failures_as_results=route_failures_to_sidecar,
            max_attempts=self._max_attempts,
            max_resident_tasks=max_resident_tasks,
            dispatch_budget_s=dispatch_budget_s,
            drain_margin_s=drain_margin_s,
            latency_tracker=latency_tracker,
        )

        async def locate() -> Callable[[], AsyncClient]:
            url = self.url
            if url is None:
                url = await asyncio.to_thread(self._own_daemon, head_server_config)
            return functools.partial(AsyncClient, url, token=self._token, **self._client_options)

        return Completions(Collection(locate, examples, options), len(examples))

    def _own_daemon(self, head_server_config: Any) -> str:
        """The URL of the helper's own daemon, its service started for
        ``head_server_config``'s agents on the first call (blocking)."""
        with self._starting:
            head = head_server_url(head_server_config)
            if self._daemon is None or self._daemon.process.poll() is not None:
                self._daemon = EmbeddedDaemon.spawn()  # stopped by close(): a new one
            if not self._daemon.configured:
                self._daemon.configure(head)
            elif head != self._daemon.head_server:
                raise ValueError(
                    f"head_server_config: {head} is not the head server this helper's "
                    f"daemon serves ({self._daemon.head_server}); use one helper per Gym stack"
                )
            return self._daemon.url
