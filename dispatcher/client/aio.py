"""The async client: one aiohttp session, retries with backoff, resumable results."""

from __future__ import annotations

import asyncio
import os
import random
import ssl
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from types import TracebackType
from typing import Any, Self, TypeVar

import aiohttp

from dispatcher import jsonx
from dispatcher.client.admits import AdmitChannel
from dispatcher.client.wire import (
    Admission,
    ClientError,
    JobStatus,
    NdjsonSplitter,
    StreamPosition,
    error_message,
    job_path,
    resolve_token,
    results_query,
    submit_body,
    unauthorized,
)
from dispatcher.delivery.retry import BackoffPolicy
from dispatcher.lifecycle import JobState

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_RETRY_DEADLINE_S = 60.0
# A daemon this client never reached: refused or unresolvable is a wrong URL or a
# daemon that is not up, an error within this many seconds, not a minute of retries.
DEFAULT_CONNECT_DEADLINE_S = 10.0
DEFAULT_BACKOFF = BackoffPolicy(base_s=0.1, cap_s=5.0)
# The daemon answers these while it starts, stops or sits behind a proxy.
_TRANSIENT_STATUSES = frozenset({502, 503, 504})
_TRANSIENT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)


# --- retries -----------------------------------------------------------------------


class _Retry:
    """Backoff between tries until ``deadline_s`` passes without progress."""

    def __init__(self, deadline_s: float, backoff: BackoffPolicy) -> None:
        self._deadline_s = deadline_s
        self._backoff = backoff
        self._rng = random.Random()
        self._tries = 0
        self._since = time.monotonic()

    def progress(self) -> None:
        self._tries = 0
        self._since = time.monotonic()

    async def pause_or_raise(self, error: str, deadline_s: float | None = None) -> None:
        """Sleep before the next try, or raise once the deadline (``deadline_s`` when
        shorter than the retries' own) would pass."""
        limit_s = self._deadline_s if deadline_s is None else min(deadline_s, self._deadline_s)
        delay = self._backoff.delay_s(self._tries, self._rng)
        if time.monotonic() + delay - self._since > limit_s:
            raise ClientError(None, f"no answer within {limit_s:g} s: {error}")
        self._tries += 1
        await asyncio.sleep(delay)


class _Transient(Exception):
    """A failure worth another try (connection lost, daemon starting or stopping);
    ``no_connection``: no connection could be made at all (refused, DNS)."""

    def __init__(self, message: str, *, no_connection: bool = False) -> None:
        super().__init__(message)
        self.no_connection = no_connection

    @classmethod
    def of(cls, exc: BaseException) -> _Transient:
        """The retry for one of ``_TRANSIENT_ERRORS``."""
        return cls(_describe(exc), no_connection=isinstance(exc, aiohttp.ClientConnectorError))


# --- the async client --------------------------------------------------------------


class Results:
    """The async iterator ``AsyncClient.results`` returns (see the module's resume contract)."""

    def __init__(
        self, open_stream: Callable[[StreamPosition], AsyncGenerator[dict[str, Any], None]]
    ) -> None:
        self._position = StreamPosition()
        self._items = open_stream(self._position)

    @property
    def last_seq(self) -> int:
        """The ``_ng_seq`` of the last row (or group) yielded; 0 before the first."""
        return self._position.last_seq

    @property
    def final_state(self) -> JobState | None:
        """The job's final state once the stream's end line arrived, else None."""
        return self._position.final_state

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> dict[str, Any]:
        return await self._items.__anext__()

    async def aclose(self) -> None:
        """Close the connection of an iterator not read to its end."""
        await self._items.aclose()


class AsyncClient:
    """The daemon's HTTP API over one aiohttp session; use as ``async with``.

    ``token`` is the daemon's API token, sent as ``Authorization: Bearer``
    (default: ``DISPATCHER_API_TOKEN``; none when that is unset); a 401 is
    ``Unauthorized``. ``ssl_context`` verifies an https daemon's certificate
    (default: the system's trust store).
    ``timeout_s`` bounds each call (and a stream's connect);
    ``retry_deadline_s`` is how long a call or a stream keeps retrying without
    progress; ``stream_idle_timeout_s`` reconnects a results stream silent
    for that long (useful once the daemon sends keep-alive lines).
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
        connect_deadline_s: float = DEFAULT_CONNECT_DEADLINE_S,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # Private, and in no repr or error: only the session's header carries it.
        self._token = resolve_token(token)
        self._ssl_context = ssl_context
        self.timeout_s = timeout_s
        self.retry_deadline_s = retry_deadline_s
        self.stream_idle_timeout_s = stream_idle_timeout_s
        self._backoff = backoff
        self.connect_deadline_s = connect_deadline_s
        # Set by the daemon's first answer: from then on a refused connection is a
        # daemon restarting, retried for ``retry_deadline_s``.
        self.reached = False
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        headers = {} if self._token is None else {"Authorization": f"Bearer {self._token}"}
        verify: ssl.SSLContext | bool = True if self._ssl_context is None else self._ssl_context
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=verify),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            json_serialize=lambda obj: jsonx.dumps(obj).decode(),
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def submit(
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
        """Submit a job: ``rows``, or ``input``, a task file's path on the daemon's host.

        With a ``job_id`` the call is idempotent (the same body returns the
        same job) and is retried across a lost connection; without one it is
        sent once. ``responses_create_params`` are merged over each row's;
        ``target_groups``, ``overprovision``, ``on_target`` (``"finish"`` or
        ``"cancel"``) and ``group_filter`` (``"nonzero_reward_std"``) are step
        control: the job stops once that many complete groups are kept;
        ``target_groups_by_agent`` ({agent: N}, exactly N kept groups of each) or
        ``target_tokens`` (N generated tokens in kept groups) are the other targets.
        ``max_attempts`` replaces the daemon's ``--max-attempts`` for this job's
        rollouts (1 when the caller retries itself); ``max_in_flight`` bounds its
        rollouts at agents at once; ``admit``, its rollouts started until
        ``admit(job_id, n)`` raises it.
        """
        body = submit_body(
            rows, input, job_id=job_id, num_repeats=num_repeats, default_agent=default_agent,
            policy_version=policy_version, priority=priority, metadata=metadata,
            responses_create_params=responses_create_params, target_groups=target_groups,
            overprovision=overprovision, on_target=on_target, group_filter=group_filter,
            max_attempts=max_attempts, target_groups_by_agent=target_groups_by_agent,
            target_tokens=target_tokens, max_in_flight=max_in_flight, admit=admit,
        )  # fmt: skip
        answer = await self._call("POST", "/v1/jobs", body, retry=job_id is not None)
        return JobStatus.from_json(answer)

    async def status(self, job_id: str) -> JobStatus:
        return JobStatus.from_json(await self._call("GET", job_path(job_id)))

    async def jobs(self, *states: str) -> list[JobStatus]:
        """Every job the daemon knows; only those in ``states`` when given."""
        query = f"?state={','.join(states)}" if states else ""
        answer = await self._call("GET", f"/v1/jobs{query}")
        if not isinstance(answer, dict) or not isinstance(answer.get("jobs"), list):
            raise ClientError(None, "GET /v1/jobs: no jobs list in the answer")
        return [JobStatus.from_json(job) for job in answer["jobs"]]

    async def cancel(self, job_id: str) -> JobStatus:
        """Cancel a job: its in-flight rollouts are cancelled and write nothing."""
        return JobStatus.from_json(await self._call("DELETE", job_path(job_id)))

    async def admit(self, job_id: str, count: int) -> int | None:
        """Let a job with ``admit`` have started ``count`` of its rollouts in all (never
        lowered); the bound now, None once the job is final."""
        answer = await self._call("POST", job_path(job_id, "/admit"), {"admit": count})
        admitted = answer.get("admit") if isinstance(answer, dict) else None
        return admitted if isinstance(admitted, int) else None

    async def admit_channel(self, job_id: str) -> AdmitChannel:
        """The job's admit channel, open: ``admit`` as a message on one connection,
        for a caller that raises it as it takes each result (``client/admits.py``).
        ``ClientError`` when it cannot open (its ``status`` the daemon's: 404 an
        unknown job; a daemon without channels answers 405), tried once."""
        url = self.base_url + job_path(job_id, "/admit")
        try:
            socket = await self._http.ws_connect(
                url, timeout=aiohttp.ClientWSTimeout(ws_close=self.timeout_s)
            )
        except aiohttp.WSServerHandshakeError as exc:
            self.reached = True
            raise ClientError(exc.status, f"admit channel of {job_id}: {exc.message}") from None
        except _TRANSIENT_ERRORS as exc:
            raise ClientError(None, f"admit channel of {job_id}: {_describe(exc)}") from None
        self.reached = True
        return AdmitChannel(job_id, socket)

    async def wait(self, job_id: str, *, poll_s: float = 1.0) -> JobStatus:
        """The job's status once it is final (polls ``status``)."""
        while True:
            job = await self.status(job_id)
            if job.final:
                return job
            await asyncio.sleep(poll_s)

    async def set_policy_version(self, version: int, *, force: bool = False) -> int:
        """Set the current policy version V (after each weight update); returns V. A
        lower V than the daemon's is a ``ClientError`` 409 unless ``force``."""
        body: dict[str, Any] = {"version": version}
        if force:
            body["force"] = True
        return _version(await self._call("POST", "/v1/policy", body))

    async def policy_version(self) -> int:
        return _version(await self._call("GET", "/v1/policy"))

    async def pause(self, *, ttl_s: float | None = None, reason: str | None = None) -> Admission:
        """Stop every rollout of the daemon from starting (around a weight update);
        rollouts in flight go on. It ends with ``resume``, the next
        ``set_policy_version``, or by itself after ``ttl_s`` (the daemon's
        default: 300 s), so a trainer that dies never wedges the daemon."""
        body = {k: v for k, v in (("ttl_s", ttl_s), ("reason", reason)) if v is not None}
        return Admission.from_json(
            await self._call("POST", "/v1/admission", {"paused": True, **body})
        )

    async def resume(self) -> Admission:
        """End the pause."""
        return Admission.from_json(await self._call("POST", "/v1/admission", {"paused": False}))

    async def admission(self) -> Admission:
        """The pause and what is in flight, now."""
        return Admission.from_json(await self._call("GET", "/v1/admission"))

    async def wait_idle(self, *, timeout_s: float = 60.0) -> Admission:
        """Once no rollout is in flight (``idle``), or at ``timeout_s``."""
        path = f"/v1/admission?wait_idle=true&timeout_s={timeout_s:g}"
        return Admission.from_json(await self._call("GET", path, timeout_s=timeout_s))

    def results(
        self,
        job_id: str,
        *,
        after: int = 0,
        group: bool = False,
        wait: bool = True,
        filtered: bool = False,
        failures: bool = False,
    ) -> Results:
        """Rows (or complete groups) of a job as they become durable, each exactly once.

        Stops at the stream's end (``Results.final_state`` then holds the
        job's final state) or, with ``wait=False``, once caught up. A job with
        a target: a grouped stream ends right after its target-th kept group
        (``final_state`` is ``satisfied``); ``after=`` that group's seq reads
        the tail. Groups its filter dropped come only with ``filtered=True``.
        With ``failures=True`` (rows only) a rollout's final failure comes as it
        happens, as ``{"_ng_failure_seq": N, "failure": row}``, each once.
        """
        if failures and group:
            raise ValueError("failures: only on a stream of rows (group=False)")

        def open_stream(position: StreamPosition) -> AsyncGenerator[dict[str, Any], None]:
            position.last_seq = after
            flags = (group, wait, filtered, failures)
            return self._stream(job_id, position, flags)

        return Results(open_stream)

    # --- plumbing ---

    @property
    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use the client as `async with AsyncClient(...) as client`")
        return self._session

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        retry: bool = True,
        timeout_s: float | None = None,
    ) -> Any:
        """One API call, retried while transient; ``timeout_s``: how long the daemon
        may take on purpose (a long poll), on top of the call's own timeout."""
        retries = _Retry(self.retry_deadline_s, self._backoff)
        limits = aiohttp.ClientTimeout(total=self.timeout_s + (timeout_s or 0.0))
        while True:
            try:
                return await self._call_once(method, path, body, limits)
            except _Transient as exc:
                if not retry:
                    raise ClientError(None, f"{method} {path}: {exc}") from None
                await retries.pause_or_raise(f"{method} {path}: {exc}", self._deadline_for(exc))

    def _deadline_for(self, exc: _Transient) -> float | None:
        """The connect deadline for a daemon never reached, else None (the retries')."""
        return self.connect_deadline_s if exc.no_connection and not self.reached else None

    async def _call_once(
        self, method: str, path: str, body: Any, limits: aiohttp.ClientTimeout
    ) -> Any:
        try:
            url = self.base_url + path
            async with self._http.request(method, url, json=body, timeout=limits) as resp:
                self.reached = True
                raw = await resp.read()
                self._raise_for_status(resp, raw)
        except _TRANSIENT_ERRORS as exc:
            raise _Transient.of(exc) from None
        try:
            return jsonx.loads(raw)
        except ValueError:
            raise ClientError(resp.status, f"{method} {path}: answer is not JSON") from None

    async def _stream(
        self, job_id: str, position: StreamPosition, flags: tuple[bool, bool, bool, bool]
    ) -> AsyncGenerator[dict[str, Any], None]:
        wait = flags[1]
        retries = _Retry(self.retry_deadline_s, self._backoff)
        while True:
            deadline_s: float | None = None
            try:
                # aclosing: a consumer that stops early must release the connection now.
                lines = self._stream_once(job_id, position, retries, flags)
                async with aclosing(lines):
                    async for item in lines:
                        yield item
                if position.final_state is not None or not wait:
                    return
                error = "the stream ended before the job was final"
            except _Transient as exc:
                error, deadline_s = str(exc), self._deadline_for(exc)
            await retries.pause_or_raise(f"results of {job_id}: {error}", deadline_s)

    async def _stream_once(
        self,
        job_id: str,
        position: StreamPosition,
        retries: _Retry,
        flags: tuple[bool, bool, bool, bool],
    ) -> AsyncGenerator[dict[str, Any], None]:
        """One connection's worth of the stream; ``_Transient`` when it was cut.
        ``flags``: group, wait, filtered, failures."""
        group, wait, filtered, failures = flags
        failures_after = position.last_failure_seq if failures else None
        query = results_query(position.last_seq, group, wait, filtered, failures_after)
        url = f"{self.base_url}{job_path(job_id, '/results')}?{query}"
        # No total timeout: a job's stream lives as long as the job. An idle
        # timeout is the only way to notice a half-open connection (the
        # daemon's host gone without a FIN); off unless asked for.
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.timeout_s, sock_read=self.stream_idle_timeout_s
        )
        splitter = NdjsonSplitter()
        try:
            async with self._http.get(url, timeout=timeout) as resp:
                self.reached = True
                if resp.status == 404 and position.connected:
                    # Jobs are never forgotten: a job streamed before and
                    # unknown now is a restarted daemon still loading its registry.
                    raise _Transient("404 for a job streamed before: the daemon is starting")
                if resp.status != 200:
                    self._raise_for_status(resp, await resp.read())
                position.connected = True
                retries.progress()
                async for chunk in resp.content.iter_any():
                    for line in splitter.feed(chunk):
                        item = position.accept(line)
                        if item is not None:
                            retries.progress()
                            yield item
                        elif position.final_state is not None:
                            return
        except _TRANSIENT_ERRORS as exc:
            raise _Transient.of(exc) from None
        if splitter.partial:
            raise _Transient("the stream was cut mid-line")

    def _raise_for_status(self, resp: aiohttp.ClientResponse, raw: bytes) -> None:
        if resp.status < 400:
            return
        message = error_message(raw, resp.reason or "")
        if resp.status in _TRANSIENT_STATUSES:
            raise _Transient(f"{resp.status}: {message}")
        if resp.status == 401:
            raise unauthorized(message, token_sent=self._token is not None)
        raise ClientError(resp.status, message)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _version(answer: Any) -> int:
    if not isinstance(answer, dict) or not isinstance(answer.get("version"), int):
        raise ClientError(None, f"policy answer without an integer version: {answer!r}")
    version: int = answer["version"]
    return version
