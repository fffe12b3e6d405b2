"""Telling the capture proxy that rollouts ended (capture/release.py), against a real
HTTP server standing in for the proxy."""

from __future__ import annotations

from aiohttp import web

from dispatcher.capture.release import SessionReleaser
from tests.capture.test_proxy import Servers, servers
from tests.helpers import wait_until

__all__ = ["servers"]  # the fixture, imported for these tests


async def test_a_release_is_sent_while_an_earlier_one_is_unanswered(servers: Servers) -> None:
    gate = servers.gate()
    arrived: list[str] = []

    async def release(request: web.Request) -> web.Response:
        arrived.append(request.match_info["id"])
        if request.match_info["id"] == "1-0":
            await gate.wait()  # a proxy slow to answer this one
        return web.json_response({"released": True})

    app = web.Application()
    app.router.add_post("/ng-release/{id}", release)
    releaser = SessionReleaser(await servers.start(app))
    releaser.start()
    try:
        releaser.release("1-0")
        await wait_until(lambda: arrived == ["1-0"])
        releaser.release("2-0")  # not held up behind the unanswered one
        await wait_until(lambda: arrived == ["1-0", "2-0"])
        gate.set()
        releaser.release("3-0")
    finally:
        await releaser.close()
    assert arrived == ["1-0", "2-0", "3-0"]
    assert (releaser.sent, releaser.failed) == (3, 0)


async def test_closing_sends_what_is_waiting(servers: Servers) -> None:
    arrived: list[str] = []

    async def release(request: web.Request) -> web.Response:
        arrived.append(request.match_info["id"])
        return web.json_response({"released": False})

    app = web.Application()
    app.router.add_post("/ng-release/{id}", release)
    releaser = SessionReleaser(await servers.start(app))
    releaser.start()
    for task in range(5):
        releaser.release(f"{task}-0")
    await releaser.close()  # before the background task had its turn
    assert sorted(arrived) == [f"{task}-0" for task in range(5)]
