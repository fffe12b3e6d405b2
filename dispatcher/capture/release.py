"""Telling the capture proxy that a rollout ended, so it forgets the rollout's session.

The dispatcher alone knows when a rollout's attempt ends (its row durable, a
failure, a cancel). ``SessionReleaser.release`` is called then, from the one
place outcomes are counted, and costs the caller an append: a background task
sends ``POST {proxy}/ng-release/<id>`` for each as it comes, up to ``MAX_AT_ONCE``
at once (a slow answer holds up no release but its own), within a second
(``RELEASE_TIMEOUT_S`` bounds each). A release that fails is logged once per
kind of failure and not retried: a proxy that restarted knows no session, and
one that is gone has none to forget.
"""

from __future__ import annotations

import asyncio
from collections import deque

import aiohttp
import structlog

from dispatcher.aio import cancel_and_wait
from dispatcher.capture.routing import RELEASE_PREFIX
from dispatcher.urls import redact_url

log = structlog.get_logger(__name__)

RELEASE_TIMEOUT_S = 1.0
# Releases under way at once; more wait for one of them to end.
MAX_AT_ONCE = 64
# Releases waiting, at most: past it the oldest are dropped (the proxy bounds its
# sessions itself), so memory stays bounded whatever happens to the proxy.
MAX_WAITING = 100_000


class SessionReleaser:
    """Sends the ids handed to ``release`` to the proxy at ``proxy_url`` (see the module)."""

    def __init__(self, proxy_url: str) -> None:
        self._url = proxy_url.rstrip("/") + RELEASE_PREFIX
        self._waiting: deque[str] = deque(maxlen=MAX_WAITING)
        self._wake = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._slots = asyncio.Semaphore(MAX_AT_ONCE)
        self._sending: set[asyncio.Task[None]] = set()
        self._failures_seen: set[str] = set()
        self.sent = 0
        self.failed = 0

    def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=RELEASE_TIMEOUT_S)
        self._session = aiohttp.ClientSession(timeout=timeout)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="session-release")

    def release(self, session_id: str) -> None:
        self._waiting.append(session_id)
        self._wake.set()

    async def close(self) -> None:
        """Finish the releases under way and send what is waiting (``MAX_AT_ONCE`` at
        most), then stop."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            ids = [self._waiting.popleft() for _ in range(min(MAX_AT_ONCE, len(self._waiting)))]
            await asyncio.gather(*self._sending, *(self._send(i) for i in ids))
        if self._session is not None:
            await self._session.close()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting:
                await self._slots.acquire()
                task = asyncio.get_running_loop().create_task(
                    self._send_one(self._waiting.popleft())
                )
                self._sending.add(task)
                task.add_done_callback(self._sending.discard)

    async def _send_one(self, session_id: str) -> None:
        try:
            await self._send(session_id)
        finally:
            self._slots.release()

    async def _send(self, session_id: str) -> None:
        assert self._session is not None
        try:
            async with self._session.post(self._url + session_id) as answer:
                await answer.read()
                ok = answer.status < 400
                problem = f"HTTP {answer.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            ok, problem = False, type(exc).__name__
        self.sent += ok
        if not ok:
            self.failed += 1
            if problem not in self._failures_seen:
                self._failures_seen.add(problem)
                url = redact_url(self._url)
                log.warning("session_release_failed", proxy=url, error=problem)
