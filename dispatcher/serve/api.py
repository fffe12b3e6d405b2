"""The jobs API (contracts §12) as aiohttp routes on the daemon's one listener.

    POST   /v1/jobs                      submit (201 new, 200 the same again, 400, 409)
    GET    /v1/jobs                      every job's status (?state=S[,S...] filters)
    GET    /v1/jobs/<id>                 one job's status (404 unknown)
    DELETE /v1/jobs/<id>                 cancel: its rollouts at agents write nothing
    GET    /v1/jobs/<id>/results         NDJSON rows (?after=SEQ&group=true&wait=true
                                         &filtered=true; &failures=true&failures_after=N:
                                         final failure lines too)
    POST   /v1/jobs/<id>/admit           {"admit": N}: a job with admit may start N in all
    GET    /v1/jobs/<id>/admit           the same as a WebSocket, a message each (admits.py)
    POST   /v1/policy                    {"version": V}: the trainer's policy version
    GET    /v1/policy                    the current version
    POST   /v1/admission                 {"paused": true, "ttl_s"?, "reason"?} or {"paused": false}
    GET    /v1/admission                 the pause (?wait_idle=true&timeout_s=S: once idle)

Every error is a JSON object with one line under ``error``: an unexpected
exception in a handler too (a 500, or a 507 when the disk refused a write),
logged once at error with its traceback. ``/healthz`` answers 503 with the
reason while the state directory cannot be written.

Bounded whatever clients send (``settings/serve.py``): a request body is
counted under ``--max-body-bytes-in-flight`` as it arrives and read whole
within ``--body-timeout-s`` before its handler runs (``bodies.py``); a
results stream or an admit channel takes one of ``--max-streams`` slots (503
with ``Retry-After`` when none is free) and is sent under backpressure, cut when
its client takes nothing (``sending.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from dispatcher.lifecycle import JobState
from dispatcher.serve.admits import admit_channel, upgrade_problem
from dispatcher.serve.bodies import BadBody, BodyTooBig, NoRoom, read_body
from dispatcher.serve.faults import is_disk_fault, log_crash, one_line
from dispatcher.serve.jobs import BadJob, Conflict, Service
from dispatcher.serve.results import stream
from dispatcher.serve.sending import Sender, StreamIdle, StreamResponse
from dispatcher.serve.served import ServedJob
from dispatcher.serve.spec import AdmissionChange, AdmitChange, PolicyChange, TooBig
from dispatcher.serve.submission import FoundJob
from dispatcher.telemetry.server import Routes, json_response

log = structlog.get_logger("dispatcher.serve")

NDJSON = "application/x-ndjson"
# Where ``bounded_bodies`` leaves the body it read (aiohttp wants typed keys where it
# has them, and warns at every string key).
BODY: Any = (
    web.RequestKey("dispatcher.body", bytes) if hasattr(web, "RequestKey") else "dispatcher.body"
)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# What a client refused for the stream limit is told to wait before it retries.
RETRY_AFTER_S = 1
# GET /v1/admission?wait_idle=true: how long it waits without timeout_s, and at most.
DEFAULT_WAIT_IDLE_S = 60.0
MAX_WAIT_IDLE_S = 3600.0


def routes(service: Service) -> Routes:
    """The routes of the jobs API, bound to ``service``."""
    handlers = _Handlers(service)
    middlewares = _Middlewares(service)

    def add(app: web.Application) -> None:
        app.middlewares.extend(
            (
                middlewares.json_errors,
                middlewares.state_dir_health,
                middlewares.until_resumed,
                middlewares.bounded_bodies,
            )
        )
        app.router.add_post("/v1/jobs", handlers.submit)
        app.router.add_get("/v1/jobs", handlers.list_jobs)
        app.router.add_get("/v1/jobs/{job_id}", handlers.get_job)
        app.router.add_delete("/v1/jobs/{job_id}", handlers.cancel)
        app.router.add_get("/v1/jobs/{job_id}/results", handlers.results)
        app.router.add_post("/v1/jobs/{job_id}/admit", handlers.admit)
        app.router.add_get("/v1/jobs/{job_id}/admit", handlers.admit_channel)
        app.router.add_post("/v1/policy", handlers.set_policy)
        app.router.add_get("/v1/policy", handlers.get_policy)
        app.router.add_post("/v1/admission", handlers.set_admission)
        app.router.add_get("/v1/admission", handlers.get_admission)

    return add


class _Middlewares:
    """What every request goes through, outermost first."""

    def __init__(self, service: Service) -> None:
        self.service = service

    @web.middleware
    async def json_errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            # aiohttp's own refusals (404, 405, 413) are text: say them in JSON.
            if exc.status < 400 or not request.path.startswith("/v1/"):
                raise
            return error(exc.status, exc.reason)
        except ConnectionError:
            # The client went away (mid-body, say): nobody to answer.
            log.info("client_gone", method=request.method, path=request.path)
            raise
        except Exception as exc:
            self.service.disk_fault(exc)
            status = 507 if is_disk_fault(exc) else 500
            log_crash("api_error", exc, method=request.method, path=request.path, status=status)
            return error(status, one_line(exc))

    @web.middleware
    async def state_dir_health(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # A daemon whose state directory cannot be written is not healthy: every
        # job it runs would fail. The fault clears once a write works again.
        if request.path == "/healthz":
            fault = await self.service.health.check()
            if fault is not None:
                body = {"status": "state_dir_unwritable", "error": fault}
                return json_response(body, status=503)
        return await handler(request)

    @web.middleware
    async def until_resumed(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # The listener is up before the registry is read: until every job is
        # known again, an answer about jobs could be a wrong 404 or 409.
        if request.path.startswith("/v1/") and not self.service.resumed:
            return error(503, "starting: the job registry is being read; retry")
        return await handler(request)

    @web.middleware
    async def bounded_bodies(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # The body is read whole, its bytes counted as they arrive, before the
        # handler runs, and held until it has answered: bodies in hand stay
        # under --max-body-bytes-in-flight, however many clients send.
        if not request.body_exists:
            return await handler(request)
        limits = self.service.limits
        size = request.content_length
        if size is not None and size > limits.max_body_bytes:
            message = f"body: {size} bytes, more than --max-body-bytes {limits.max_body_bytes}"
            return closing(error(413, message))
        budget = self.service.bodies
        async with budget.reading() as reading:
            try:
                async with asyncio.timeout(limits.body_timeout_s):
                    body = await read_body(request.content, reading, budget, limits.max_body_bytes)
            except TimeoutError:
                return closing(error(408, _late_body(limits.body_timeout_s, reading.held, size)))
            except BodyTooBig as exc:
                return closing(error(413, str(exc)))
            except NoRoom as exc:
                return closing(error(503, str(exc), {"Retry-After": str(RETRY_AFTER_S)}))
            request[BODY] = body
            return await handler(request)


def _late_body(timeout_s: float, received: int, size: int | None) -> str:
    expected = f"{size}" if size is not None else "?"
    return (
        f"body: not received whole within --body-timeout-s {timeout_s:g} "
        f"({received} of {expected} bytes)"
    )


def closing(response: web.Response) -> web.Response:
    """``response``, then the connection closed: the rest of its body was not read."""
    response.force_close()
    return response


def body_of(request: web.Request) -> bytes:
    """The request's body, as ``bounded_bodies`` read it (none: empty)."""
    body: bytes = request.get(BODY, b"")
    return body


def error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    response = json_response({"error": message}, status=status)
    response.headers.update(headers or {})
    return response


class _Handlers:
    def __init__(self, service: Service) -> None:
        self.service = service

    async def submit(self, request: web.Request) -> web.Response:
        try:
            code, status = await self.service.submit(body_of(request))
        except TooBig as exc:
            return error(413, str(exc))
        except BadJob as exc:
            return error(400, str(exc))
        except Conflict as exc:
            return error(409, str(exc))
        return json_response(status, status=code)

    async def list_jobs(self, request: web.Request) -> web.Response:
        try:
            states = _states_param(request)
        except ValueError as exc:
            return error(400, str(exc))
        jobs = await self.service.statuses()
        if states is not None:
            jobs = [job for job in jobs if job["state"] in states]
        return json_response({"jobs": jobs})

    async def get_job(self, request: web.Request) -> web.Response:
        job = await self.service.find(request.match_info["job_id"])
        if job is None:
            return _unknown(request)
        return json_response(await self.service.status_of(job))

    async def cancel(self, request: web.Request) -> web.Response:
        status = await self.service.cancel(request.match_info["job_id"])
        if status is None:
            return _unknown(request)
        return json_response(status)

    async def admit(self, request: web.Request) -> web.Response:
        """Raise a job's ``admit`` (``window.py``); a final job's is kept as it was."""
        try:
            change = AdmitChange.parse(body_of(request))
        except BadBody as exc:
            return error(400, str(exc))
        job = await self.service.find(request.match_info["job_id"])
        if job is None:
            return _unknown(request)
        admitted = job.window.admit(change.admit) if isinstance(job, ServedJob) else None
        return json_response({"job_id": job.job_id, "admit": admitted})

    async def admit_channel(self, request: web.Request) -> web.StreamResponse:
        """A job's admit channel (``admits.py``): a WebSocket, a stream's slot held."""
        problem = upgrade_problem(request)
        if problem is not None:
            return error(400, problem)
        job = await self.service.find(request.match_info["job_id"])
        if job is None:
            return _unknown(request)
        slots = self.service.streams
        if not slots.take():
            message = f"--max-streams: {slots.limit} streams are open; retry"
            return error(503, message, {"Retry-After": str(RETRY_AFTER_S)})
        try:
            return await admit_channel(request, job, self.service.limits.stream_idle_timeout_s)
        finally:
            slots.give_back()

    async def results(self, request: web.Request) -> web.StreamResponse:
        job = await self.service.find(request.match_info["job_id"])
        if job is None:
            return _unknown(request)
        try:
            after = _int_param(request, "after", 0)
            group, wait, filtered = (_bool_param(request, n) for n in ("group", "wait", "filtered"))
            failures_after = _failures_param(request, group=group)
        except ValueError as exc:
            return error(400, str(exc))
        slots = self.service.streams
        if not slots.take():
            message = f"--max-streams: {slots.limit} results streams are open; retry"
            return error(503, message, {"Retry-After": str(RETRY_AFTER_S)})
        try:
            return await self._stream(request, job, after, group, wait, filtered, failures_after)
        finally:
            slots.give_back()

    async def _stream(
        self,
        request: web.Request,
        job: FoundJob,
        after: int,
        group: bool,
        wait: bool,
        filtered: bool,
        failures_after: int | None,
    ) -> web.StreamResponse:
        limits = self.service.limits
        source = await job.source()
        response = StreamResponse(headers={"Content-Type": NDJSON})
        await response.prepare(request)
        sender = Sender(request, response, buffer_bytes=limits.stream_buffer_bytes,
                        idle_s=limits.stream_idle_timeout_s)  # fmt: skip
        chunk_bytes = limits.stream_buffer_bytes
        lines = stream(source, after, group, wait, filtered, chunk_bytes=chunk_bytes,
                       gone=sender.gone, failures_after=failures_after)  # fmt: skip
        try:
            # Closed here, whatever ends the stream: left to the loop's finalizer, a
            # stream whose client went away held its files until a GC pass found it.
            async with contextlib.aclosing(lines):
                async for chunk in lines:
                    if chunk.last:
                        await sender.write_eof(chunk.data)
                    else:
                        await sender.write(chunk.data)
                    self.service.delivered(chunk.born, group)
        except StreamIdle as exc:
            log.info("results_stream_cut", job_id=job.job_id, reason=str(exc))
        except ConnectionError:
            log.info("results_stream_gone", job_id=job.job_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The status line is sent: the stream is cut without its end line,
            # which a client takes as a cut connection and resumes with after=.
            log.error("results_stream_failed", job_id=job.job_id, exc_info=exc)
            sender.abort()
        return response

    async def set_policy(self, request: web.Request) -> web.Response:
        try:
            change = PolicyChange.parse(body_of(request))
        except BadBody as exc:
            return error(400, str(exc))
        try:
            await self.service.set_policy(change.version, force=change.force)
        except Conflict as exc:
            return error(409, str(exc))
        return json_response({"version": change.version})

    async def get_policy(self, request: web.Request) -> web.Response:
        return json_response({"version": self.service.daemon.policy_version()})

    async def set_admission(self, request: web.Request) -> web.Response:
        try:
            change = AdmissionChange.parse(body_of(request))
        except BadBody as exc:
            return error(400, str(exc))
        if change.paused:
            await self.service.pause_admission(change.ttl_s, change.reason)
        else:
            await self.service.resume_admission("request")
        return json_response(self.service.admission())

    async def get_admission(self, request: web.Request) -> web.Response:
        try:
            wait_idle = _bool_param(request, "wait_idle")
            timeout_s = _seconds_param(request, "timeout_s", DEFAULT_WAIT_IDLE_S)
        except ValueError as exc:
            return error(400, str(exc))
        if wait_idle:
            await self.service.wait_idle(timeout_s)
        return json_response(self.service.admission())


def _unknown(request: web.Request) -> web.Response:
    return error(404, f"job_id: no job {request.match_info['job_id']!r}")


def _int_param(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    if not raw.isdigit():
        raise ValueError(f"{name}: must be an integer >= 0, got {raw!r}")
    return int(raw)


def _failures_param(request: web.Request, *, group: bool) -> int | None:
    """``failures_after`` when the stream asked for failure lines (``failures=true``)."""
    if not _bool_param(request, "failures"):
        if "failures_after" in request.query:
            raise ValueError("failures_after: only with failures=true")
        return None
    if group:
        raise ValueError("failures: only on a stream of rows (group=false)")
    return _int_param(request, "failures_after", 0)


def _bool_param(request: web.Request, name: str) -> bool:
    raw = request.query.get(name, "false").lower()
    if raw in ("true", "1", "yes"):
        return True
    if raw in ("false", "0", "no"):
        return False
    raise ValueError(f"{name}: must be true or false, got {raw!r}")


def _seconds_param(request: web.Request, name: str, default: float) -> float:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= MAX_WAIT_IDLE_S:
        raise ValueError(f"{name}: must be a number of seconds in [0, {MAX_WAIT_IDLE_S:g}]")
    return value


def _states_param(request: web.Request) -> set[str] | None:
    """``?state=running,paced``: the states asked for; None when not given."""
    raw = request.query.get("state")
    if raw is None:
        return None
    states = {part.strip() for part in raw.split(",")}
    known = {state.value for state in JobState}
    unknown = sorted(states - known)
    if unknown:
        names = ", ".join(sorted(known))
        raise ValueError(f"state: {unknown[0]!r} is not a job state (one of {names})")
    return states
