"""The daemon's own HTTP endpoints: /metrics, /healthz and /status (and the jobs API's routes).

They run on the daemon's event loop rather than in a thread: a scrape then
sees a consistent state without locks, and a scrape that times out is itself
a sign the loop is blocked.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4

from dispatcher import jsonx
from dispatcher.telemetry.metrics import Metrics

# Handlers finish in microseconds; the bound only covers a scrape that is
# still being sent when the daemon stops.
SHUTDOWN_TIMEOUT_S = 2.0

StatusFn = Callable[[], Mapping[str, Any]]
HealthFn = Callable[[], bool]
# Adds more routes to the application (service mode's jobs API).
Routes = Callable[[web.Application], None]


def build_app(
    *,
    metrics: Metrics,
    status: StatusFn,
    healthy: HealthFn,
    routes: Routes | None = None,
    max_body_bytes: int | None = None,
) -> web.Application:
    """The aiohttp application behind `start_http_server` (also usable with a test client)."""

    async def handle_metrics(request: web.Request) -> web.Response:
        response = web.Response(body=metrics.render())
        # Set whole: aiohttp's content_type argument refuses the version parameter.
        response.headers["Content-Type"] = CONTENT_TYPE_PLAIN_0_0_4
        return response

    async def handle_healthz(request: web.Request) -> web.Response:
        if healthy():
            return json_response({"status": "ok"})
        return json_response({"status": "shutting_down"}, status=503)

    async def handle_status(request: web.Request) -> web.Response:
        return json_response(status())

    app = web.Application(client_max_size=max_body_bytes or 1024**2)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/healthz", handle_healthz)
    app.router.add_get("/status", handle_status)
    if routes is not None:
        routes(app)
    return app


def json_response(body: Mapping[str, Any], *, status: int = 200) -> web.Response:
    # NaN and inf become null, datetimes ISO strings; non-str keys are allowed
    # so a mapping keyed by quantile floats still serializes.
    try:
        payload = orjson.dumps(body, default=str, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        # An integer beyond 64 bits (a job's metadata, say): written exactly.
        payload = jsonx.dumps(body)
    return web.Response(body=payload, status=status, content_type="application/json")


async def start_http_server(
    host: str,
    port: int,
    *,
    metrics: Metrics,
    status: StatusFn,
    healthy: HealthFn,
    routes: Routes | None = None,
    max_body_bytes: int | None = None,
    ssl_context: ssl.SSLContext | None = None,
    header_timeout_s: float | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve the endpoints on the running loop; returns the runner and the bound port.

    Port 0 binds a free port. Stop with `await runner.cleanup()`. A busy port
    raises OSError before anything is served. With ``header_timeout_s``, a
    connection that has not sent a whole request's headers that long after it
    connected (or after its last answer) is closed: aiohttp's keep-alive
    timer runs from the connection's start and closes a connection whose
    handler waits for a request, which is what a client that trickles its
    headers (slowloris) leaves it doing.
    """
    app = build_app(
        metrics=metrics,
        status=status,
        healthy=healthy,
        routes=routes,
        max_body_bytes=max_body_bytes,
    )
    # No access log: Prometheus scraping every few seconds would drown the log.
    options: dict[str, Any] = {}
    if header_timeout_s is not None:
        options["keepalive_timeout"] = header_timeout_s
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S, **options)
    await runner.setup()
    try:
        site = (
            _TlsSite(runner, host, port, ssl_context, header_timeout_s)
            if ssl_context is not None and header_timeout_s is not None
            else web.TCPSite(runner, host, port, ssl_context=ssl_context)
        )
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_port: int = runner.addresses[0][1]
    return runner, bound_port


class _TlsSite(web.TCPSite):
    """A TLS site whose handshake is bounded by the header timeout too.

    aiohttp's keep-alive timer starts once the handshake is done, and asyncio
    bounds a server's handshake by 60 s of its own: a client that connects and
    says nothing held its connection that long. (``TCPSite.start`` with the
    one argument it does not pass.)
    """

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext,
        handshake_timeout_s: float,
    ) -> None:
        super().__init__(runner, host, port, ssl_context=ssl_context)
        self._handshake_timeout_s = handshake_timeout_s

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            server,
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            ssl_handshake_timeout=self._handshake_timeout_s,
        )
        self._bound_port = self._server.sockets[0].getsockname()[1]
