"""A job's admit channel, the client's end (contracts §12): ``AsyncClient.admit_channel``.

A caller that raises a job's ``admit`` each time it takes a result sends each
new total as one WebSocket message on a connection kept open, not a request
each: nothing waits for the daemon's answer, so a result handed to the
trainer is not held up by the admission it frees. A channel the daemon
closed (a restart, a bad message) raises ``ClientError`` at the next
``send``; the caller goes on with ``AsyncClient.admit`` (a running total: a
total sent twice, or late, changes nothing).
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from dispatcher.aio import cancel_and_wait
from dispatcher.client.wire import ClientError


class AdmitChannel:
    """An open admit channel of one job; ``send`` each new total, ``aclose`` at the end."""

    def __init__(self, job_id: str, socket: aiohttp.ClientWebSocketResponse) -> None:
        self.job_id = job_id
        self._socket = socket
        self._reason: str | None = None  # the daemon's, when it closed the channel
        # Reads what the daemon sends: pings (answered as they are read) and its close.
        self._reader = asyncio.get_running_loop().create_task(
            self._read(), name=f"admit-channel:{job_id}"
        )

    @property
    def closed(self) -> bool:
        return self._socket.closed

    async def send(self, admit: int) -> None:
        """Let the job have started ``admit`` rollouts in all: the message is written
        (waiting only while the connection's buffer is full), not answered.
        ``ClientError`` once the channel is closed."""
        if self._socket.closed:
            raise ClientError(None, self._closed_message())
        try:
            await self._socket.send_str(f'{{"admit":{admit:d}}}')
        except (ConnectionError, aiohttp.ClientError) as exc:
            raise ClientError(None, f"{self._closed_message()}; {exc}") from None

    async def aclose(self) -> None:
        """Close the channel (a close frame, the daemon's answer awaited briefly)."""
        # One already gone has nothing to close.
        with contextlib.suppress(ConnectionError, aiohttp.ClientError):
            await self._socket.close()
        await cancel_and_wait(self._reader, reraise=False)

    async def _read(self) -> None:
        """Until the channel closes: the daemon sends nothing but pings and its close."""
        while True:
            message = await self._socket.receive()
            if message.type is aiohttp.WSMsgType.CLOSE:
                self._reason = message.extra or None
            if message.type in _ENDS:
                return

    def _closed_message(self) -> str:
        error = self._socket.exception()
        reason = self._reason or (str(error) if error is not None else None)
        why = f": {reason}" if reason else ""
        return f"the admit channel of {self.job_id} is closed (code {self._socket.close_code}){why}"


_ENDS = frozenset(
    {
        aiohttp.WSMsgType.CLOSE,
        aiohttp.WSMsgType.CLOSING,
        aiohttp.WSMsgType.CLOSED,
        aiohttp.WSMsgType.ERROR,
    }
)
