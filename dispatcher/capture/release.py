"""Telling the capture proxy that a rollout ended, so it forgets the rollout's session.

The dispatcher alone knows when a rollout's attempt ends (its row durable, a
failure, a cancel). ``SessionReleaser.release`` is called then, from the one
place outcomes are counted, and costs the caller an append: a background task
sends what is waiting as it comes, up to ``MAX_AT_ONCE`` sends at once (a slow
answer holds up no release but its own), within a second (``RELEASE_TIMEOUT_S``
bounds each). One id goes as ``POST {proxy}/ng-release/<id>``; several that
came together (a group's rollouts end at once, 64 at the first wave) go in one
``POST {proxy}/ng-release`` naming them all: a loaded proxy took seconds to get
through a burst of one request each, behind the model calls that came with it.
A proxy without that route (404, 405: an older one) is sent each id on its own
from then on.
A release that fails is logged once per kind of failure and not retried: a
proxy that restarted knows no session, and one that is gone has none to forget.
"""

from __future__ import annotations

import asyncio
from collections import deque

import aiohttp
import structlog

from dispatcher.aio import cancel_and_wait
from dispatcher.capture.routing import RELEASE_PATH
from dispatcher.urls import redact_url

log = structlog.get_logger(__name__)

RELEASE_TIMEOUT_S = 1.0
# Sends under way at once; more wait for one of them to end.
MAX_AT_ONCE = 64
# Ids in one send, at most.
MAX_PER_SEND = 1024
# Releases waiting, at most: past it the oldest are dropped (the proxy bounds its
# sessions itself), so memory stays bounded whatever happens to the proxy.
MAX_WAITING = 100_000


class SessionReleaser:
    """Sends the ids handed to ``release`` to the proxy at ``proxy_url`` (see the module)."""

    def __init__(self, proxy_url: str) -> None:
        self._url = proxy_url.rstrip("/") + RELEASE_PATH
        self._waiting: deque[str] = deque(maxlen=MAX_WAITING)
        # False once the proxy said it has no route for several ids at once.
        self._several = True
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
            sends = [self._take() for _ in range(MAX_AT_ONCE) if self._waiting]
            await asyncio.gather(*self._sending, *(self._send(ids) for ids in sends))
        if self._session is not None:
            await self._session.close()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting:
                await self._slots.acquire()
                # What came while a slot was awaited goes in this send too.
                task = asyncio.get_running_loop().create_task(self._send_one(self._take()))
                self._sending.add(task)
                task.add_done_callback(self._sending.discard)

    def _take(self) -> list[str]:
        return [self._waiting.popleft() for _ in range(min(MAX_PER_SEND, len(self._waiting)))]

    async def _send_one(self, ids: list[str]) -> None:
        try:
            await self._send(ids)
        finally:
            self._slots.release()

    async def _send(self, ids: list[str]) -> None:
        if len(ids) > 1 and self._several:
            status = await self._post(self._url, {"session_ids": ids}, len(ids))
            if status not in (404, 405):
                return
            # A proxy without the route for several (an older one): each on its own,
            # from now on.
            self._several = False
        await asyncio.gather(*(self._post(f"{self._url}/{i}", None, 1) for i in ids))

    async def _post(self, url: str, body: dict[str, list[str]] | None, count: int) -> int | None:
        """One POST releasing ``count`` sessions, counted; its status (None: no answer)."""
        assert self._session is not None
        status: int | None = None
        try:
            async with self._session.post(url, json=body) as answer:
                await answer.read()
                status = answer.status
                ok = status < 400
                problem = f"HTTP {status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            ok, problem = False, type(exc).__name__
        if body is not None and status in (404, 405):
            return status  # not counted: sent again one by one
        if ok:
            self.sent += count
        else:
            self.failed += count
            if problem not in self._failures_seen:
                self._failures_seen.add(problem)
                url = redact_url(self._url)
                log.warning("session_release_failed", proxy=url, error=problem)
        return status
