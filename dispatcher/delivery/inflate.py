"""An answer's Content-Encoding undone as it arrives (``http1.Connection``).

Each step inflates no more than the body's room under its cap, so a small
compressed answer that inflates to gigabytes stops at the cap, not at the
memory's end.
"""

from __future__ import annotations

import zlib
from typing import Protocol

# Content-Encodings inflated (by the capture's records too); wbits 47 reads a
# gzip or a zlib header.
INFLATED = frozenset({b"gzip", b"x-gzip", b"deflate"})
GZIP_OR_ZLIB = 47
_RAW_DEFLATE = -zlib.MAX_WBITS


class Sink(Protocol):
    """Where the inflated bytes go: a body and its cap."""

    def room(self) -> int:
        """Bytes the body may still grow by before it breaks the cap."""
        ...

    def take(self, chunk: bytes) -> None:
        """Keep a piece of the body; past the cap, the call fails."""
        ...


class Inflater:
    """A Content-Encoding undone in steps no bigger than the body's room under its cap."""

    def __init__(self, deflate: bool) -> None:
        self._zlib = zlib.decompressobj(GZIP_OR_ZLIB)
        # "deflate" is zlib-wrapped by the standard, raw by some servers: the
        # first chunk tells which.
        self._retry_raw = deflate

    def feed(self, chunk: bytes, into: Sink) -> None:
        try:
            self._steps(chunk, into)
        except zlib.error:
            if not self._retry_raw:
                raise
            self._zlib = zlib.decompressobj(_RAW_DEFLATE)
            self._steps(chunk, into)
        self._retry_raw = False

    def _steps(self, data: bytes, into: Sink) -> None:
        while data and into.room() >= 0:
            # max_length 0 means no bound: room + 1 is at least 1 here.
            into.take(self._zlib.decompress(data, into.room() + 1))
            data = self._zlib.unconsumed_tail

    def flush(self, into: Sink) -> None:
        rest = self._zlib.flush()
        if rest:
            into.take(rest)
