"""The blocking client: the async one, run on a private loop in its own thread."""

from __future__ import annotations

import asyncio
import os
import ssl
import threading
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import Any, Self, TypeVar

from dispatcher.client.aio import (
    DEFAULT_BACKOFF,
    DEFAULT_RETRY_DEADLINE_S,
    DEFAULT_TIMEOUT_S,
    AsyncClient,
    Results,
)
from dispatcher.client.wire import Admission, JobStatus
from dispatcher.delivery.retry import BackoffPolicy
from dispatcher.lifecycle import JobState

T = TypeVar("T")


class BlockingResults:
    """The plain iterator ``Client.results`` returns; same attributes as ``Results``."""

    def __init__(self, client: Client, results: Results) -> None:
        self._client = client
        self._results = results

    @property
    def last_seq(self) -> int:
        return self._results.last_seq

    @property
    def final_state(self) -> JobState | None:
        return self._results.final_state

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> dict[str, Any]:
        try:
            return self._client._run(self._results.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        self._client._run(self._results.aclose())


class Client:
    """The same API as ``AsyncClient``, blocking; use as ``with Client(...) as client``.

    It runs an ``AsyncClient`` on a private event loop in a thread of its own
    rather than re-implementing the calls over ``http.client``: one
    implementation of retries, reconnection and parsing serves both clients,
    so they cannot drift apart, and it works from code that already runs an
    event loop of its own (a notebook), where ``asyncio.run`` would refuse.
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S,
        stream_idle_timeout_s: float | None = None,
        backoff: BackoffPolicy = DEFAULT_BACKOFF,
    ) -> None:
        self._async = AsyncClient(
            base_url,
            token=token,
            ssl_context=ssl_context,
            timeout_s=timeout_s,
            retry_deadline_s=retry_deadline_s,
            stream_idle_timeout_s=stream_idle_timeout_s,
            backoff=backoff,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=loop.run_forever, name="dispatcher-client", daemon=True
        )
        self._thread.start()
        self._loop = loop
        self._run(self._async.__aenter__())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            # Streams left unfinished first: they hold connections of the session.
            self._run(loop.shutdown_asyncgens())
            self._run(self._async.close())
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()
            self._loop = self._thread = None

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            coro.close()
            raise RuntimeError("use the client as `with Client(...) as client`")
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            # Interrupted (Ctrl-C) while waiting: the call must not go on alone.
            future.cancel()
            raise

    def submit(
        self,
        rows: Sequence[Mapping[str, Any]] | None = None,
        *,
        input: str | os.PathLike[str] | None = None,
        job_id: str | None = None,
        num_repeats: int | None = None,
        default_agent: str | None = None,
        policy_version: int | None = None,
        priority: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        responses_create_params: Mapping[str, Any] | None = None,
        target_groups: int | None = None,
        overprovision: float | None = None,
        on_target: str | None = None,
        group_filter: str | None = None,
        max_attempts: int | None = None,
        target_groups_by_agent: Mapping[str, int] | None = None,
        target_tokens: int | None = None,
        max_in_flight: int | None = None,
        admit: int | None = None,
    ) -> JobStatus:
        """See ``AsyncClient.submit``."""
        return self._run(
            self._async.submit(
                rows, input=input, job_id=job_id, num_repeats=num_repeats,
                default_agent=default_agent, policy_version=policy_version,
                priority=priority, metadata=metadata,
                responses_create_params=responses_create_params, target_groups=target_groups,
                overprovision=overprovision, on_target=on_target, group_filter=group_filter,
                max_attempts=max_attempts,
                target_groups_by_agent=target_groups_by_agent, target_tokens=target_tokens,
                max_in_flight=max_in_flight, admit=admit,
            )
        )  # fmt: skip

    def status(self, job_id: str) -> JobStatus:
        return self._run(self._async.status(job_id))

    def jobs(self, *states: str) -> list[JobStatus]:
        return self._run(self._async.jobs(*states))

    def cancel(self, job_id: str) -> JobStatus:
        return self._run(self._async.cancel(job_id))

    def admit(self, job_id: str, count: int) -> int | None:
        """See ``AsyncClient.admit``."""
        return self._run(self._async.admit(job_id, count))

    def wait(self, job_id: str, *, poll_s: float = 1.0) -> JobStatus:
        return self._run(self._async.wait(job_id, poll_s=poll_s))

    def set_policy_version(self, version: int, *, force: bool = False) -> int:
        return self._run(self._async.set_policy_version(version, force=force))

    def policy_version(self) -> int:
        return self._run(self._async.policy_version())

    def pause(self, *, ttl_s: float | None = None, reason: str | None = None) -> Admission:
        """See ``AsyncClient.pause``."""
        return self._run(self._async.pause(ttl_s=ttl_s, reason=reason))

    def resume(self) -> Admission:
        return self._run(self._async.resume())

    def admission(self) -> Admission:
        return self._run(self._async.admission())

    def wait_idle(self, *, timeout_s: float = 60.0) -> Admission:
        return self._run(self._async.wait_idle(timeout_s=timeout_s))

    def results(
        self,
        job_id: str,
        *,
        after: int = 0,
        group: bool = False,
        wait: bool = True,
        filtered: bool = False,
        failures: bool = False,
    ) -> BlockingResults:
        """See ``AsyncClient.results``; a plain iterator."""
        results = self._async.results(
            job_id, after=after, group=group, wait=wait, filtered=filtered, failures=failures
        )
        return BlockingResults(self, results)
