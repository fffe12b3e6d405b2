"""Request bodies, bounded whatever the clients send (contracts §12).

- ``BodyBudget``: the bytes of request bodies being read and parsed at once,
  daemon-wide (``--max-body-bytes-in-flight``). A request takes its
  ``Content-Length`` (the per-request cap when it sends none) before its body
  is read, and gives it back once answered: six clients sending 250 MB each
  at once are read one after another, not all into memory together. A body
  not yet read stays in the kernel's buffers (aiohttp stops reading a
  connection whose handler does not read).
- ``load_json``: a body parsed, refused (``BadBody``, a 400 on one line)
  when it is not JSON or nests deeper than ``MAX_JSON_DEPTH``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson

# Deeper than any job body needs; far below what breaks a parser or a dump
# (orjson writes at most 254 levels).
MAX_JSON_DEPTH = 64

_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_STRING = re.compile(rb'"[^"]*"')
_NOT_A_BRACKET = bytes(c for c in range(256) if c not in b"[]{}")
_INNERMOST = re.compile(rb"\[\]|\{\}|\[\}|\{\]")


class BadBody(Exception):
    """A request body that cannot be used: a 400 with this one-line message."""


class BodyBudget:
    """Bytes of request bodies in hand, against a daemon-wide bound."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        # Requests waiting for room (their bodies not read yet).
        self.waiting = 0
        self._changed = asyncio.Condition()

    @asynccontextmanager
    async def hold(self, size: int) -> AsyncIterator[None]:
        """Wait for room for ``size`` bytes (at most the capacity), hold it meanwhile."""
        size = min(size, self.capacity)
        async with self._changed:
            self.waiting += 1
            try:
                await self._changed.wait_for(lambda: self.held + size <= self.capacity)
            finally:
                self.waiting -= 1
            self.held += size
        try:
            yield
        finally:
            async with self._changed:
                self.held -= size
                self._changed.notify_all()


def load_json(body: bytes) -> Any:
    """A body's JSON value; ``BadBody`` for one that is not JSON or is nested too deep."""
    too_deep = f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels"
    try:
        value = orjson.loads(body)
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
