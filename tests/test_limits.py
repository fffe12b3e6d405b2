"""Reading an agent's answer: the body joined off the loop once it is big."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from dispatcher.delivery.limits import (
    JOIN_OFF_LOOP_BYTES,
    BodyLimitError,
    ResponseLimits,
    read_capped,
)
from tests.helpers import serve, wait_until


@pytest.mark.parametrize("size", [1_000, JOIN_OFF_LOOP_BYTES + 1])
async def test_a_big_body_is_joined_in_a_thread_a_small_one_on_the_loop(
    monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)

    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for start in range(0, size, 65_536):  # arrives in many pieces
            await response.write(body[start : start + 65_536])
        await response.write_eof()
        return response

    hops: list[Any] = []
    real = asyncio.to_thread

    async def counted(fn: Any, *args: Any) -> Any:
        hops.append(fn)
        return await real(fn, *args)

    monkeypatch.setattr(asyncio, "to_thread", counted)
    app = web.Application()
    app.router.add_get("/", answer)
    runner, url = await serve(app)
    try:
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            read = await read_capped(resp, ResponseLimits())
    finally:
        await runner.cleanup()
    assert read == body
    assert len(hops) == (size >= JOIN_OFF_LOOP_BYTES)


@pytest.mark.parametrize(("size", "max_bytes"), [(3_000, 10_000), (3_000, 1_000)])
async def test_an_answer_that_arrived_whole_is_read_at_once_and_still_capped(
    monkeypatch: pytest.MonkeyPatch, size: int, max_bytes: int
) -> None:
    body = bytes(range(256)) * (size // 256) + b"y" * (size % 256)

    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=body)

    def no_deadline(*args: Any) -> Any:
        raise AssertionError("a body already read needs no deadline")

    app = web.Application()
    app.router.add_get("/", answer)
    runner, url = await serve(app)
    try:
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            await wait_until(resp.content.is_eof)
            monkeypatch.setattr(asyncio, "timeout", no_deadline)
            limits = ResponseLimits(max_bytes=max_bytes)
            if size <= max_bytes:
                assert await read_capped(resp, limits) == body
            else:
                with pytest.raises(BodyLimitError) as caught:
                    await read_capped(resp, limits)
                assert caught.value.kind == "ResponseTooLarge"
                assert caught.value.partial == body
    finally:
        await runner.cleanup()
