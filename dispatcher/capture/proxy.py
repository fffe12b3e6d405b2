"""The capture proxy: a reverse proxy that records every model call of a rollout (contracts §6).

Agents call ``{proxy}/ng-rollout/<rollout_id>/v1/chat/completions`` (or
``/v1/responses``, ``/v1/messages``, ``/v1/completions``). The proxy strips the
prefix, forwards method, headers and body unchanged, and relays the answer
chunk by chunk as it arrives, so a streamed answer reaches the agent token by
token. A copy of each chunk is kept; once the answer is done, the exchange is
written to the rollout's capture file in the background (see ``store``).

Ordering that finalization relies on: the write claim is taken while the call
is forwarded and is in place *before* the agent sees any byte of the answer,
so once the agent holds an answer, the dispatcher can already see that a write
for this rollout is outstanding.

Failures: when the upstream cannot be reached or times out before answering,
the agent gets a 502 with an OpenAI-shaped error body; an upstream error status
is relayed as is; a stream cut mid-way is cut for the agent too (the connection
is closed without a final chunk). Every case is recorded with ``error_category``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import structlog
from aiohttp import hdrs, web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from dispatcher.capture.records import DIALECT_BY_PATH, ErrorCategory, Exchange
from dispatcher.capture.routing import (
    DEFAULT_MARGIN,
    GROUP_HEADER,
    RELEASE_PATH,
    RELEASE_PREFIX,
    SESSION_HEADER,
    RoutePolicy,
    Router,
    group_of,
)
from dispatcher.capture.store import BeforeWrite, CaptureStore
from dispatcher.capture.upstream_metrics import METRICS_PATH, counting_encoder, metrics_handler
from dispatcher.delivery.limits import ProxyLimits, RecordBudget
from dispatcher.tasks.keys import MAX_ROLLOUT_ID_LEN, ROLLOUT_ID_PATTERN, is_valid_rollout_id
from dispatcher.urls import redact_url

log = structlog.get_logger(__name__)

ROLLOUT_PREFIX = "/ng-rollout/"
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Recomputed (length, host) or answered by the proxy itself (expect).
_NOT_FORWARDED = _HOP_BY_HOP | {"host", "content-length", "expect"}


_BAD_ID = (
    f"rollout id must match {ROLLOUT_ID_PATTERN} and be at most {MAX_ROLLOUT_ID_LEN} characters"
)


@dataclass(frozen=True)
class _Upstream:
    """Where calls go: the router over the upstreams, and the limit of one whole call."""

    router: Router
    timeout_s: float
    # POSTed {"session_id": id} once when a rollout's session is released (None: not).
    release_url: str | None = None


RELEASE_TIMEOUT_S = 2.0

UPSTREAM_KEY = web.AppKey("capture_upstream", _Upstream)
SESSION_KEY = web.AppKey("capture_session", aiohttp.ClientSession)
STORE_KEY = web.AppKey("capture_store", CaptureStore)
LIMITS_KEY = web.AppKey("capture_limits", ProxyLimits)
UNATTRIBUTED_KEY = web.AppKey("unattributed_calls", list[str])
RELEASES_KEY = web.AppKey("session_releases", set[asyncio.Task[None]])


def build_proxy_app(
    upstream_url: str | list[str],
    capture_dir: Path,
    *,
    upstream_timeout_s: float = 600.0,
    before_write: BeforeWrite | None = None,
    limits: ProxyLimits | None = None,
    route: RoutePolicy | None = None,
    route_margin: int = DEFAULT_MARGIN,
    release_url: str | None = None,
) -> web.Application:
    """The proxy as an aiohttp application; ``upstream_url``: the model servers' root URLs
    (one, or several serving one model); ``route``: how calls pick one (default: ``group``
    with several)."""
    limits = limits or ProxyLimits()
    app = web.Application(
        client_max_size=limits.max_request_bytes,
        middlewares=[_concurrency_bound(limits.max_concurrency)],
    )
    app[LIMITS_KEY] = limits
    urls = [upstream_url] if isinstance(upstream_url, str) else upstream_url
    policy = route or (RoutePolicy.GROUP if len(urls) > 1 else RoutePolicy.ROUND_ROBIN)
    router = Router(urls, policy, route_margin)
    app[UPSTREAM_KEY] = _Upstream(router, upstream_timeout_s, release_url)
    app[STORE_KEY] = CaptureStore(capture_dir, before_write=before_write)
    app[UNATTRIBUTED_KEY] = []
    app[RELEASES_KEY] = set()
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_route("*", ROLLOUT_PREFIX + "{rollout_id}/{tail:.*}", _handle_rollout_call)
    app.router.add_post(RELEASE_PREFIX + "{rollout_id}", _handle_release)
    app.router.add_post(RELEASE_PATH, _handle_releases)
    app.router.add_get(METRICS_PATH, metrics_handler(router))
    app.router.add_route("*", "/{tail:.*}", _handle_passthrough)
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    upstream, store = app[UPSTREAM_KEY], app[STORE_KEY]
    await asyncio.to_thread(store.capture_dir.mkdir, parents=True, exist_ok=True)
    app[SESSION_KEY] = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=upstream.timeout_s),
        # Relay bytes exactly as the upstream sent them; the record decodes its own copy.
        auto_decompress=False,
        # One agent's cookies must never ride along on another agent's call.
        cookie_jar=aiohttp.DummyCookieJar(),
        # Add no header the agent did not send.
        skip_auto_headers=(hdrs.USER_AGENT, hdrs.ACCEPT, hdrs.ACCEPT_ENCODING),
    )
    log.info(
        "capture_proxy_ready",
        upstreams=[redact_url(u.url) for u in upstream.router.upstreams],
        route=str(upstream.router.policy),
        capture_dir=str(store.capture_dir),
    )
    yield
    # Writes of calls that already answered must land before the process exits;
    # releases under way get their short deadline.
    await store.aclose()
    await asyncio.gather(*app[RELEASES_KEY], return_exceptions=True)
    await app[SESSION_KEY].close()


async def _handle_rollout_call(request: web.Request) -> web.StreamResponse:
    rollout_id = request.match_info["rollout_id"]
    if not is_valid_rollout_id(rollout_id):
        return _error_response(400, "invalid_rollout_id", _BAD_ID)
    target = _strip_prefix(request)
    path = "/" + request.match_info["tail"]
    dialect = DIALECT_BY_PATH.get(path)
    if dialect is None or request.method != hdrs.METH_POST:
        return await _forward(request, target, None, rollout_id)
    store = request.app[STORE_KEY]
    recording = _Recording(Exchange(rollout_id, dialect, path), store.claim(rollout_id))
    try:
        return await _forward(request, target, recording, rollout_id)
    except asyncio.CancelledError:
        recording.exchange.fail(ErrorCategory.CLIENT_DISCONNECTED, "request cancelled")
        raise
    except Exception as exc:
        recording.exchange.fail(ErrorCategory.PROXY_ERROR, repr(exc))
        raise
    finally:
        recording.exchange.finish()
        encode = counting_encoder(
            asyncio.get_running_loop(), request.app[UPSTREAM_KEY].router, recording.exchange
        )
        store.commit(rollout_id, recording.claim, encode)


@dataclass(frozen=True)
class _Recording:
    """One recorded call: what is observed, and the claim being taken for its write."""

    exchange: Exchange
    claim: asyncio.Future[Path | None]

    async def claimed(self) -> None:
        """Return once the claim is visible: only then may the agent see the answer.

        The claim is taken while the call is forwarded, so it costs nothing when
        the model takes longer than creating one file.
        """
        # Shielded: a cancelled request must not cancel the claim its write still needs.
        await asyncio.shield(self.claim)


async def _handle_release(request: web.Request) -> web.Response:
    """``POST /ng-release/<rollout_id>``: the dispatcher ended this rollout; its session
    is forgotten (an unknown one, after a restart, is harmless) and, with
    ``--session-release-url``, the upstream is told once."""
    rollout_id = request.match_info["rollout_id"]
    if not is_valid_rollout_id(rollout_id):
        return _error_response(400, "invalid_rollout_id", _BAD_ID)
    session_id = _release(request.app, rollout_id)
    released = session_id is not None
    return web.json_response({"session_id": session_id or rollout_id, "released": released})


async def _handle_releases(request: web.Request) -> web.Response:
    """``POST /ng-release`` with ``{"session_ids": [...]}``: several rollouts ended (the
    dispatcher's sends, a burst of rollouts ending at once in one call); how many
    sessions were known and forgotten."""
    try:
        ids = orjson.loads(await request.read())["session_ids"]
    except (orjson.JSONDecodeError, TypeError, KeyError):
        ids = None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        message = 'expected a JSON object {"session_ids": [rollout ids]}'
        return _error_response(400, "invalid_request", message)
    bad = next((i for i in ids if not is_valid_rollout_id(i)), None)
    if bad is not None:
        return _error_response(400, "invalid_rollout_id", f"session_ids: {bad[:80]!r}: {_BAD_ID}")
    released = sum(_release(request.app, rollout_id) is not None for rollout_id in ids)
    return web.json_response({"released": released, "unknown": len(ids) - released})


def _release(app: web.Application, rollout_id: str) -> str | None:
    """Forget a rollout's session and tell the upstream; the session's id, None if unknown."""
    upstream = app[UPSTREAM_KEY]
    session_id = upstream.router.release(rollout_id)
    # Its time is when the session was forgotten: what the release's promptness is
    # measured by, against the dispatcher's rollout_finished.
    log.info("session_released", rollout_id=rollout_id, known=session_id is not None)
    if session_id is not None and upstream.release_url is not None:
        _tell_upstream(app, upstream.release_url, session_id)
    return session_id


def _tell_upstream(app: web.Application, url: str, session_id: str) -> None:
    """One short POST naming the session, in the background; a failure is logged only."""

    async def tell() -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=RELEASE_TIMEOUT_S)
            body = {"session_id": session_id}
            async with app[SESSION_KEY].post(url, json=body, timeout=timeout) as answer:
                if answer.status >= 400:
                    log.warning("session_release_refused", session=session_id, status=answer.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("session_release_failed", session=session_id, error=repr(exc))

    task = asyncio.get_running_loop().create_task(tell())
    app[RELEASES_KEY].add(task)
    task.add_done_callback(app[RELEASES_KEY].discard)


async def _handle_passthrough(request: web.Request) -> web.StreamResponse:
    if request.path in DIALECT_BY_PATH and not request.app[UNATTRIBUTED_KEY]:
        # Said once: a model call without /ng-rollout/<id>/ names no rollout, so it is
        # forwarded but cannot be captured. NeMo Gym's model servers call their upstream
        # like this; with them, Gym's own capture directory is the one to read.
        request.app[UNATTRIBUTED_KEY].append(request.path)
        log.warning("model_call_not_captured", path=request.path, reason="no /ng-rollout/<id>/")
    return await _forward(request, request.rel_url.raw_path_qs, None, None)


def _strip_prefix(request: web.Request) -> str:
    # Forward the raw (still percent-encoded) path so the upstream sees what the agent sent.
    _, _, _, tail = request.rel_url.raw_path.split("/", 3)
    query = request.rel_url.raw_query_string
    return f"/{tail}?{query}" if query else f"/{tail}"


async def _forward(
    request: web.Request, target: str, recording: _Recording | None, rollout_id: str | None
) -> web.StreamResponse:
    router = request.app[UPSTREAM_KEY].router
    exchange = recording.exchange if recording is not None else None
    body = await request.read()
    if exchange is not None:
        exchange.request_body = body
    headers = _forwarded_headers(request.headers)
    if rollout_id is not None:
        headers[SESSION_HEADER] = rollout_id
        headers[GROUP_HEADER] = group_of(rollout_id)
    index = router.pick(rollout_id) if rollout_id is not None else router.any()
    # A call that cannot connect goes to the next upstream (the pin moves with it):
    # each is tried once, and the last failure is the call's.
    failure: tuple[ErrorCategory, Exception] | None = None
    for _ in range(len(router.upstreams)):
        if exchange is not None:
            exchange.upstream = redact_url(router.upstreams[index].url)
        router.started(index, rollout_id)
        try:
            return await _send(request, target, headers, body, recording, index)
        except aiohttp.ClientConnectorError as exc:
            failure = (ErrorCategory.UPSTREAM_UNREACHABLE, exc)
        except TimeoutError as exc:
            failure = (ErrorCategory.UPSTREAM_TIMEOUT, exc)
            break
        except aiohttp.ClientError as exc:
            failure = (ErrorCategory.UPSTREAM_ERROR, exc)
            break
        finally:
            router.ended(index, rollout_id)
        index = router.unreachable(rollout_id, index) if rollout_id else router.after(index)
    assert failure is not None
    answer = _no_answer(exchange, *failure)
    if recording is not None:
        await recording.claimed()
    return answer


async def _send(
    request: web.Request,
    target: str,
    headers: CIMultiDict[str],
    body: bytes,
    recording: _Recording | None,
    index: int,
) -> web.StreamResponse:
    """One try at one upstream; the relayed answer, or the client's error to fail over on."""
    app = request.app
    base_url = app[UPSTREAM_KEY].router.upstreams[index].url
    answer = await app[SESSION_KEY].request(
        request.method,
        URL(base_url + target, encoded=True),
        headers=headers,
        data=body or None,
        allow_redirects=False,
    )
    async with answer:
        return await _Relay(request, answer, recording).run()


def _no_answer(exchange: Exchange | None, category: ErrorCategory, exc: Exception) -> web.Response:
    detail = f"{type(exc).__name__}: {exc}"
    if exchange is not None:
        exchange.status_code = 502
        exchange.fail(category, detail)
    return _error_response(502, category, f"upstream model server: {detail}")


class _Relay:
    """Copies one upstream answer to the agent as it arrives, keeping a copy for the record."""

    def __init__(
        self, request: web.Request, answer: aiohttp.ClientResponse, recording: _Recording | None
    ) -> None:
        self.request = request
        self.answer = answer
        self.recording = recording
        self.exchange = recording.exchange if recording is not None else None
        self.client_alive = True
        self.budget = RecordBudget(
            request.app[LIMITS_KEY].max_record_bytes,
            answer.headers.get(hdrs.CONTENT_ENCODING, ""),
        )
        self.response = web.StreamResponse(status=answer.status, reason=answer.reason)
        self.response.headers.extend(_relayed_headers(answer.headers))

    async def run(self) -> web.StreamResponse:
        if self.recording is not None:
            headers = self.answer.headers
            self.recording.exchange.on_headers(
                self.answer.status,
                headers.get(hdrs.CONTENT_TYPE, ""),
                headers.get(hdrs.CONTENT_ENCODING, ""),
            )
            await self.recording.claimed()
        await self.response.prepare(self.request)
        body_complete = await self._pump()
        if not self.client_alive:
            return self.response
        if body_complete:
            await self._send_eof()
        elif self.request.transport is not None:
            # No terminating chunk: the agent must see the truncation the proxy saw.
            self.request.transport.close()
        return self.response

    async def _pump(self) -> bool:
        """Relay until the upstream body ends (True) or breaks, or a streaming client leaves."""
        while True:
            try:
                chunk = await self.answer.content.readany()
            except TimeoutError as exc:
                self._fail(ErrorCategory.UPSTREAM_TIMEOUT, exc)
                return False
            except aiohttp.ClientError as exc:
                self._fail(ErrorCategory.UPSTREAM_DISCONNECTED, exc)
                return False
            if not chunk:
                return True
            if self.exchange is not None:
                _keep_within_budget(self.exchange, self.budget, chunk)
            if self.client_alive:
                await self._send(chunk)
            if not self.client_alive and (self.exchange is None or self.exchange.streamed):
                # Closing the upstream lets the model server stop generating for nobody.
                return False

    async def _send(self, chunk: bytes) -> None:
        try:
            await self.response.write(chunk)
        except ConnectionResetError as exc:
            self.client_alive = False
            self._fail(ErrorCategory.CLIENT_DISCONNECTED, exc)

    async def _send_eof(self) -> None:
        try:
            await self.response.write_eof()
        except ConnectionResetError as exc:
            self.client_alive = False
            self._fail(ErrorCategory.CLIENT_DISCONNECTED, exc)

    def _fail(self, category: ErrorCategory, exc: Exception) -> None:
        if self.exchange is not None:
            self.exchange.fail(category, f"{type(exc).__name__}: {exc}")


# --- bounds (issue 12): concurrency, and the size of what is kept for the record ------------


def _concurrency_bound(limit: int) -> Any:
    """Middleware: at most ``limit`` calls in the proxy at once; the rest wait, unread.
    Releases and the metrics pass: they are the proxy's own, answered at once (a release
    waiting for a model call to end kept the session, and its upstream's, that long)."""
    slots = asyncio.Semaphore(limit)

    @web.middleware
    async def bounded(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path in (RELEASE_PATH, METRICS_PATH) or request.path.startswith(RELEASE_PREFIX):
            answer: web.StreamResponse = await handler(request)
            return answer
        async with slots:
            response: web.StreamResponse = await handler(request)
            return response

    return bounded


def _keep_within_budget(exchange: Exchange, budget: RecordBudget, chunk: bytes) -> None:
    """Keep a copy of ``chunk`` for the record unless the answer outgrew the budget.

    The agent still gets every byte; only the record loses the answer, and says so.
    """
    if budget.admit(chunk):
        exchange.on_chunk(chunk)
        return
    exchange.chunks.clear()
    exchange.fail(ErrorCategory.PROXY_ERROR, "answer larger than --max-record-bytes: not kept")


def _forwarded_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    dropped = _NOT_FORWARDED | _connection_tokens(headers)
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in dropped)


def _relayed_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    dropped = _HOP_BY_HOP | _connection_tokens(headers)
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in dropped)


def _connection_tokens(headers: CIMultiDictProxy[str]) -> frozenset[str]:
    # Headers named in Connection are hop-by-hop too (RFC 9110 §7.6.1).
    tokens = ",".join(headers.getall(hdrs.CONNECTION, ()))
    return frozenset(t.strip().lower() for t in tokens.split(",") if t.strip())


def _error_response(status: int, kind: str, message: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")
