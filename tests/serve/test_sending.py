"""A results stream's writes (``serve/sending.py``) on a real aiohttp server: a chunk with
room under the buffer's limit goes out in the same turn of the loop; a peer that reads
nothing gets the idle watch (tests/serve/test_bodies.py cuts such peers end to end)."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from dispatcher.serve.sending import Sender
from tests.helpers import serve

BUFFER_BYTES = 64 * 1024


async def test_a_chunk_with_room_is_written_without_a_turn_of_the_loop() -> None:
    turns: list[int] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        sender = Sender(request, response, buffer_bytes=BUFFER_BYTES, idle_s=5.0)
        for i in range(3):
            ran: list[int] = []
            asyncio.get_running_loop().call_soon(ran.append, i)
            await sender.write(b"%d\n" % i)
            turns.append(len(ran))
        await sender.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/", handler)
    runner, url = await serve(app)
    try:
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            assert await resp.read() == b"0\n1\n2\n"
    finally:
        await runner.cleanup()
    # A turn of the loop would have run the callback scheduled before each write.
    assert turns == [0, 0, 0]
