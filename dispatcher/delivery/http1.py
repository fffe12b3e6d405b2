"""The agent calls' HTTP/1.1 client: ``POST /run`` to a known replica, thousands a second.

aiohttp's client builds a request object, a headers multidict, a URL, a
response object, a stream reader and a timer for every call: about six times
the CPU that one POST to one known server needs (``bench/dispatch_overhead.py``
prints both). This client keeps only what an agent call needs:

- keep-alive connections per replica, the most recently used taken first;
- each replica's request head built once (``target.Target``), with the Basic
  credentials its URL carries, and TLS for an ``https`` replica;
- the answer parsed by httptools (llhttp, the parser uvicorn uses): status,
  headers, a Content-Length, chunked or read-until-close body, 1xx skipped;
- a big body of known length read straight into a buffer of its own
  (``Connection.get_buffer``): the kernel's copy is its only one;
- a gzip or deflate answer inflated as it arrives, in bounded steps
  (``inflate.py``), so the body cap (``ResponseLimits.max_bytes``) counts
  inflated bytes and memory stays under it whatever the agent sends;
- an idle connection with bytes waiting in its socket is closed, never reused
  (``Connection.quiet``): a late answer is never read as the next call's;
- no redirects, no proxies from the environment, no cookies.

Everything that is not an agent call (the service, the capture proxy, the
trainer's client) uses aiohttp.

This module holds one connection and its answer (``Connection``); the pool
that owns the connections is ``http1_pool.py``, the errors ``http1_errors.py``.

Errors are ``OSError``s, as the socket's own are: ``Disconnected`` for an
answer cut short or not HTTP, ``ConnectTimeout`` (a ``TimeoutError``) for a
connection not made in time, and whatever ``connect`` raised.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import re
import termios
import zlib
from typing import Protocol, cast

import httptools

from dispatcher.aio import wake
from dispatcher.delivery.http1_errors import Disconnected, MalformedAnswer
from dispatcher.delivery.inflate import Inflater, inflater_of
from dispatcher.delivery.limits import (
    JOIN_OFF_LOOP_BYTES,
    PARTIAL_KEEP_BYTES,
    Body,
    BodyLimitError,
    partial_prefix,
    too_large_message,
)

# Bodies up to this size go out in one write with their head: a copy is cheaper
# than a second system call. Bigger ones are written as they are.
_JOIN_BODY_BYTES = 64 * 1024
# What an answer may send before its headers end (llhttp itself sets no bound):
# an agent that sends headers forever is cut here, not at the memory's end.
MAX_HEAD_BYTES = 256 * 1024
# A body at least this big, of known length and not inflated, is read straight
# into a buffer of its size. Through the parser, each byte was copied twice on
# the loop (the read's bytes, then the parser's piece) and once more to join
# the pieces: 36% of the loop's CPU with 20 MB answers (``perf``).
DIRECT_BODY_BYTES = 1024 * 1024
# One read into a direct body takes at most this much (a turn's reads stay short).
DIRECT_READ_BYTES = 1024 * 1024
# A direct body's last bytes are read through the scratch buffer, with any that
# follow them in the socket: bytes past an answer close its connection, as they
# do through the parser, and are never left there for the next call to read.
_DIRECT_TAIL_BYTES = 64 * 1024
# An answer's status line, up to its code (``HTTP/1.1 200``): what makes it delivered.
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] [1-9][0-9][0-9][ \r]")
_STATUS_LINE_BYTES = len(b"HTTP/1.1 200 ")


def body_buffer(size: int) -> bytearray:
    """A zeroed bytearray of ``size`` bytes, for a direct body's reads to fill.

    Zeroed, though every byte is read over: a buffer left as the allocator gave
    it held freed memory (other answers, heap pointers), one bug away from a
    row. Zeroing 20 MB costs 1.2 to 2.5 ms on the loop here (allocated and
    filled, against an unzeroed one), beside the socket's reads of it.
    """
    return bytearray(size)


def _parser_for(conn: Connection) -> httptools.HttpResponseParser:
    """llhttp's response parser, reading obs-fold as RFC 9112 5.2 asks a user agent
    to (each fold is white space); its leniency lets a NUL in too: ``on_header``.
    A Content-Length beside a Transfer-Encoding is read as RFC 9112 6.3 says
    (``on_headers_complete``), not refused."""
    parser = httptools.HttpResponseParser(conn)
    parser.set_dangerous_leniencies(lenient_headers=True, lenient_chunked_length=True)
    return parser


class _AfterAnswer(Exception):
    """Raised in a parser callback to stop at bytes that follow a whole answer."""


# What a closed connection's parser becomes: one bound to nothing.
_SPENT_PARSER = httptools.HttpResponseParser(object())


class ConnectionPool(Protocol):
    """What a ``Connection`` needs of the pool that made it (``http1_pool.Http1Pool``)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    scratch: memoryview  # one read buffer for all (``Connection.get_buffer``)

    def took_in(self, conn: Connection, size: int) -> None: ...

    def answered(self, head: asyncio.Future[None]) -> None: ...

    def forget(self, conn: Connection) -> None: ...


class Connection(asyncio.BufferedProtocol):
    """One keep-alive connection; during a call, its answer: ``status``, headers, body."""

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self._transport: asyncio.Transport | None = None
        # Its socket's descriptor, to see bytes that wait unread (-1: none known).
        self._fd = -1
        self._parser = _parser_for(self)
        self._head: asyncio.Future[None] | None = None
        self._end: asyncio.Future[None] | None = None
        # An answer's headers and body pieces, in two lists kept and cleared call
        # after call.
        self.headers: list[tuple[bytes, bytes]] = []
        self._chunks: list[bytes] = []
        self._reset(0)
        self.closed = False

    def _reset(self, max_bytes: int) -> None:
        self.status = 0
        self.headers.clear()
        self._chunks.clear()
        self._size = 0
        # A direct body: its buffer, and whether the last read went into it.
        self._direct: memoryview | None = None
        self._into_direct = False
        self._max_bytes = max_bytes
        self._inflate: Inflater | None = None
        self._until_close = False
        # Body bytes still due of an identity answer with a length (-1: not one).
        self._identity_left = -1
        self._head_bytes = 0
        self._interim = False
        self._complete = False
        # Read while the answer ends: llhttp forgets it once the callback returns.
        self._keep_alive = False
        self._error: BaseException | None = None

    # ---- one call ------------------------------------------------------------------

    def send(self, head: bytes, body: bytes, max_bytes: int) -> asyncio.Future[None]:
        """Write the request; the future is done once the answer's status line and
        headers are in. (A future, not a coroutine: one object less per call in flight.)"""
        assert self._transport is not None
        self._reset(max_bytes)
        self._head = answered = self._pool.loop.create_future()
        length = b"%d\r\n\r\n" % len(body)
        if len(body) <= _JOIN_BODY_BYTES:
            self._transport.write(head + length + body)
        else:
            self._transport.write(head + length)
            self._transport.write(body)
        return answered

    def expire(self, head: asyncio.Future[None]) -> None:
        """The first-byte deadline of ``head``'s call passed (``Deadlines``): a
        ``TimeoutError``, unless its status line is in (delivered, waiting its turn)."""
        if head is self._head and not head.done() and not self.status:
            head.set_exception(TimeoutError("no status line before the first-byte timeout"))

    def header(self, name: bytes) -> str | None:
        """The answer's header ``name`` (lower case), or None."""
        for key, value in self.headers:
            if key.lower() == name:
                return value.decode("latin-1")
        return None

    async def body(self, read_timeout_s: float | None) -> Body:
        """The whole (inflated) body; ``BodyLimitError`` when too large or too slow."""
        if not self._complete and self._error is None:
            self._end = self._pool.loop.create_future()
            deadline = asyncio.timeout(read_timeout_s)
            try:
                async with deadline:
                    await self._end
            except TimeoutError:
                if not deadline.expired():
                    raise  # another deadline's (the rollout timeout's), not ours
                self.close()
                message = f"the answer's body did not arrive within {read_timeout_s} s"
                raise BodyLimitError("ResponseReadTimeout", message, self._prefix()) from None
        if self._error is not None:
            raise self._error
        if self._direct is not None:
            body, self._direct = self._direct.obj, None
            assert isinstance(body, bytearray)
            return body
        if self._size < JOIN_OFF_LOOP_BYTES:
            body = b"".join(self._chunks)
            self._chunks.clear()
            return body
        chunks, self._chunks = self._chunks, []
        # bytes.join lets go of the GIL while it copies a big body: off the loop.
        return await asyncio.to_thread(b"".join, chunks)

    def reusable(self) -> bool:
        """Was the answer read whole, on a connection the agent keeps alive?"""
        return self._complete and self._error is None and not self.closed and self._keep_alive

    def idle(self) -> None:
        """Between calls: any byte that arrives now is a fault of the agent's. The
        last answer's headers are let go (they may wait a whole wave for the next call)."""
        self._head = self._end = None
        self.headers.clear()

    def quiet(self, unread: array.array[int]) -> bool:
        """Has nothing arrived since its last answer? Bytes that wait in the socket,
        unread by the loop yet, came with no call waiting: the next call must not
        read them as its answer (a late second answer is the previous call's)."""
        if self._fd < 0:
            return True
        try:
            fcntl.ioctl(self._fd, termios.FIONREAD, unread)
        except OSError:
            return False
        return unread[0] == 0

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    # ---- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: no isinstance.
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1

    def get_buffer(self, sizehint: int) -> memoryview:
        direct = self._direct
        left = len(direct) - self._size if direct is not None else 0
        self._into_direct = left > _DIRECT_TAIL_BYTES
        if self._into_direct:
            assert direct is not None
            read = min(DIRECT_READ_BYTES, left - _DIRECT_TAIL_BYTES)
            return direct[self._size : self._size + read]
        return self._pool.scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._into_direct:
            self._size += nbytes
            self._pool.took_in(self, nbytes)
            return
        data = self._pool.scratch[:nbytes]
        direct = self._direct
        if direct is not None and not self._complete:
            # The direct body's tail; the bytes after it go to the parser.
            tail = min(nbytes, len(direct) - self._size)
            direct[self._size : self._size + tail] = data[:tail]
            self._size += tail
            self._pool.took_in(self, tail)
            if self._size < len(direct):
                return
            # The parser saw the head only: a fresh one reads what comes next.
            self._parser = _parser_for(self)
            self._finish()
            data = data[tail:]
            if not data:
                return
        self.data_received(data)

    def data_received(self, data: bytes | memoryview) -> None:
        if self._head is None:
            # Bytes nobody asked for: not a server to send another call to.
            self.close()
            return
        if not self.status and self._head_too_big(len(data)):
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self._complete:
                self.close()  # bytes after a whole answer (on_message_begin): it stands
            else:
                self._not_http(exc, data)
        self._pool.took_in(self, len(data))

    def _not_http(self, exc: httptools.HttpParserError, data: bytes | memoryview) -> None:
        """The answer broke HTTP/1.1: after a valid status line it was delivered
        (its call gets the head, its body the error), before one it was not."""
        answered = self.status
        status = answered or self._status_line(exc, data)
        if not status:
            self._fail(Disconnected(f"the agent's answer is not HTTP/1.1 ({exc})"))
            return
        self.status = status
        where = f"after its status line (HTTP {status})"
        self._fail(MalformedAnswer(f"the agent's answer {where} is not HTTP/1.1 ({exc})"))
        if not answered and self._head is not None:
            self._pool.answered(self._head)

    def _status_line(self, exc: httptools.HttpParserError, data: bytes | memoryview) -> int:
        """This answer's final status if its status line was read whole before ``exc``, else 0."""
        status = self._parser.get_status_code()
        if status < 200 or isinstance(exc, httptools.HttpParserInvalidStatusError):
            return 0
        # llhttp keeps the last answer's status until this one's digits are read:
        # it is this answer's once its bytes before ``data`` held a status line,
        # or ``data`` starts with one.
        before = self._head_bytes - len(data)
        if before >= _STATUS_LINE_BYTES or (before == 0 and _STATUS_LINE.match(data)):
            return status
        return 0

    def pause_reading(self) -> None:
        """Read no more until ``resume_reading``: the bytes wait in the socket."""
        if self._transport is not None and not self.closed:
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._transport is not None and not self.closed:
            self._transport.resume_reading()

    def _head_too_big(self, size: int) -> bool:
        self._head_bytes += size
        if self._head_bytes <= MAX_HEAD_BYTES:
            return False
        limit = f"{MAX_HEAD_BYTES} bytes"
        self._fail(Disconnected(f"the agent's answer sent {limit} without ending its headers"))
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        # Nothing more is fed to a closed connection: its parser, whose callbacks
        # are this connection's bound methods (a reference cycle that a long-lived
        # daemon's rare full GC passes would keep, buffers and all), goes.
        self._parser = _SPENT_PARSER
        if self._head is None or self._complete:
            return
        # (Whether the head is in is its status: the call it wakes may wait a turn.)
        if self.status and self._until_close and exc is None:
            self._finish()  # a body without a length ends when the connection does
            return
        where = "before its answer's end" if self.status else "before its answer"
        self._fail(Disconnected(f"the agent closed the connection {where}"))

    # ---- httptools callbacks ---------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._complete:
            # A second answer to one request: never read as the next call's.
            raise _AfterAnswer

    def on_header(self, name: bytes, value: bytes) -> None:
        if b"\0" in value:
            # The leniency that reads obs-fold lets a NUL through: RFC 9110 5.5 refuses it.
            raise ValueError("a NUL in a header value")
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            # 100 Continue and the like come before the answer: skip them.
            self._interim = True
            self.headers.clear()
            return
        self.status = status
        length, coded, identity = self._framing()
        self._until_close = length < 0 and not coded
        if coded:
            length = -1  # RFC 9112 6.3: a transfer coding overrides a Content-Length
        elif identity and length >= 0:
            # llhttp knows no "identity" and reads to the connection's end: the
            # length ends the answer here (``_identity_body``).
            self._identity_left = length
            if not length:
                self._finish()
        if self._inflate is None and DIRECT_BODY_BYTES <= length <= self._max_bytes:
            self._identity_left = -1  # a direct body ends at its size anyway
            self._direct = memoryview(body_buffer(length))
            # Asked now: the parser that knows it does not see the body's end.
            self._keep_alive = self._parser.should_keep_alive()
        if self._head is not None:
            self._pool.answered(self._head)

    def _framing(self) -> tuple[int, bool, bool]:
        """The answer's Content-Length (-1: none), whether a transfer coding frames
        it, whether it says ``Transfer-Encoding: identity``; its inflater, if any."""
        length, coded, identity = -1, False, False
        for name, value in self.headers:
            key = name.lower()
            if key == b"content-encoding":
                self._inflate = inflater_of(value)
            elif key == b"transfer-encoding":
                # "identity" is no transfer coding (RFC 9112 dropped it): no framing.
                identity = value.strip().lower() == b"identity"
                coded = coded or not identity
            # (llhttp has refused a length that is not one number, or two of them.)
            elif key == b"content-length" and value.strip().isdigit():
                length = int(value)
        return length, coded, identity

    def on_body(self, chunk: bytes) -> None:
        if self._error is not None:
            return
        if self._identity_left >= 0:
            self._identity_body(chunk)
            return
        if self._inflate is None:
            self.take(chunk)
            return
        try:
            self._inflate.feed(chunk, self)
        except zlib.error as exc:
            self._fail(Disconnected(f"the agent's answer does not inflate ({exc})"))

    def _identity_body(self, chunk: bytes) -> None:
        """A piece of an identity answer with a length: the body up to the length,
        then the answer is whole; bytes past it close the connection."""
        left = self._identity_left
        if self._complete or not left:
            raise _AfterAnswer
        self._identity_left = -1
        self.on_body(chunk[:left])
        self._identity_left = max(0, left - len(chunk))
        if self._identity_left or self._error is not None:
            return
        self._finish()  # (never kept alive: llhttp still reads to the connection's end)
        if len(chunk) > left:
            raise _AfterAnswer

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._keep_alive = self._parser.should_keep_alive()
        self._finish()

    # ---- the body as it arrives ---------------------------------------------------

    def room(self) -> int:
        """Bytes the body may still grow by before it breaks the cap."""
        return self._max_bytes - self._size

    def take(self, chunk: bytes) -> None:
        """Keep a piece of the (inflated) body; past the cap, the call fails."""
        if self._direct is not None:
            # The body's start, read with its head (the parser stops at its length).
            self._direct[self._size : self._size + len(chunk)] = chunk
            self._size += len(chunk)
            return
        self._chunks.append(chunk)
        self._size += len(chunk)
        if self._size > self._max_bytes:
            error = BodyLimitError(
                "ResponseTooLarge", too_large_message(self._max_bytes), self._prefix()
            )
            self._fail(error)

    def _prefix(self) -> bytes:
        if self._direct is not None:
            return bytes(self._direct[: min(self._size, PARTIAL_KEEP_BYTES)])
        return partial_prefix(self._chunks)

    def _finish(self) -> None:
        if self._inflate is not None and self._error is None:
            try:
                self._inflate.flush(self)
            except zlib.error as exc:
                self._fail(MalformedAnswer(f"the agent's answer is cut short ({exc})"))
                return
        self._complete = True
        wake(self._end)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._chunks.clear()
        self._direct = None
        self.close()
        # A head already in stands, even while its call waits for its turn to
        # be woken: the error is its body's, and the answer was delivered.
        if self._head is not None and not self._head.done() and not self.status:
            self._head.set_exception(error)
        wake(self._end)
