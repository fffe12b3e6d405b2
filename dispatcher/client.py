"""Python client of ``dispatcher serve`` (DESIGN A12): jobs, results, policy version.

A trainer submits the rollouts of step N+1 while it consumes step N, so the
daemon is never idle between steps::

    from dispatcher.client import AsyncClient

    async def train(steps: list[list[dict]]) -> None:
        async with AsyncClient("http://rollouts:8080") as client:
            await client.submit(steps[0], job_id="step-0", num_repeats=8, policy_version=0)
            for n in range(len(steps)):
                if n + 1 < len(steps):  # queued behind step n, starts as slots free up
                    await client.submit(
                        steps[n + 1], job_id=f"step-{n + 1}", num_repeats=8, policy_version=n + 1
                    )
                results = client.results(f"step-{n}", group=True)
                async for group in results:  # a complete group as soon as it is durable
                    learn(group["task_index"], group["rows"])
                assert results.final_state == "done"
                await client.set_policy_version(n + 1)  # after the weight update

``Client`` is the same API, blocking, for trainers without an event loop
(``for group in client.results(...)``).

The resume contract, kept by ``results``: every line the daemon streams carries
``_ng_seq`` (a row's line number in the job's output, or a group's own
sequence number with ``group=True``), and ``after=SEQ`` resumes exactly after
it. The iterator remembers the last ``_ng_seq`` it yielded; when the connection
drops or the daemon restarts it reconnects with ``after=`` that seq, with
backoff, until ``retry_deadline_s`` passes without progress. The caller sees
every row exactly once. ``Results.last_seq`` is what to persist to resume
across processes (``results(job_id, after=last_seq)``). A 404 for a job the
stream has already read from counts as a daemon still starting (jobs are never
forgotten), not as an unknown job.

Every call whose repetition is harmless is retried the same way: all of them
except ``submit`` without a ``job_id`` (a retried anonymous submit could create
a second job). Errors are one type, ``ClientError(status, message)``: the
HTTP status and the daemon's one-line error, or status None when no answer
came within the deadline.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Future
from contextlib import aclosing
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import quote, urlencode

import aiohttp

from dispatcher import contracts, jsonx
from dispatcher.backoff import BackoffPolicy
from dispatcher.lifecycle import JobState

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_RETRY_DEADLINE_S = 60.0
DEFAULT_BACKOFF = BackoffPolicy(base_s=0.1, cap_s=5.0)
# The daemon answers these while it starts, stops or sits behind a proxy.
_TRANSIENT_STATUSES = frozenset({502, 503, 504})
_TRANSIENT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)


class ClientError(Exception):
    """The daemon refused a call (its HTTP status and one-line error), or never answered."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(f"{status}: {message}" if status is not None else message)
        self.status = status
        self.message = message


class JobStatus(contracts.JobStatus):
    """A job's status (``dispatcher.contracts.JobStatus``); a bad one is a ``ClientError``."""

    @classmethod
    def from_json(cls, body: Any) -> JobStatus:
        try:
            status = contracts.JobStatus.from_json(body)
        except ValueError as exc:
            raise ClientError(None, f"from the daemon: {exc}") from None
        return cls(**vars(status))


# --- pure pieces: URLs, bodies, the NDJSON stream ----------------------------------


def job_path(job_id: str, suffix: str = "") -> str:
    """``/v1/jobs/<id>[suffix]`` with the id quoted as one path segment."""
    return f"/v1/jobs/{quote(job_id, safe='')}{suffix}"


def results_query(after: int, group: bool, wait: bool) -> str:
    """The query string of a results request."""
    flag = {True: "true", False: "false"}
    return urlencode({"after": str(after), "group": flag[group], "wait": flag[wait]})


def submit_body(
    rows: Sequence[Mapping[str, Any]] | None,
    input: str | os.PathLike[str] | None,
    **fields: Any,
) -> dict[str, Any]:
    """The JSON body of ``POST /v1/jobs``: only the fields given (the daemon validates)."""
    body: dict[str, Any] = {k: v for k, v in fields.items() if v is not None}
    if rows is not None:
        body["rows"] = list(rows)
    if input is not None:
        body["input"] = os.fspath(input)
    return body


def error_message(raw: bytes, reason: str) -> str:
    """The daemon's one-line ``{"error": ...}``, or the start of whatever came instead."""
    try:
        body = jsonx.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return str(body["error"])
    text = raw.decode("utf-8", "replace").strip().splitlines()
    return text[0][:200] if text else reason


class NdjsonSplitter:
    """Complete lines out of a byte stream cut anywhere; blank lines (keep-alives) skipped."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[bytes]:
        # Search only the new bytes: a 20 MB row in 64 KB chunks stays linear.
        start = len(self._buffer)
        self._buffer += chunk
        newline = self._buffer.find(b"\n", start)
        lines: list[bytes] = []
        begin = 0
        while newline >= 0:
            line = bytes(self._buffer[begin:newline]).strip()
            if line:
                lines.append(line)
            begin = newline + 1
            newline = self._buffer.find(b"\n", begin)
        del self._buffer[:begin]
        return lines

    @property
    def partial(self) -> bool:
        """Whether bytes of an unfinished line are held (a stream cut mid-line)."""
        return bool(self._buffer.strip())


@dataclass
class StreamPosition:
    """Where a results stream stands: the last ``_ng_seq`` yielded, the final state once seen."""

    last_seq: int = 0
    final_state: JobState | None = None
    #: Whether the daemon has answered 200 for this stream once.
    connected: bool = False

    def accept(self, line: bytes) -> dict[str, Any] | None:
        """The row (or group) to yield, or None for a repeat or the end line."""
        try:
            item = jsonx.loads(line)
        except ValueError:
            raise ClientError(None, f"results line is not JSON: {line[:200]!r}") from None
        if not isinstance(item, dict):
            raise ClientError(None, f"results line is not an object: {line[:200]!r}")
        seq = item.get("_ng_seq")
        if seq is None:
            if "end" not in item:
                raise ClientError(None, f"results line without _ng_seq: {line[:200]!r}")
            self.final_state = _end_state(item["end"])
            return None
        if not isinstance(seq, int):
            raise ClientError(None, f"results line with a bad _ng_seq: {seq!r}")
        if seq <= self.last_seq:
            return None  # a peer that resent what we already yielded: never twice
        self.last_seq = seq
        return item


def _end_state(end: Any) -> JobState:
    """The final state an end line names: ``"done"``, or a status object holding it."""
    state = end.get("state") if isinstance(end, dict) else end
    try:
        return JobState(str(state))
    except ValueError:
        raise ClientError(None, f"results end line with an unknown state: {end!r}") from None


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

    async def pause_or_raise(self, error: str) -> None:
        """Sleep before the next try, or raise once the deadline would pass."""
        delay = self._backoff.delay_s(self._tries, self._rng)
        if time.monotonic() + delay - self._since > self._deadline_s:
            raise ClientError(None, f"no answer within {self._deadline_s:g} s: {error}")
        self._tries += 1
        await asyncio.sleep(delay)


class _Transient(Exception):
    """A failure worth another try (connection lost, daemon starting or stopping)."""


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

    ``timeout_s`` bounds each call (and a stream's connect);
    ``retry_deadline_s`` is how long a call or a stream keeps retrying without
    progress; ``stream_idle_timeout_s`` reconnects a results stream silent
    for that long (useful once the daemon sends keep-alive lines).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S,
        stream_idle_timeout_s: float | None = None,
        backoff: BackoffPolicy = DEFAULT_BACKOFF,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retry_deadline_s = retry_deadline_s
        self.stream_idle_timeout_s = stream_idle_timeout_s
        self._backoff = backoff
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        self._session = aiohttp.ClientSession(
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
    ) -> JobStatus:
        """Submit a job: ``rows``, or ``input``, a task file's path on the daemon's host.

        With a ``job_id`` the call is idempotent (the same body returns the
        same job) and is retried across a lost connection; without one it is
        sent once.
        """
        body = submit_body(
            rows, input, job_id=job_id, num_repeats=num_repeats, default_agent=default_agent,
            policy_version=policy_version, priority=priority,
            metadata=dict(metadata) if metadata is not None else None,
        )  # fmt: skip
        answer = await self._call("POST", "/v1/jobs", body, retry=job_id is not None)
        return JobStatus.from_json(answer)

    async def status(self, job_id: str) -> JobStatus:
        return JobStatus.from_json(await self._call("GET", job_path(job_id)))

    async def jobs(self) -> list[JobStatus]:
        """Every job the daemon knows."""
        answer = await self._call("GET", "/v1/jobs")
        if not isinstance(answer, dict) or not isinstance(answer.get("jobs"), list):
            raise ClientError(None, "GET /v1/jobs: no jobs list in the answer")
        return [JobStatus.from_json(job) for job in answer["jobs"]]

    async def cancel(self, job_id: str) -> JobStatus:
        """Cancel a job: its in-flight rollouts are cancelled and write nothing."""
        return JobStatus.from_json(await self._call("DELETE", job_path(job_id)))

    async def wait(self, job_id: str, *, poll_s: float = 1.0) -> JobStatus:
        """The job's status once it is final (polls ``status``)."""
        while True:
            job = await self.status(job_id)
            if job.final:
                return job
            await asyncio.sleep(poll_s)

    async def set_policy_version(self, version: int) -> int:
        """Set the current policy version V (after each weight update); returns V."""
        return _version(await self._call("POST", "/v1/policy", {"version": version}))

    async def policy_version(self) -> int:
        return _version(await self._call("GET", "/v1/policy"))

    def results(
        self, job_id: str, *, after: int = 0, group: bool = False, wait: bool = True
    ) -> Results:
        """Rows (or complete groups) of a job as they become durable, each exactly once.

        Stops at the stream's end (``Results.final_state`` then holds the
        job's final state) or, with ``wait=False``, once caught up.
        """

        def open_stream(position: StreamPosition) -> AsyncGenerator[dict[str, Any], None]:
            position.last_seq = after
            return self._stream(job_id, position, group=group, wait=wait)

        return Results(open_stream)

    # --- plumbing ---

    @property
    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use the client as `async with AsyncClient(...) as client`")
        return self._session

    async def _call(self, method: str, path: str, body: Any = None, *, retry: bool = True) -> Any:
        retries = _Retry(self.retry_deadline_s, self._backoff)
        while True:
            try:
                return await self._call_once(method, path, body)
            except _Transient as exc:
                if not retry:
                    raise ClientError(None, f"{method} {path}: {exc}") from None
                await retries.pause_or_raise(f"{method} {path}: {exc}")

    async def _call_once(self, method: str, path: str, body: Any) -> Any:
        try:
            async with self._http.request(method, self.base_url + path, json=body) as resp:
                raw = await resp.read()
                _raise_for_status(resp, raw)
        except _TRANSIENT_ERRORS as exc:
            raise _Transient(_describe(exc)) from None
        try:
            return jsonx.loads(raw)
        except ValueError:
            raise ClientError(resp.status, f"{method} {path}: answer is not JSON") from None

    async def _stream(
        self, job_id: str, position: StreamPosition, *, group: bool, wait: bool
    ) -> AsyncGenerator[dict[str, Any], None]:
        retries = _Retry(self.retry_deadline_s, self._backoff)
        while True:
            try:
                # aclosing: a consumer that stops early must release the connection now.
                lines = self._stream_once(job_id, position, retries, group, wait)
                async with aclosing(lines):
                    async for item in lines:
                        yield item
                if position.final_state is not None or not wait:
                    return
                error = "the stream ended before the job was final"
            except _Transient as exc:
                error = str(exc)
            await retries.pause_or_raise(f"results of {job_id}: {error}")

    async def _stream_once(
        self, job_id: str, position: StreamPosition, retries: _Retry, group: bool, wait: bool
    ) -> AsyncGenerator[dict[str, Any], None]:
        """One connection's worth of the stream; ``_Transient`` when it was cut."""
        query = results_query(position.last_seq, group, wait)
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
                if resp.status == 404 and position.connected:
                    # Jobs are never forgotten: a job streamed before and
                    # unknown now is a restarted daemon still loading its registry.
                    raise _Transient("404 for a job streamed before: the daemon is starting")
                if resp.status != 200:
                    _raise_for_status(resp, await resp.read())
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
            raise _Transient(_describe(exc)) from None
        if splitter.partial:
            raise _Transient("the stream was cut mid-line")


def _raise_for_status(resp: aiohttp.ClientResponse, raw: bytes) -> None:
    if resp.status < 400:
        return
    message = error_message(raw, resp.reason or "")
    if resp.status in _TRANSIENT_STATUSES:
        raise _Transient(f"{resp.status}: {message}")
    raise ClientError(resp.status, message)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _version(answer: Any) -> int:
    if not isinstance(answer, dict) or not isinstance(answer.get("version"), int):
        raise ClientError(None, f"policy answer without an integer version: {answer!r}")
    version: int = answer["version"]
    return version


# --- the blocking client -----------------------------------------------------------


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
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S,
        stream_idle_timeout_s: float | None = None,
        backoff: BackoffPolicy = DEFAULT_BACKOFF,
    ) -> None:
        self._async = AsyncClient(
            base_url,
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
    ) -> JobStatus:
        """See ``AsyncClient.submit``."""
        return self._run(
            self._async.submit(
                rows, input=input, job_id=job_id, num_repeats=num_repeats,
                default_agent=default_agent, policy_version=policy_version,
                priority=priority, metadata=metadata,
            )
        )  # fmt: skip

    def status(self, job_id: str) -> JobStatus:
        return self._run(self._async.status(job_id))

    def jobs(self) -> list[JobStatus]:
        return self._run(self._async.jobs())

    def cancel(self, job_id: str) -> JobStatus:
        return self._run(self._async.cancel(job_id))

    def wait(self, job_id: str, *, poll_s: float = 1.0) -> JobStatus:
        return self._run(self._async.wait(job_id, poll_s=poll_s))

    def set_policy_version(self, version: int) -> int:
        return self._run(self._async.set_policy_version(version))

    def policy_version(self) -> int:
        return self._run(self._async.policy_version())

    def results(
        self, job_id: str, *, after: int = 0, group: bool = False, wait: bool = True
    ) -> BlockingResults:
        """See ``AsyncClient.results``; a plain iterator."""
        return BlockingResults(
            self, self._async.results(job_id, after=after, group=group, wait=wait)
        )


__all__ = [
    "AsyncClient",
    "BlockingResults",
    "Client",
    "ClientError",
    "JobState",
    "JobStatus",
    "Results",
]
