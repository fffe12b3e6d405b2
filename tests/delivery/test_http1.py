"""The agent calls' HTTP/1.1 client (``delivery/http1.py``) against real servers on 127.0.0.1:
keep-alive, framing, encodings, credentials, caps and agents that break HTTP."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import ssl
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import uvloop
from aiohttp import web

from dispatcher.delivery import http1
from dispatcher.delivery import turns as turn_bounds
from dispatcher.delivery.answers import Failure, NotDelivered
from dispatcher.delivery.exchange import ExchangeLimits, post_run
from dispatcher.delivery.http1 import Connection
from dispatcher.delivery.http1_errors import Disconnected
from dispatcher.delivery.http1_pool import Http1Pool
from dispatcher.delivery.limits import JOIN_OFF_LOOP_BYTES, BodyLimitError, ResponseLimits
from dispatcher.delivery.target import Target
from tests.helpers import read_request, self_signed, serve, wait_until

MAX = 64 * 1024 * 1024
BIG_BODY = b"b" * (2 * http1.DIRECT_BODY_BYTES)
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def pool() -> AsyncIterator[Http1Pool]:
    pool = Http1Pool(connect_timeout_s=5.0)
    yield pool
    await pool.close()


class Scripted:
    """TCP servers that run a script per connection (answers no HTTP library would
    send), and how many connections they took."""

    def __init__(self) -> None:
        self.connections = 0
        self._servers: list[asyncio.Server] = []
        self._writers: list[asyncio.StreamWriter] = []

    async def __call__(self, script: Script) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            self._writers.append(writer)
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                await script(reader, writer)
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self._servers.append(server)
        port = server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/run"

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for writer in self._writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        for server in self._servers:
            await server.wait_closed()


@pytest.fixture
async def scripted() -> AsyncIterator[Scripted]:
    servers = Scripted()
    yield servers
    await servers.close()


def answer_once(reply: bytes) -> Script:
    """A script that reads one request, sends ``reply``, and closes the connection."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(reply)
        await writer.drain()
        writer.close()

    return script


def answer_then_wait(reply: bytes) -> Script:
    """A script that reads one request, sends ``reply``, and waits for the client's close."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(reply)
        await reader.read()

    return script


async def call(
    pool: Http1Pool, url: str, body: bytes = b"{}", max_bytes: int = MAX
) -> bytes | bytearray:
    target = Target.of(url)
    conn = await pool.post(target, body, max_bytes)
    try:
        return await conn.body(None)
    finally:
        pool.release(conn, target)


async def counting_app() -> tuple[web.Application, list[Any]]:
    """An agent that echoes the body and remembers which connection each call came on."""
    peers: list[Any] = []

    async def run(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        return web.Response(body=await request.read())

    app = web.Application()
    app.router.add_post("/run", run)
    return app, peers


async def test_connections_are_kept_alive_and_reused(pool: Http1Pool) -> None:
    app, peers = await counting_app()
    runner, url = await serve(app)
    try:
        answers = [await call(pool, f"{url}/run", b'{"n":%d}' % i) for i in range(5)]
    finally:
        await runner.cleanup()
    assert answers == [b'{"n":%d}' % i for i in range(5)]
    assert len(set(peers)) == 1, "every call after the first reuses the first connection"


async def test_a_connection_kept_idle_holds_nothing_of_its_last_answer(pool: Http1Pool) -> None:
    # At 10,000 in flight an idle connection may wait a whole wave for its next
    # call: what it holds meanwhile is walked by every young GC pass of the wave.
    app, _ = await counting_app()
    runner, url = await serve(app)
    try:
        assert await call(pool, f"{url}/run", b'{"n":1}') == b'{"n":1}'
        (idle,) = pool._idle[Target.of(url).origin]
        assert idle.headers == [] and idle._chunks == []
        assert await call(pool, f"{url}/run", b'{"n":2}') == b'{"n":2}'
    finally:
        await runner.cleanup()


async def test_concurrent_calls_each_get_a_connection_and_all_are_kept(pool: Http1Pool) -> None:
    app, peers = await counting_app()
    runner, url = await serve(app)
    try:
        await asyncio.gather(*(call(pool, f"{url}/run", b"%d" % i) for i in range(8)))
        await asyncio.gather(*(call(pool, f"{url}/run", b"%d" % i) for i in range(8)))
    finally:
        await runner.cleanup()
    assert len(peers) == 16
    assert len(set(peers)) == 8


async def test_an_answer_with_connection_close_is_not_reused(
    pool: Http1Pool, scripted: Scripted
) -> None:
    url = await scripted(
        answer_once(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
    )
    assert [await call(pool, url) for _ in range(3)] == [b"ok"] * 3
    assert scripted.connections == 3


async def test_a_connection_the_agent_closed_while_idle_is_not_used_again(
    pool: Http1Pool, scripted: Scripted
) -> None:
    closed: list[asyncio.Event] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # a keep-alive answer, then the agent's idle timeout
        closed.append(asyncio.Event())

    url = await scripted(script)
    target = Target.of(url)
    first = await pool.post(target, b"{}", MAX)
    assert await first.body(None) == b"ok"
    pool.release(first, target)
    await wait_until(lambda: first.closed)
    assert await call(pool, url) == b"ok"
    assert len(closed) == 2


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'3\r\n{"a\r\n5\r\n":1}\n\r\n0\r\n\r\n',
        b'HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n{"a":1}\n',
    ],
    ids=["chunked", "after-100-continue"],
)
async def test_framings_an_agent_may_use(
    pool: Http1Pool, scripted: Scripted, answer: bytes
) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(answer)

    url = await scripted(script)
    assert await call(pool, url) == b'{"a":1}\n'
    assert await call(pool, url) == b'{"a":1}\n', "and the connection serves the next call"


@pytest.mark.parametrize(
    ("answer", "body"),
    [
        # RFC 9112 5.2: a user agent replaces a response's obs-fold with SP.
        (b"HTTP/1.1 200 OK\r\nX-Note: a\r\n  b\r\nContent-Length: 2\r\n\r\nok", b"ok"),
        (b"HTTP/1.1 200 OK\r\nX-Note: a\r\n\tb\r\nContent-Length: 2\r\n\r\nok", b"ok"),
        # "identity" is no transfer coding (RFC 9112 dropped it): no length, until close.
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\nwhole", b"whole"),
    ],
    ids=["obs-fold", "obs-fold-tab", "identity"],
)
async def test_answers_from_older_servers_are_read(
    pool: Http1Pool, scripted: Scripted, answer: bytes, body: bytes
) -> None:
    url = await scripted(answer_once(answer))
    assert await call(pool, url) == body


@pytest.mark.parametrize(
    ("head", "body", "after"),
    [
        (b"Transfer-Encoding: identity\r\nContent-Length: 2", b"ok", b""),
        (b"Transfer-Encoding: identity\r\nContent-Length: 0", b"", b""),
        (b"Content-Length: 2\r\nTransfer-Encoding: identity", b"ok", b"HTTP/1.1 200 OK\r\n"),
        (b"Transfer-Encoding: identity\r\nContent-Length: %d" % len(BIG_BODY), BIG_BODY, b""),
        # RFC 9112 6.3: a Transfer-Encoding overrides a Content-Length.
        (b"Transfer-Encoding: chunked\r\nContent-Length: %d" % len(BIG_BODY), b"ok", b""),
    ],
    ids=[
        "identity-length",
        "identity-empty",
        "identity-length-then-more",
        "identity-big",
        "chunked-over-length",
    ],
)
async def test_a_length_beside_a_transfer_encoding_frames_the_answer_as_rfc_9112_says(
    pool: Http1Pool, scripted: Scripted, head: bytes, body: bytes, after: bytes
) -> None:
    # The agent keeps its connection open: only the length can end the answer.
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            sent = b"2\r\nok\r\n0\r\n\r\n" if b"chunked" in head else body
            writer.write(b"HTTP/1.1 200 OK\r\n%s\r\n\r\n%s%s" % (head, sent, after))

    url = await scripted(script)
    assert await call(pool, url) == body
    assert await call(pool, url) == body


async def test_a_body_without_a_length_ends_with_the_connection(
    pool: Http1Pool, scripted: Scripted
) -> None:
    url = await scripted(answer_once(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 100_000))
    assert await call(pool, url) == b"x" * 100_000


@pytest.mark.parametrize(
    ("encoding", "encode"),
    [
        ("gzip", gzip.compress),
        ("deflate", zlib.compress),
        ("deflate", lambda data: zlib.compress(data)[2:-4]),  # raw deflate, as some servers send
    ],
    ids=["gzip", "deflate", "raw-deflate"],
)
async def test_an_encoded_answer_is_inflated(
    pool: Http1Pool, encoding: str, encode: Callable[[bytes], bytes]
) -> None:
    body = b'{"text":"' + b"abc" * 50_000 + b'"}'

    async def run(request: web.Request) -> web.Response:
        assert "gzip" in request.headers["Accept-Encoding"]
        return web.Response(body=encode(body), headers={"Content-Encoding": encoding})

    app = web.Application()
    app.router.add_post("/run", run)
    runner, url = await serve(app)
    try:
        assert await call(pool, f"{url}/run") == body
    finally:
        await runner.cleanup()


BODY = b'{"text":"' + b"abc" * 20_000 + b'"}'


@pytest.mark.parametrize(
    ("encoding", "packed"),
    [
        # Multi-member gzip is valid gzip (RFC 1952 2.2): every member is the body's.
        ("gzip", gzip.compress(BODY[:1000]) + gzip.compress(BODY[1000:])),
        ("gzip, gzip", gzip.compress(gzip.compress(BODY))),  # both codings undone
        ("gzip, identity", gzip.compress(BODY)),
    ],
    ids=["multi-member", "gzip-twice", "gzip-then-identity"],
)
async def test_an_answer_encoded_in_more_than_one_piece_is_inflated_whole(
    pool: Http1Pool, scripted: Scripted, encoding: str, packed: bytes
) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            head = b"HTTP/1.1 200 OK\r\nContent-Encoding: %s\r\nContent-Length: %d\r\n\r\n"
            writer.write(head % (encoding.encode(), len(packed)))
            for start in range(0, len(packed), 700):  # members split across reads
                writer.write(packed[start : start + 700])
                await writer.drain()

    url = await scripted(script)
    assert await call(pool, url) == BODY
    assert await call(pool, url) == BODY


async def test_a_gzip_body_cut_short_is_a_delivered_failure_that_says_so(
    pool: Http1Pool, scripted: Scripted
) -> None:
    # The length is whole but the gzip stream in it is not: not JSON to judge, a cut body.
    packed = gzip.compress(BODY)[:-30]

    head = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"
    url = await scripted(answer_then_wait(head % len(packed) + packed))
    status, missed, failure = await exchange(pool, url)
    assert missed is None and status == 200
    assert failure is not None and failure.failure_class == "agent_run_error"
    assert "cut short" in failure.message and not failure.terminal


async def test_the_cap_counts_inflated_bytes_and_stops_there(pool: Http1Pool) -> None:
    bomb = gzip.compress(b"0" * 20_000_000)

    async def run(request: web.Request) -> web.Response:
        return web.Response(body=bomb, headers={"Content-Encoding": "gzip"})

    app = web.Application()
    app.router.add_post("/run", run)
    runner, url = await serve(app)
    try:
        with pytest.raises(BodyLimitError) as caught:
            await call(pool, f"{url}/run", max_bytes=1_000_000)
    finally:
        await runner.cleanup()
    assert caught.value.kind == "ResponseTooLarge"
    assert caught.value.partial == b"0" * 16 * 1024


async def test_credentials_in_the_url_become_basic_auth_and_the_host_header_has_the_port(
    pool: Http1Pool,
) -> None:
    seen: list[tuple[str, str, str]] = []

    async def run(request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization", "")
        seen.append((auth, request.headers["Host"], request.path))
        return web.Response(text="{}")

    app = web.Application()
    app.router.add_post("/agent/run", run)
    runner, url = await serve(app)
    try:
        with_secret = url.replace("http://", "http://user:s3cr%40t@")
        await call(pool, f"{with_secret}/agent/run")
    finally:
        await runner.cleanup()
    secret = base64.b64encode(b"user:s3cr@t").decode()
    assert seen == [(f"Basic {secret}", url.removeprefix("http://"), "/agent/run")]


@pytest.mark.parametrize(
    ("reply", "where"),
    [
        (b"", "before its answer"),
        (b"SSH-2.0-OpenSSH_9.6\r\n", "not HTTP"),
        (b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"a"', "before its answer's end"),
    ],
    ids=["closed", "not-http", "cut-short"],
)
async def test_an_agent_that_breaks_http_is_a_disconnected_error(
    pool: Http1Pool, scripted: Scripted, reply: bytes, where: str
) -> None:
    url = await scripted(answer_once(reply))
    with pytest.raises(Disconnected, match=where):
        await call(pool, url)


async def test_bytes_sent_between_calls_close_the_connection(
    pool: Http1Pool, scripted: Scripted
) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale")
        await reader.read()

    url = await scripted(script)
    target = Target.of(url)
    conn = await pool.post(target, b"{}", MAX)
    assert await conn.body(None) == b"ok"
    pool.release(conn, target)
    await wait_until(lambda: conn.closed)
    assert await call(pool, url) == b"ok"
    assert scripted.connections == 2


async def test_a_late_answer_waiting_in_an_idle_connection_is_never_the_next_calls(
    pool: Http1Pool, scripted: Scripted
) -> None:
    # The late bytes are in the socket before the next call is made, but the loop
    # has not read them yet: the call must not take them for its answer.
    writers: list[asyncio.StreamWriter] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfresh")

    url = await scripted(script)
    assert await call(pool, url) == b"fresh"
    # A write on loopback lands in the client's socket at once; no await before the call.
    writers[0].write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale")
    assert await call(pool, url) == b"fresh"
    assert scripted.connections == 2


@pytest.mark.parametrize("size", [1_000, JOIN_OFF_LOOP_BYTES + 1])
async def test_a_big_body_is_joined_in_a_thread_a_small_one_on_the_loop(
    pool: Http1Pool, monkeypatch: pytest.MonkeyPatch, size: int
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
    app.router.add_post("/run", answer)
    runner, url = await serve(app)
    try:
        read = await call(pool, f"{url}/run")
    finally:
        await runner.cleanup()
    assert read == body
    assert len(hops) == (size >= JOIN_OFF_LOOP_BYTES)


@pytest.mark.parametrize(("size", "max_bytes"), [(3_000, 10_000), (3_000, 1_000)])
async def test_an_answer_that_arrived_whole_is_read_at_once_and_still_capped(
    pool: Http1Pool, monkeypatch: pytest.MonkeyPatch, size: int, max_bytes: int
) -> None:
    body = bytes(range(256)) * (size // 256) + b"y" * (size % 256)

    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=body)

    def no_deadline(*args: Any) -> Any:
        raise AssertionError("a body already read needs no deadline")

    app = web.Application()
    app.router.add_post("/run", answer)
    runner, url = await serve(app)
    target = Target.of(f"{url}/run")
    conn: Connection | None = None
    try:
        conn = await pool.post(target, b"{}", max_bytes)
        await wait_until(lambda: conn is not None and (conn.reusable() or conn.closed))
        monkeypatch.setattr(asyncio, "timeout", no_deadline)
        if size <= max_bytes:
            assert await conn.body(None) == body
        else:
            with pytest.raises(BodyLimitError) as caught:
                await conn.body(None)
            assert caught.value.kind == "ResponseTooLarge"
            assert caught.value.partial == body[:1_000] or caught.value.partial == body
    finally:
        if conn is not None:
            pool.release(conn, target)
        await runner.cleanup()


async def test_headers_that_never_end_are_cut_at_the_head_limit(
    pool: Http1Pool, scripted: Scripted
) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        while True:
            writer.write(b"X-Pad: " + b"y" * 1000 + b"\r\n")
            await writer.drain()

    url = await scripted(script)
    with pytest.raises(Disconnected, match="without ending its headers"):
        await call(pool, url)


async def test_a_long_body_that_arrives_after_its_head_is_read_whole_and_the_connection_kept(
    pool: Http1Pool, scripted: Scripted
) -> None:
    body = bytes(range(256)) * 12_000  # ~3 MB: the head first, the body in later reads

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:10])
            await writer.drain()
            for start in range(10, len(body), 1_000_000):
                writer.write(body[start : start + 1_000_000])
                await writer.drain()

    url = await scripted(script)
    assert [await call(pool, url) for _ in range(3)] == [body] * 3
    assert scripted.connections == 1


@pytest.mark.parametrize(
    "size", [200_000, 2 * http1.DIRECT_BODY_BYTES], ids=["through-the-parser", "direct"]
)
async def test_bytes_past_a_long_body_leave_the_answer_whole_and_close_the_connection(
    pool: Http1Pool, scripted: Scripted, size: int
) -> None:
    body = b"z" * size

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        await writer.drain()
        writer.write(body + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale")
        await reader.read()

    url = await scripted(script)
    assert await call(pool, url) == body
    assert await call(pool, url) == body
    assert scripted.connections == 2


async def test_a_long_gzip_body_after_its_head_is_inflated(
    pool: Http1Pool, scripted: Scripted
) -> None:
    body = b'{"t":"' + b"abcdefgh" * 400_000 + b'"}'
    packed = gzip.compress(body)

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        head = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"
        writer.write(head % len(packed))
        await writer.drain()
        for start in range(0, len(packed), 1000):
            writer.write(packed[start : start + 1000])
        await writer.drain()
        await reader.read()

    url = await scripted(script)
    assert await call(pool, url) == body


async def test_a_call_made_after_the_pool_closed_does_not_leave_its_connection_open() -> None:
    app, _ = await counting_app()
    runner, url = await serve(app)
    pool = Http1Pool(connect_timeout_s=5.0)
    target = Target.of(f"{url}/run")
    try:
        await pool.close()  # shutdown began; a call already on its way still runs
        conn = await pool.post(target, b"{}", MAX)
        assert await conn.body(None) == b"{}"
        pool.release(conn, target)
        await wait_until(lambda: conn.closed)
    finally:
        await runner.cleanup()


class Turns:
    """Counts the turns of the running loop: a callback that schedules itself runs
    once per turn."""

    def __init__(self) -> None:
        self.now = 0
        self._ticking = False

    def start(self) -> None:
        self._ticking = True
        asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._ticking = False

    def _tick(self) -> None:
        self.now += 1
        if self._ticking:
            asyncio.get_running_loop().call_soon(self._tick)


def on_uvloop(
    script: Script, one: Callable[[Http1Pool, str], Awaitable[bytes]], calls: int, turns: Turns
) -> list[bytes]:
    """``calls`` calls made at once by ``one`` to a server running ``script``, on
    uvloop (the daemon's loop: libuv reads sockets its own way), turns counted."""

    async def run() -> list[bytes]:
        server = await asyncio.start_server(script, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/run"
        pool = Http1Pool(connect_timeout_s=5.0)
        turns.start()
        try:
            return await asyncio.gather(*(one(pool, url) for _ in range(calls)))
        finally:
            turns.stop()
            await pool.close()
            server.close()
            await server.wait_closed()

    return uvloop.run(run())


def test_a_flood_of_answer_bytes_is_read_a_bounded_amount_per_turn_of_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On the daemon's loop (uvloop), libuv reads a ready socket several times
    # over in one turn: answers already in the sockets' buffers were read 4 MB
    # a turn, and the loop ran nothing else meanwhile (40 to 100 ms at 16
    # answers of 20 MB).
    monkeypatch.setattr(turn_bounds, "READ_BYTES_PER_TURN", 256 * 1024)
    calls, body = 8, b"x" * (2 * 1024 * 1024)
    turns = Turns()
    read: dict[int, int] = {}
    largest_read = 0
    received = Connection.data_received

    def counted(self: Connection, data: bytes) -> None:
        nonlocal largest_read
        read[turns.now] = read.get(turns.now, 0) + len(data)
        largest_read = max(largest_read, len(data))
        received(self, data)

    monkeypatch.setattr(Connection, "data_received", counted)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        # Loopback's buffers take the whole answer before the client reads much.
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        await reader.read()
        writer.close()

    assert on_uvloop(answer, call, calls, turns) == [body] * calls
    # Past the bound, a connection that was ready in the same turn reads once more.
    assert max(read.values()) <= turn_bounds.READ_BYTES_PER_TURN + calls * largest_read, read


def test_a_wave_of_answers_wakes_a_bounded_number_of_calls_per_turn_of_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An agent answers in waves: calls started together end together, libuv
    # reads every ready socket in one turn, and each call woken runs its
    # rollout's next steps in the turn after: thousands at once held every
    # timer for up to 90 ms at 10,000 in flight.
    monkeypatch.setattr(turn_bounds, "ANSWERS_PER_TURN", 3)
    calls = 12
    turns = Turns()
    woken: dict[int, int] = {}
    arrived = 0
    all_in = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal arrived
        await read_request(reader)
        arrived += 1
        if arrived == calls:
            all_in.set()
        await all_in.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()
        writer.close()

    async def one(pool: Http1Pool, url: str) -> bytes:
        target = Target.of(url)
        conn = await pool.post(target, b"{}", MAX)
        woken[turns.now] = woken.get(turns.now, 0) + 1
        try:
            return await conn.body(None)
        finally:
            pool.release(conn, target)

    assert on_uvloop(answer, one, calls, turns) == [b"ok"] * calls
    assert sum(woken.values()) == calls
    assert max(woken.values()) <= 3, woken


async def test_calls_past_a_turns_bound_are_woken_in_the_turns_after_first_come_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(turn_bounds, "ANSWERS_PER_TURN", 2)
    pool = Http1Pool(connect_timeout_s=5.0)
    heads = [asyncio.get_running_loop().create_future() for _ in range(5)]
    for head in heads:
        pool.answered(head)
    done = [[h.done() for h in heads]]
    for _ in range(3):
        await asyncio.sleep(0)
        done.append([h.done() for h in heads])
    assert done == [
        [True, True, False, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True],
        [True, True, True, True, True],
    ]


@pytest.mark.parametrize(
    ("answer", "body"),
    [
        (b"HTTP/1.1 200 OK\r\n\r\nwhole", b"whole"),  # read until close: ends whole
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf", None),  # cut short
    ],
    ids=["until-close", "cut-short"],
)
async def test_a_head_whose_call_waits_for_its_turn_stands_when_the_connection_then_ends(
    pool: Http1Pool,
    scripted: Scripted,
    monkeypatch: pytest.MonkeyPatch,
    answer: bytes,
    body: bytes | None,
) -> None:
    # Past a turn's bound the call waits to be woken (``Http1Pool.answered``);
    # its head is in: the connection's end is its body's, and it was delivered.
    held: list[asyncio.Future[None]] = []
    monkeypatch.setattr(Http1Pool, "answered", lambda self, head: held.append(head))
    lost = asyncio.Event()
    connection_lost = Connection.connection_lost

    def noted(self: Connection, exc: Exception | None) -> None:
        connection_lost(self, exc)
        lost.set()

    monkeypatch.setattr(Connection, "connection_lost", noted)

    target = Target.of(await scripted(answer_once(answer)))
    posted = asyncio.create_task(pool.post(target, b"{}", MAX))
    await lost.wait()
    assert len(held) == 1 and not held[0].done()
    held[0].set_result(None)
    conn = await posted
    assert conn.status == 200
    if body is not None:
        assert await conn.body(None) == body
    else:
        with pytest.raises(Disconnected, match="before its answer's end"):
            await conn.body(None)
    pool.release(conn, target)


# ---- a big body of known length, read straight into a buffer of its own --------------

BIG = bytes(range(256)) * (2 * http1.DIRECT_BODY_BYTES // 256) + b"end"  # ~2 MB


def on_each_loop(loop: str, main: Callable[[], Awaitable[None]]) -> None:
    """``main`` on asyncio's own loop or on uvloop (they read sockets their own ways)."""
    (uvloop.run if loop == "uvloop" else asyncio.run)(main())


@contextlib.asynccontextmanager
async def big_answers(
    answers: list[bytes],
    with_head: int,
    close_after: int | None = None,
    tls: ssl.SSLContext | None = None,
) -> AsyncIterator[str]:
    """A server answering each request with the next of ``answers``: its head with
    its first ``with_head`` bytes in one write, the rest in pieces; the connection
    closed after ``close_after`` bytes of the body, if given."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for body in answers:
            await read_request(reader)
            end = len(body) if close_after is None else close_after
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
            writer.write(body[:with_head])
            for start in range(with_head, end, 300_000):
                writer.write(body[start : min(start + 300_000, end)])
                await writer.drain()
            if close_after is not None:
                break
        writer.close()

    server = await asyncio.start_server(script, "127.0.0.1", 0, ssl=tls)
    scheme = "https" if tls else "http"
    try:
        yield f"{scheme}://127.0.0.1:{server.sockets[0].getsockname()[1]}/run"
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def fresh_pool(trust: ssl.SSLContext | None = None) -> AsyncIterator[Http1Pool]:
    """A pool of its own, closed after; ``trust``: what its TLS trusts instead of the system's."""
    pool = Http1Pool(connect_timeout_s=5.0)
    if trust is not None:
        pool._tls = trust
    try:
        yield pool
    finally:
        await pool.close()


async def read_in_turn(
    answers: list[bytes],
    with_head: int,
    served: ssl.SSLContext | None = None,
    trust: ssl.SSLContext | None = None,
) -> None:
    """``answers`` (big, small, big) read in turn on one connection: each whole, the
    big ones straight into their buffers (nothing was joined)."""
    async with big_answers(answers, with_head, tls=served) as url, fresh_pool(trust) as pool:
        got = [await call(pool, url) for _ in answers]
    assert got == answers
    assert [type(body) for body in got] == [bytearray, bytes, bytearray]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize(
    "with_head", [0, 10, len(BIG)], ids=["head-alone", "head-and-its-start", "head-and-all"]
)
def test_a_big_body_of_known_length_is_read_into_a_buffer_of_its_own_and_the_next_answer_read(
    loop: str, with_head: int
) -> None:
    # However the body arrives, it is read whole; the connection then reads a
    # small answer (through the parser again) and another big one.
    on_each_loop(loop, lambda: read_in_turn([BIG, b'{"small": 1}', BIG[::-1]], with_head))


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_big_body_cut_short_is_a_disconnected_error(loop: str) -> None:
    async def main() -> None:
        async with big_answers([BIG], 10, close_after=len(BIG) // 2) as url, fresh_pool() as pool:
            target = Target.of(url)
            conn = await pool.post(target, b"{}", MAX)
            with pytest.raises(Disconnected, match="before its answer's end"):
                await conn.body(None)
            assert conn.closed
            pool.release(conn, target)

    on_each_loop(loop, main)


def test_a_big_body_over_the_cap_is_refused_with_its_start_kept() -> None:
    async def main() -> None:
        async with big_answers([BIG], 10) as url, fresh_pool() as pool:
            with pytest.raises(BodyLimitError) as caught:
                await call(pool, url, max_bytes=len(BIG) - 1)
        assert caught.value.kind == "ResponseTooLarge"
        assert BIG.startswith(caught.value.partial) and caught.value.partial

    on_each_loop("uvloop", main)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_big_and_small_answers_over_tls_are_read_whole(loop: str, tmp_path: Path) -> None:
    # The TLS layer hands the decrypted bytes to the connection's buffers too.
    cert, key = self_signed(tmp_path)

    async def main() -> None:
        served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        served.load_cert_chain(cert, key)
        trust = ssl.create_default_context(cafile=str(cert))
        await read_in_turn([BIG, b'{"small": 1}', BIG[::-1]], 10, served, trust)

    on_each_loop(loop, main)


# ---- answers delivered, then broken -----------------------------------------------------

LIMITS = ExchangeLimits.of(None, 5.0, ResponseLimits())


async def exchange(pool: Http1Pool, url: str) -> tuple[int, NotDelivered | None, Failure | None]:
    """One ``POST /run`` as a rollout makes it: (status, not delivered, failure)."""
    status, _, missed, failure = await post_run(pool, url, Target.of(url), b"{}", LIMITS)
    return status, missed, failure


@pytest.mark.parametrize(
    "head",
    [
        b"Content-Length: 2\r\nContent-Length: 2\r\n",
        b"Content-Length: 2, 2\r\n",
        b"Content-Length: -1\r\n",
        b"X-Note: a\x00b\r\nContent-Length: 2\r\n",
    ],
    ids=["duplicate-length", "length-list", "length-minus-1", "nul"],
)
@pytest.mark.parametrize("reason", [b" OK", b""], ids=["reason", "no-reason"])
async def test_an_answer_broken_after_its_status_line_was_delivered(
    pool: Http1Pool, scripted: Scripted, head: bytes, reason: bytes
) -> None:
    # The agent ran the rollout: a retry would run it again, and the replica is up.
    url = await scripted(answer_then_wait(b"HTTP/1.1 200%s\r\n%s\r\nok" % (reason, head)))
    status, missed, failure = await exchange(pool, url)
    assert missed is None
    assert failure is not None and failure.failure_class == "agent_run_error"
    assert status == 200 and not failure.terminal
    assert "after its status line (HTTP 200)" in failure.message, failure.message


async def test_a_503_broken_after_its_status_line_is_still_not_delivered(
    pool: Http1Pool, scripted: Scripted
) -> None:
    # Its status line says the rollout never ran (contracts §11), whatever follows it.
    answer = b"HTTP/1.1 503 Busy\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nno"
    status, missed, failure = await exchange(pool, await scripted(answer_then_wait(answer)))
    assert failure is None and status == 503
    assert missed is not None and missed.reason == "http_503"


@pytest.mark.parametrize(
    "reply",
    [b"SSH-2.0-OpenSSH_9.6\r\n", b"HTTP/1.1 2000 OK\r\nContent-Length: 2\r\n\r\nok"],
    ids=["not-http", "bad-status"],
)
async def test_an_answer_without_a_valid_status_line_was_not_delivered(
    pool: Http1Pool, scripted: Scripted, reply: bytes
) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")  # parsed: llhttp keeps 200
        await read_request(reader)
        writer.write(reply)
        await reader.read()

    url = await scripted(script)
    assert (await exchange(pool, url))[1:] == (None, None)
    status, missed, _ = await exchange(pool, url)
    assert missed is not None and missed.reason == "no_answer" and status == 0


async def test_a_head_whose_call_waits_for_its_turn_outlives_the_first_byte_deadline(
    pool: Http1Pool, scripted: Scripted, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The status line is in; its call waits to be woken (``Http1Pool.answered``)
    # when the deadline passes: delivered, not a first-byte timeout.
    held = asyncio.Event()
    heads: list[asyncio.Future[None]] = []

    def hold(self: Http1Pool, head: asyncio.Future[None]) -> None:
        heads.append(head)
        held.set()

    monkeypatch.setattr(Http1Pool, "answered", hold)
    url = await scripted(answer_then_wait(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"))
    limits = ExchangeLimits.of(None, 60.0, ResponseLimits(max_bytes=MAX))
    deadlines = limits.first_byte
    assert deadlines is not None
    call = asyncio.create_task(post_run(pool, url, Target.of(url), b"{}", limits))
    await held.wait()
    # The deadline passes now (as its timer would, 60 s on).
    _, head, owner = deadlines._queue[0]
    deadlines._queue[0] = (0.0, head, owner)
    deadlines._fire()
    assert head is heads[0] and not head.done() and not call.done()
    head.set_result(None)
    status, body, missed, failure = await call
    assert (status, bytes(body), missed, failure) == (200, b"ok", None, None)


async def test_a_call_without_its_status_line_at_the_first_byte_deadline_was_not_delivered(
    pool: Http1Pool, scripted: Scripted
) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()

    url = await scripted(silent)
    limits = ExchangeLimits.of(None, 0.01, ResponseLimits(max_bytes=MAX))
    status, _, missed, failure = await post_run(pool, url, Target.of(url), b"{}", limits)
    assert status == 0 and failure is None and missed is not None
    assert missed.reason == "first_byte_timeout"
