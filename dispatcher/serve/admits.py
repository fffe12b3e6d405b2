"""A job's admit channel (contracts §12): ``GET /v1/jobs/<id>/admit`` as a WebSocket.

A caller that raises a job's ``admit`` each time it takes a result (the Gym
drop-in's window of resident tasks, ``window.py``) sends each new total as a
text message ``{"admit": N}`` on one connection it keeps open, where
``POST /v1/jobs/<id>/admit`` is a request each: a frame costs both sides a
fraction of a request, and the caller waits for no answer. A message is
applied as that POST's body is (a running total, never lowered; a final
job's is kept as it was), in the wake-up of its arrival.

The daemon sends nothing but pings. A message that is not such an object
closes the channel with code 1007 and a one-line reason naming the field; a
binary one with 1003. A channel is bounded as a results stream is: it takes
one of ``--max-streams`` (a 503 when none is free), a message is at most
``MAX_MESSAGE_BYTES``, and a peer that answers no ping within
``--stream-idle-timeout-s`` is closed.
"""

from __future__ import annotations

from aiohttp import WSCloseCode, WSMsgType, web

from dispatcher.serve.bodies import BadBody
from dispatcher.serve.served import ServedJob
from dispatcher.serve.spec import AdmitChange
from dispatcher.serve.submission import FoundJob

# ``{"admit": N}`` with N below 2^63 is 31 bytes: room for spaces, no more.
MAX_MESSAGE_BYTES = 256
# Where a bad message is, in its close reason.
WHERE = "admit channel message"
# A close frame's reason is at most 123 bytes.
_REASON_BYTES = 123


def upgrade_problem(request: web.Request) -> str | None:
    """Why ``request`` cannot open an admit channel (not a WebSocket upgrade), or None."""
    if web.WebSocketResponse().can_prepare(request).ok:
        return None
    return (
        "GET /v1/jobs/<id>/admit: not a WebSocket upgrade (the admit channel); "
        'POST {"admit": N} raises a job\'s admit once'
    )


async def admit_channel(
    request: web.Request, job: FoundJob, ping_s: float
) -> web.WebSocketResponse:
    """Apply each message of the channel to ``job`` until its peer closes it (or the
    daemon does, on a bad message or a missed ping)."""
    channel = web.WebSocketResponse(heartbeat=ping_s, max_msg_size=MAX_MESSAGE_BYTES)
    await channel.prepare(request)
    # Iteration ends at a close, an error (a message over the bound), or a missed pong.
    async for message in channel:
        if message.type is not WSMsgType.TEXT:
            await channel.close(code=WSCloseCode.UNSUPPORTED_DATA, message=b"binary message")
            break
        try:
            change = AdmitChange.parse(message.data.encode(), WHERE)
        except BadBody as exc:
            reason = str(exc).encode()[:_REASON_BYTES]
            await channel.close(code=WSCloseCode.INVALID_TEXT, message=reason)
            break
        if isinstance(job, ServedJob):
            job.window.admit(change.admit)
    return channel
