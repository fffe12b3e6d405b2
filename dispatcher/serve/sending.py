"""Sending a results stream to a peer that may not read it (contracts §12).

What a stream holds is bounded whatever its peer does:

- Backpressure: the connection's write buffer has its high-water mark at
  ``--stream-buffer-bytes``; once it is over, ``send`` waits until the peer
  has taken enough, and the stream reads no more rows meanwhile. A stream
  holds at most about the bound plus one chunk (itself bounded by it, or one
  row bigger than it).
- Idle peers: a peer that takes nothing for ``--stream-idle-timeout-s``
  while the stream has something to send is cut (``StreamIdle``): its
  buffer is dropped and its connection closed. A stream cut without its end
  line was cut, and the client resumes it with ``after=``.
- A daemon-wide number of streams (``--max-streams``): ``Slots`` counts them;
  over it, a stream is refused with a 503 before anything is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Awaitable

from aiohttp import web

from dispatcher.aio import cancel_and_wait


class StreamIdle(Exception):
    """The peer took nothing for the idle timeout."""


class Slots:
    """How many results streams are open, against the daemon's bound."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0

    def take(self) -> bool:
        """Take a slot; False when all are taken."""
        if self.open >= self.limit:
            return False
        self.open += 1
        return True

    def give_back(self) -> None:
        self.open -= 1


class StreamResponse(web.StreamResponse):
    """A results stream's response: its headers go out with its first bytes, in one
    write (the stream sends an empty chunk before it first waits, so a waiting
    client has them then)."""

    _send_headers_immediately = False


class Sender:
    """Writes a stream's chunks to its peer, bounded and with an idle timeout."""

    def __init__(self, request: web.Request, response: web.StreamResponse, *, buffer_bytes: int,
                 idle_s: float) -> None:  # fmt: skip
        self.response = response
        self.idle_s = idle_s
        self.buffer_bytes = buffer_bytes
        self.transport = request.transport
        if self.transport is not None:
            # Paused (and so ``write`` waits) once this much is unsent.
            self.transport.set_write_buffer_limits(high=buffer_bytes)

    async def write(self, chunk: bytes) -> None:
        if self._fits(chunk):
            # The chunk fits under the buffer's limit: the transport stays unpaused,
            # so the write cannot wait on the peer and needs no idle watch (a task
            # and a wait: two turns of the loop per chunk, each behind every
            # callback due; at 10,000 in flight, most of a group's delivery delay).
            await self.response.write(chunk)
            return
        await self._progressing(self.response.write(chunk))

    async def write_eof(self, chunk: bytes = b"") -> None:
        """The last chunk and the stream's end, in one write."""
        if self._fits(chunk):
            await self.response.write_eof(chunk)
            return
        await self._progressing(self.response.write_eof(chunk))

    def _fits(self, chunk: bytes) -> bool:
        return self.transport is not None and self._unsent() + len(chunk) < self.buffer_bytes

    async def _progressing(self, send: Awaitable[None]) -> None:
        """Await ``send`` while the peer takes something every ``idle_s``; else
        ``StreamIdle`` (after the buffer is dropped and the connection closed)."""
        task = asyncio.ensure_future(send)
        try:
            unsent = self._unsent()
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.idle_s)
                if done:
                    task.result()
                    return
                now = self._unsent()
                if now >= unsent:
                    self.abort()
                    raise StreamIdle(f"the client took nothing for {self.idle_s:g} s")
                unsent = now
        finally:
            if not task.done():
                await cancel_and_wait(task, reraise=False)

    def gone(self) -> bool:
        """Whether the client closed the connection."""
        return self.transport is None or self.transport.is_closing()

    def _unsent(self) -> int:
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

    def abort(self) -> None:
        """Drop what is unsent, in the kernel too, and close the connection (a reset)."""
        if self.transport is None:
            return
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            # Without a linger of 0, a close still sends what the kernel holds
            # to a peer that takes nothing; with it, the connection is reset.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()
