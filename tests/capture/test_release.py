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
    # A proxy with no route for several ids at once (an older one): each on its own.
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


async def test_releases_that_come_together_go_in_one_request(servers: Servers) -> None:
    requests: list[list[str]] = []

    async def one(request: web.Request) -> web.Response:
        requests.append([request.match_info["id"]])
        return web.json_response({"released": True})

    async def several(request: web.Request) -> web.Response:
        requests.append((await request.json())["session_ids"])
        return web.json_response({"released": len(requests[-1]), "unknown": 0})

    app = web.Application()
    app.router.add_post("/ng-release/{id}", one)
    app.router.add_post("/ng-release", several)
    releaser = SessionReleaser(await servers.start(app))
    releaser.start()
    try:
        # A group's rollouts ending at once: one request, not one each (a loaded proxy
        # took seconds to get through 64 of them at the first wave's end).
        for repeat in range(8):
            releaser.release(f"3-{repeat}")
        await wait_until(lambda: sum(map(len, requests)) == 8)
        releaser.release("4-0")  # alone: its own route
        await wait_until(lambda: len(requests) == 2)
    finally:
        await releaser.close()
    assert requests == [[f"3-{repeat}" for repeat in range(8)], ["4-0"]]
    assert (releaser.sent, releaser.failed) == (9, 0)
