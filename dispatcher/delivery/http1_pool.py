"""The pool of the agent calls' HTTP/1.1 connections (``http1.py``): keep-alive
connections per replica, the most recently used taken first, each reused by one
call at a time; new ones made within the connect timeout, with TLS for an
``https`` replica.
"""

from __future__ import annotations

import array
import asyncio
import ssl

from dispatcher.delivery.http1 import Connection
from dispatcher.delivery.http1_errors import ConnectTimeout
from dispatcher.delivery.target import Target
from dispatcher.delivery.turns import TurnBounds

# Every other read lands here first; one buffer serves the whole pool, as the
# loop hands each read to its connection before it makes the next.
_SCRATCH_BYTES = 256 * 1024


class Http1Pool(TurnBounds):
    """Keep-alive connections to the replicas, each reused by one call at a time.

    ``post`` returns the connection holding the answer; ``release`` gives it
    back (kept when its answer was read whole and the agent keeps it alive,
    else closed). At most ``max_idle`` connections per replica wait idle.
    """

    def __init__(self, connect_timeout_s: float | None, max_idle: int = 1024) -> None:
        super().__init__()
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._idle: dict[str, list[Connection]] = {}
        self._open: set[Connection] = set()
        # (host, port) of every target that ever accepted a connection: an agent
        # none of whose replicas is here was never up (``AgentClient.never_reached``).
        self.reached: set[tuple[str, int]] = set()
        self._tls: ssl.SSLContext | None = None
        self.closed = False
        self.scratch = memoryview(bytearray(_SCRATCH_BYTES))
        # What FIONREAD says waits in an idle connection's socket (``Connection.quiet``).
        self._unread = array.array("i", [0])

    async def post(self, target: Target, body: bytes, max_bytes: int) -> Connection:
        """``POST`` ``body``; the connection once the answer's status line is in.

        (The agent calls do the same inline: ``exchange.post_run``.)
        """
        conn = self.reused(target) or await self.connect(target)
        try:
            await conn.send(target.head, body, max_bytes)
        except BaseException:
            conn.close()
            raise
        return conn

    def release(self, conn: Connection, target: Target) -> None:
        idle = self._idle.setdefault(target.origin, [])
        # A call that ends after ``close`` (shutdown) must not leave its connection open.
        if conn.reusable() and not self.closed and len(idle) < self.max_idle:
            conn.idle()
            idle.append(conn)
        else:
            conn.close()

    def forget(self, conn: Connection) -> None:
        self._open.discard(conn)

    async def close(self) -> None:
        """Close every connection, idle or in a call."""
        self.closed = True
        self._idle.clear()
        for conn in list(self._open):
            conn.close()
        # Let the transports' close callbacks run before the loop goes.
        await asyncio.sleep(0)

    def reused(self, target: Target) -> Connection | None:
        """An idle connection to ``target``, the most recently used first; None if none."""
        idle = self._idle.get(target.origin)
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            # One system call, no object made: about 1 us more for a reused call.
            if conn.quiet(self._unread):
                return conn
            conn.close()
        return None

    async def connect(self, target: Target) -> Connection:
        """A new connection to ``target`` (``ConnectTimeout`` past the connect timeout)."""
        loop = self._loop = asyncio.get_running_loop()
        tls = self._tls_context() if target.tls else None
        conn = Connection(self)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                # asyncio's own bound on a handshake (60 s) is not ours to keep.
                handshake_s = self.connect_timeout_s if tls is not None else None
                await loop.create_connection(
                    lambda: conn,
                    target.host,
                    target.port,
                    ssl=tls,
                    ssl_handshake_timeout=handshake_s,
                )
        except TimeoutError:
            conn.close()
            raise ConnectTimeout(
                f"no connection to {target.host}:{target.port} within {self.connect_timeout_s} s"
            ) from None
        self._open.add(conn)
        self.reached.add((target.host, target.port))
        return conn

    def _tls_context(self) -> ssl.SSLContext:
        # Made on first use: loading the system's CA store costs ~35 ms.
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls
