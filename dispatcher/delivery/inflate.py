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


def inflater_of(content_encoding: bytes) -> Inflater | None:
    """What undoes a Content-Encoding (``gzip``, ``deflate``, ``gzip, gzip``...),
    or None: nothing to undo, or a coding not known here (the body stays as sent)."""
    codings = [c.strip().lower() for c in content_encoding.split(b",")]
    codings = [c for c in codings if c and c != b"identity"]
    if not codings or any(c not in INFLATED for c in codings):
        return None
    # The last coding listed was applied last: it is undone first, into the others.
    stage: Inflater | None = None
    for coding in codings:
        stage = Inflater(coding == b"deflate", stage)
    return stage


class Inflater:
    """A Content-Encoding undone in steps no bigger than the body's room under its cap.

    A gzip body may hold several members (RFC 1952 2.2): each one's bytes are
    the body's. One whose stream has not ended when the body does is cut short
    (``flush`` raises ``zlib.error``).
    """

    def __init__(self, deflate: bool, then: Inflater | None = None) -> None:
        self._zlib = zlib.decompressobj(GZIP_OR_ZLIB)
        # "deflate" is zlib-wrapped by the standard, raw by some servers: the
        # first chunk tells which.
        self._retry_raw = deflate
        self._fed = False
        # The coding listed before this one: undone on what this one gives.
        self._then = then

    def _sink(self, into: Sink) -> Sink:
        """Where this stage's output goes: ``into``, or the coding undone after it."""
        return into if self._then is None else _Then(self._then, into)

    def feed(self, chunk: bytes, into: Sink) -> None:
        sink = self._sink(into)
        self._fed = True
        try:
            self._steps(chunk, sink)
        except zlib.error:
            if not self._retry_raw:
                raise
            self._zlib = zlib.decompressobj(_RAW_DEFLATE)
            self._steps(chunk, sink)
        self._retry_raw = False

    def _steps(self, data: bytes, into: Sink) -> None:
        while data and into.room() >= 0:
            if self._zlib.eof:
                self._zlib = zlib.decompressobj(GZIP_OR_ZLIB)  # the next member
            # max_length 0 means no bound: room + 1 is at least 1 here.
            into.take(self._zlib.decompress(data, into.room() + 1))
            data = self._zlib.unconsumed_tail or self._zlib.unused_data

    def flush(self, into: Sink) -> None:
        sink = self._sink(into)
        rest = self._zlib.flush()
        if rest:
            sink.take(rest)
        if self._fed and not self._zlib.eof:
            raise zlib.error("its compressed stream does not end")
        if self._then is not None:
            self._then.flush(into)


class _Then:
    """A stage's output fed to the coding undone after it, within the same room."""

    def __init__(self, stage: Inflater, into: Sink) -> None:
        self._stage = stage
        self._into = into

    def room(self) -> int:
        return self._into.room()

    def take(self, chunk: bytes) -> None:
        self._stage.feed(chunk, self._into)
