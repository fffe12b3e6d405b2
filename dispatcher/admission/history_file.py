"""The task history's file (``history.py``): one JSON line per update of a task,
``{"t": digest, "s": average}``, written a batch of lines at a time and read back
whole when a history loads.
"""

from __future__ import annotations

import math
import operator

import msgspec
import orjson


class Update(msgspec.Struct):
    """An update line: the task's digest and its new average (seconds)."""

    t: str
    s: float


_DECODER = msgspec.json.Decoder(Update)
_ENCODER = msgspec.json.Encoder()


def update_line(update: tuple[int, float]) -> bytes:
    """An update's line, ``{"t":"<32 hex digits>","s":<repr of the average>}``.
    A finite float's repr is a JSON number that reads back as the same float."""
    return b'{"t":"%032x","s":%r}\n' % update


def update_lines(updates: list[tuple[int, float]]) -> bytes:
    """``update_line`` of each update, the averages rendered in one call (orjson's shortest
    form reads back as the same float, as a repr does): half the time of a line each."""
    numbers = orjson.dumps(list(map(_AVERAGE_OF, updates)))[1:-1].split(b",")
    return b"".join(map(_LINE.__mod__, zip(map(_KEY, updates), numbers, strict=True)))


_LINE = b'{"t":"%032x","s":%s}\n'
_KEY = operator.itemgetter(0)
_AVERAGE_OF = operator.itemgetter(1)


def parse_updates(data: bytes) -> tuple[list[str], list[float]]:
    """The digests and averages of the update lines of ``data``, in order: all at
    once, or a line at a time when one is torn or foreign (skipped)."""
    try:
        updates = _DECODER.decode_lines(data)
    except msgspec.DecodeError:
        updates = [u for u in map(_parse, data.split(b"\n")) if u is not None]
    averages = list(map(_AVERAGE, updates))
    # Each is a non-negative number (the sum is NaN or infinite otherwise): checked in C.
    if not (min(averages, default=0.0) >= 0.0 and sum(averages) < math.inf):
        updates = [u for u in updates if 0.0 <= u.s < math.inf]
        averages = list(map(_AVERAGE, updates))
    return list(map(_DIGEST, updates)), averages


_DIGEST = operator.attrgetter("t")
_AVERAGE = operator.attrgetter("s")


def _parse(line: bytes) -> Update | None:
    """One update line; None for a torn or foreign one (skipped)."""
    try:
        update = _DECODER.decode(line)
    except msgspec.DecodeError:
        return None
    return update
