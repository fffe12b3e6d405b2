"""Request bodies, bounded whatever the clients send (contracts §12).

- ``BodyBudget``: the bytes of request bodies in hand (read and not yet
  answered), daemon-wide (``--max-body-bytes-in-flight``). Bytes are counted
  as they arrive, never before: a client that announces 256 MiB and goes
  quiet holds what it sent, so the requests of the control plane go on. A
  chunk that finds no room waits for it; when every body that holds bytes
  waits so, none could ever finish, and the youngest gives way (``NoRoom``, a
  503 its client retries). A body not yet read stays in the kernel's buffers
  (aiohttp stops reading a connection whose handler does not read).
- ``read_body``: a body read in chunks into the budget, at most
  ``--max-body-bytes``; the caller bounds it in time (``--body-timeout-s``).
- ``load_json``: a body parsed, refused (``BadBody``, a 400 on one line)
  when it is not JSON or nests deeper than ``MAX_JSON_DEPTH``; integers of
  any size stay exact (``jsonx``), as they do in a task file.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from aiohttp import StreamReader

from dispatcher import jsonx

# Deeper than any job body needs; far below what breaks a parser or a dump
# (orjson writes at most 254 levels).
MAX_JSON_DEPTH = 64
# What one read takes from a connection: a stalled body holds at most its bytes.
CHUNK_BYTES = 64 * 1024

_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_STRING = re.compile(rb'"[^"]*"')
_NOT_A_BRACKET = bytes(c for c in range(256) if c not in b"[]{}")
_INNERMOST = re.compile(rb"\[\]|\{\}|\[\}|\{\]")


class BadBody(Exception):
    """A request body that cannot be used: a 400 with this one-line message."""


class BodyTooBig(Exception):
    """A body past ``--max-body-bytes`` as it arrived (none was announced): a 413."""


class NoRoom(Exception):
    """Every body in hand waits for room: this one, the youngest, gives way (a 503)."""


class Reading:
    """One request body being read: the bytes of it the budget counts."""

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.held = 0
        self.waiting = False
        self.evicted = False


class BodyBudget:
    """Bytes of request bodies in hand, against a daemon-wide bound."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        # Bodies waiting for room for bytes that arrived.
        self.waiting = 0
        self._readings: set[Reading] = set()
        self._seq = itertools.count()
        self._changed = asyncio.Condition()

    @asynccontextmanager
    async def reading(self) -> AsyncIterator[Reading]:
        """One body's share of the budget, given back whole once it is answered."""
        reading = Reading(next(self._seq))
        self._readings.add(reading)
        try:
            yield reading
        finally:
            self._readings.discard(reading)
            async with self._changed:
                self.held -= reading.held
                self._changed.notify_all()

    async def take(self, reading: Reading, size: int) -> None:
        """Count ``size`` bytes that arrived for ``reading`` once there is room for them;
        ``NoRoom`` when it is the youngest of bodies that all wait for room."""
        async with self._changed:
            if self.held + size > self.capacity:
                await self._wait_for_room(reading, size)
            self.held += size
            reading.held += size

    async def _wait_for_room(self, reading: Reading, size: int) -> None:
        reading.waiting = True
        self.waiting += 1
        try:
            self._unless_stuck()
            await self._changed.wait_for(
                lambda: reading.evicted or self.held + size <= self.capacity
            )
        finally:
            reading.waiting = False
            self.waiting -= 1
        if reading.evicted:
            raise NoRoom(
                f"body: --max-body-bytes-in-flight {self.capacity} is taken by bodies being "
                "read; retry"
            )

    def _unless_stuck(self) -> None:
        # Bodies that hold bytes and all wait for room would wait for ever: the
        # youngest lets go of its bytes, so the older ones finish.
        holders = [r for r in self._readings if r.held]
        if holders and all(r.waiting for r in holders):
            max(holders, key=lambda r: r.seq).evicted = True
            self._changed.notify_all()


async def read_body(content: StreamReader, reading: Reading, budget: BodyBudget,
                    limit: int) -> bytes:  # fmt: skip
    """A request body, each chunk counted in ``budget`` as it arrives; ``BodyTooBig``
    past ``limit`` bytes."""
    body = bytearray()
    chunk_bytes = min(CHUNK_BYTES, budget.capacity)
    while chunk := await content.read(chunk_bytes):
        if len(body) + len(chunk) > limit:
            raise BodyTooBig(f"body: more than --max-body-bytes {limit}")
        await budget.take(reading, len(chunk))
        body += chunk
    return bytes(body)


def load_json(body: bytes) -> Any:
    """A body's JSON value; ``BadBody`` for one that is not JSON or is nested too deep."""
    too_deep = f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels"
    try:
        value = jsonx.loads(body)
    except orjson.JSONDecodeError as exc:
        if "depth limit" in str(exc):
            raise BadBody(too_deep) from None
        raise BadBody(f"body: not valid JSON ({exc})") from None
    if nested_deeper(body, MAX_JSON_DEPTH):
        raise BadBody(too_deep)
    return value


def nested_deeper(body: bytes, limit: int) -> bool:
    """Whether the JSON text ``body`` nests arrays and objects deeper than ``limit``.

    In C-speed passes rather than a walk in Python: escapes and strings out,
    then only the brackets kept; each pass then removes the innermost pairs,
    so what is left after ``limit`` passes is deeper than ``limit``. Text
    that is not JSON may get either answer: parse it first.
    """
    brackets = _STRING.sub(b"", _ESCAPE.sub(b"", body)).translate(None, _NOT_A_BRACKET)
    for _ in range(limit):
        if not brackets:
            return False
        brackets = _INNERMOST.sub(b"", brackets)
    return bool(brackets)
