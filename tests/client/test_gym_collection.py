"""The drop-in's admissions (``client/gym_collection.py``): on the job's admit channel,
and by request where a daemon has no channel or lost it. The peer is a stand-in for
the daemon's two admit routes on this loop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import WSMsgType, web

from dispatcher.client import AsyncClient
from dispatcher.client.gym_collection import _Admitter
from tests.helpers import serve, wait_until

pytestmark = pytest.mark.timeout(60)


class AdmitPeer:
    """Records each admission by the way it came; ``channels``: whether it has the
    channel, ``close_after``: messages a channel takes before the peer closes it."""

    def __init__(self, channels: bool, close_after: int | None = None) -> None:
        self.channels = channels
        self.close_after = close_after
        self.got: list[tuple[str, int]] = []

    async def post(self, request: web.Request) -> web.Response:
        count = orjson.loads(await request.read())["admit"]
        self.got.append(("post", count))
        return web.json_response({"job_id": request.match_info["job_id"], "admit": count})

    async def channel(self, request: web.Request) -> web.StreamResponse:
        if not self.channels:
            raise web.HTTPMethodNotAllowed("GET", ["POST"])  # an older daemon
        socket = web.WebSocketResponse()
        await socket.prepare(request)
        async for message in socket:
            assert message.type is WSMsgType.TEXT
            self.got.append(("channel", orjson.loads(message.data)["admit"]))
            if len(self.got) == self.close_after:
                await socket.close()  # as a daemon that restarts
        return socket


@pytest.fixture
async def peer_at() -> AsyncIterator[Any]:
    runners: list[web.AppRunner] = []

    async def start(peer: AdmitPeer) -> str:
        app = web.Application()
        app.router.add_post("/v1/jobs/{job_id}/admit", peer.post)
        app.router.add_get("/v1/jobs/{job_id}/admit", peer.channel)
        runner, url = await serve(app)
        runners.append(runner)
        return url

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_admissions_go_on_the_channel_each_new_total_once(peer_at: Any) -> None:
    peer = AdmitPeer(channels=True)
    async with AsyncClient(await peer_at(peer)) as client:
        admitter = _Admitter(client)
        for count in (2, 3, 3, 4):
            await admitter.send("j", count)
        await wait_until(lambda: len(peer.got) == 3)
        await admitter.aclose()
    assert peer.got == [("channel", 2), ("channel", 3), ("channel", 4)]


async def test_a_daemon_without_channels_is_sent_requests(peer_at: Any) -> None:
    peer = AdmitPeer(channels=False)
    async with AsyncClient(await peer_at(peer)) as client:
        admitter = _Admitter(client)
        await admitter.send("j", 2)
        await admitter.send("j", 3)
        await admitter.aclose()
    assert peer.got == [("post", 2), ("post", 3)]


async def test_a_lost_channel_goes_on_by_request_and_a_new_job_opens_its_own(
    peer_at: Any,
) -> None:
    peer = AdmitPeer(channels=True, close_after=1)
    async with AsyncClient(await peer_at(peer)) as client:
        admitter = _Admitter(client)
        await admitter.send("j", 2)
        await wait_until(lambda: admitter._channel is not None and admitter._channel.closed)
        await admitter.send("j", 3)
        await admitter.send("k", 1)  # the next job of the call
        await wait_until(lambda: len(peer.got) == 3)
        await admitter.aclose()
    assert peer.got == [("channel", 2), ("post", 3), ("channel", 1)]
