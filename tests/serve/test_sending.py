"""A results stream's writes (``serve/sending.py``) on a real aiohttp server: a chunk with
room under the buffer's limit goes out in the same turn of the loop; a peer that reads
nothing gets the idle watch (tests/serve/test_bodies.py cuts such peers end to end)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import http_writer, web

from dispatcher.serve.sending import Sender, StreamResponse
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


async def test_a_streams_headers_last_chunk_and_end_go_out_in_one_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A job of one group was four writes (its headers, its group, its end line, the
    # chunked end), each a system call and a pass through the send path.
    writes: list[str] = []
    writer = http_writer.StreamWriter
    real_write, real_writelines = writer._write, writer._writelines

    def write(self: http_writer.StreamWriter, chunk: bytes) -> None:
        writes.append("write")
        real_write(self, chunk)

    def writelines(self: http_writer.StreamWriter, chunks: list[bytes]) -> None:
        writes.append("writelines")
        real_writelines(self, chunks)

    async def handler(request: web.Request) -> web.StreamResponse:
        response = StreamResponse()
        await response.prepare(request)
        writes.clear()  # the server's own writes before it (none expected)
        sender = Sender(request, response, buffer_bytes=BUFFER_BYTES, idle_s=5.0)
        await sender.write_eof(b'{"group": 1}\n{"end": "done"}\n')
        return response

    app = web.Application()
    app.router.add_get("/", handler)
    runner, url = await serve(app)
    try:
        monkeypatch.setattr(http_writer.StreamWriter, "_write", write)
        monkeypatch.setattr(http_writer.StreamWriter, "_writelines", writelines)
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            assert await resp.read() == b'{"group": 1}\n{"end": "done"}\n'
    finally:
        await runner.cleanup()
    assert writes == ["writelines"]


async def test_a_waiting_streams_headers_go_out_with_its_empty_chunk() -> None:
    # The stream sends an empty chunk before it first waits: its client has the
    # status line while nothing is ready.
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = StreamResponse()
        await response.prepare(request)
        sender = Sender(request, response, buffer_bytes=BUFFER_BYTES, idle_s=5.0)
        await sender.write(b"")
        await release.wait()
        await sender.write_eof(b"late\n")
        return response

    app = web.Application()
    app.router.add_get("/", handler)
    runner, url = await serve(app)
    try:
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            assert resp.status == 200
            release.set()
            assert await resp.read() == b"late\n"
    finally:
        await runner.cleanup()
