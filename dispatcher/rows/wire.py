"""Big answers kept as the bytes that will be written (contracts §3, §4).

A row of megabytes (token ids and logprobs of a long trajectory) costs about
six times its size as Python objects, and parsing it holds the loop for tens
of milliseconds. The dispatcher only reads its own keys (``_ng_*``) of an
answer, so a big answer is split at its top level instead: the whole body is
validated, the dispatcher's keys are decoded, and every other value stays a
slice of the agent's body (``msgspec.Raw``, no copy) that is written out
unchanged.

Content is what a parse and merge would give (``{**result, **ours}``, same
keys, same order), and numbers keep the agent's exact text: a big int or a
long float is never rounded through a Python float.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from dispatcher import jsonx
from dispatcher.delivery.client import Classified, classify_object, classify_response
from dispatcher.delivery.limits import Body
from dispatcher.files.writer import Line, Pieces
from dispatcher.tasks.keys import RESERVED_SUCCESS_KEYS, split_row
from dispatcher.tasks.schema import MASK_SAMPLE, REWARD

# Keys the dispatcher reads or overwrites are decoded (build.py compares the
# reserved ones with its own values, a row's facts are the agent's reward and
# mask, rows/finalize.py); everything else is bytes.
OWN_PREFIX = "_ng_"
_DECODED = RESERVED_SUCCESS_KEYS | {REWARD, MASK_SAMPLE}
_ENCODER = msgspec.json.Encoder()


class WireResult(dict[str, Any]):
    """An agent's result split at its top level.

    Values of the dispatcher's own keys are decoded; the others are
    ``msgspec.Raw`` slices of the body, which ``row_line`` writes back byte
    for byte. ``decoded`` gives plain values to a reader that needs them.
    """

    def decoded(self) -> Mapping[str, Any]:
        """A read-only view that decodes a kept value only when it is read."""
        return DecodedView(self)


class DecodedView(Mapping[str, Any]):
    """A ``WireResult``, or a row made of one, as plain JSON values, each decoded
    when it is read."""

    def __init__(self, result: Mapping[str, Any]) -> None:
        self._result = result

    def __getitem__(self, key: str) -> Any:
        value = self._result[key]
        return msgspec.json.decode(value) if isinstance(value, msgspec.Raw) else value

    def __contains__(self, key: object) -> bool:
        # Not ``Mapping``'s, which decodes the value to say it is there.
        return key in self._result

    def __iter__(self) -> Iterator[str]:
        return iter(self._result)

    def __len__(self) -> int:
        return len(self._result)


@dataclass(frozen=True, slots=True)
class Split:
    """Where each top-level value of a body lies (``key, start, end``, in order),
    and the dispatcher's own keys decoded: small, so a worker process can send it back."""

    spans: list[tuple[str, int, int]]
    own: dict[str, Any]


def classify_big(status: int, raw: Body) -> Classified:
    """``classify_response`` for a big 2xx body, without parsing its values.

    Runs in a worker. Falls back to the full parse when the body holds
    something the splitter alone cannot vouch for (see ``split_body``).
    """
    if not 200 <= status < 300:
        return classify_response(status, raw)
    split = split_body(raw)
    if split is None:
        # The full parse names the fault the same way for every body size.
        return classify_response(status, raw)
    return classify_object(status, raw, wire_result(raw, split))


def split_body(raw: Body) -> Split | None:
    """Validate ``raw`` and find its top-level values; None when only the full parse will do.

    A body it splits is one the full parse accepts (``numbers_in_range``, ``_splittable``).
    """
    if not _splittable(raw):
        return None
    try:
        top = split_row(raw)
        spans = None if top is None else _spans(raw, top)
        if top is None or spans is None or not numbers_in_range(raw):
            return None
        own = {key: msgspec.json.decode(value) for key, value in top.items() if _is_own(key)}
    except RecursionError:
        # Nested deeper than the decoder goes: the full parse names it as for any size.
        return None
    return Split(spans, own)


def wire_result(raw: Body, split: Split) -> WireResult:
    """The result a split stands for: kept values are slices of ``raw`` (no copy)."""
    view = memoryview(raw)
    result = WireResult()
    for key, start, end in split.spans:
        result[key] = split.own[key] if key in split.own else msgspec.Raw(view[start:end])
    return result


def _is_own(key: str) -> bool:
    return key.startswith(OWN_PREFIX) or key in _DECODED


_WHITESPACE = b" \t\n\r"


def _spans(raw: Body, top: dict[str, msgspec.Raw]) -> list[tuple[str, int, int]] | None:
    """Each value's place in ``raw``, walking the top level token by token.

    None unless the walk meets every decoded value exactly where it lies and
    nothing else: a repeated key (which the decoded dict folds) fails it.
    """
    pos = _token(raw, 0, b"{")
    spans: list[tuple[str, int, int]] = []
    for key, value in top.items():
        if spans:
            pos = _token(raw, pos, b",")
        pos = _value_start(raw, pos)
        if pos < 0 or not raw.startswith(value, pos):
            return None
        spans.append((key, pos, pos + len(value)))
        pos += len(value)
    end = _token(raw, pos, b"}")
    return spans if end >= 0 and _skip(raw, end) == len(raw) else None


def _value_start(raw: Body, pos: int) -> int:
    """Where the value after the key at ``pos`` and its colon begins, or -1."""
    key_end = _string_end(raw, _skip(raw, pos)) if pos >= 0 else -1
    colon_end = _token(raw, key_end, b":")
    return _skip(raw, colon_end) if colon_end >= 0 else -1


def _skip(raw: Body, pos: int) -> int:
    while pos < len(raw) and raw[pos] in _WHITESPACE:
        pos += 1
    return pos


def _token(raw: Body, pos: int, token: bytes) -> int:
    """The position after ``token`` (whitespace before it skipped), or -1."""
    if pos < 0:
        return -1
    pos = _skip(raw, pos)
    return pos + 1 if raw.startswith(token, pos) else -1


def _string_end(raw: Body, pos: int) -> int:
    """The position after the JSON string that starts at ``pos``, or -1."""
    if not raw.startswith(b'"', pos):
        return -1
    quote = pos
    while (quote := raw.find(b'"', quote + 1)) >= 0:
        text = raw[pos + 1 : quote]
        escapes = len(text) - len(text.rstrip(b"\\"))
        if escapes % 2 == 0:
            return quote + 1
    return -1


def _splittable(raw: Body) -> bool:
    """True when splitting ``raw`` at its top level is exactly as strict as orjson.

    The splitter does not check UTF-8 inside strings (it does check escapes: a
    lone surrogate is refused, a pair kept as written), and kept values are
    written as they came: a newline between tokens would break the JSON-lines file.
    """
    if b"\n" in raw or b"\r" in raw:
        return False
    if not raw.isascii():
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return False
    return True


# Skipping a value checks a number's grammar, not its range: 1e400 or an integer
# of more digits than the full parse reads (4,300) would be kept where that parse
# refuses the body. Only a number with an exponent of 3 digits or more, or a run
# of 200 digits or more (a 2-digit exponent cannot lift fewer to 1.8e308), can be
# one of them. They are looked for in the body's shape (every digit "0", a sign
# "+", an exponent "e"), where the search is for literals: 33 ms with the shape
# on a 22 MB row, where one regular expression on the body takes 134 ms for the
# exponents alone. Each suspect found is decoded alone, which is exact.
_SHAPE = bytes.maketrans(b"0123456789+-eE", b"0000000000++ee")
_EXPONENT = re.compile(rb"e\+?000")
_LONG_RUN = b"0" * 200
_NUMBER_BYTES = frozenset(b"0123456789.eE+-")
_BEFORE_VALUE = frozenset(b":,[ \t\n\r")
_NUMBER = re.compile(rb"[0-9.eE+-]+")
# Past this many suspects (hex ids in strings hold some), the full parse is
# cheaper: a suspect costs about 1.5 us, the full parse 5 ns a byte (20 us for 4 KB).
_MIN_SUSPECTS = 64
_BYTES_PER_SUSPECT = 4096
# The longest run looked back over for a suspect's first byte.
_MAX_LOOKBACK = 64
_DECODER = msgspec.json.Decoder()


def numbers_in_range(raw: Body) -> bool:
    """Whether no number in ``raw`` (a JSON object: ``split_row`` read it) is one the
    full parse refuses; False also when the look would cost more than that parse."""
    shape = raw.translate(_SHAPE)
    left = _MIN_SUSPECTS + len(raw) // _BYTES_PER_SUSPECT
    for find in (_next_exponent, _next_long_run):
        at = find(shape, 0)
        while at != -1:
            left -= 1
            end = _suspect_end(raw, at) if left >= 0 else -1
            if end < 0:
                return False
            at = find(shape, end)
    return True


def _next_exponent(shape: Body, pos: int) -> int:
    match = _EXPONENT.search(shape, pos)
    return -1 if match is None else match.start()


def _next_long_run(shape: Body, pos: int) -> int:
    return shape.find(_LONG_RUN, pos)


def _suspect_end(raw: Body, at: int) -> int:
    """The end of the run of number bytes around ``at``, or -1 when it is a number
    the full parse refuses (or may be one)."""
    start = at
    while start > 0 and raw[start - 1] in _NUMBER_BYTES:
        start -= 1
        if at - start > _MAX_LOOKBACK:
            return -1
    match = _NUMBER.match(raw, start)
    assert match is not None
    # Outside strings a number follows one of these: after anything else the run
    # is text inside a string, which no range applies to.
    if start > 0 and raw[start - 1] not in _BEFORE_VALUE:
        return match.end()
    try:
        _DECODER.decode(match[0])
    except msgspec.DecodeError:
        return -1
    return match.end()


def row_line(row: Mapping[str, Any]) -> Line:
    """The line appended for ``row``: one JSON object and its newline."""
    try:
        # Most rows hold no kept value: try the plain encoder before looking.
        return jsonx.dumps(row, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        # orjson refuses a ``msgspec.Raw`` at once, before it encodes what follows.
        if not any(isinstance(value, msgspec.Raw) for value in row.values()):
            raise
    return _kept_line(row)


# A kept value this big stays where it lies in the agent's body, a piece of
# the line of its own (``Pieces``); the rest of the line is joined around it.
PIECE_BYTES = 64 << 10


def _kept_line(row: Mapping[str, Any]) -> Line:
    """A row with kept values, copied into the line as they are.

    Big ones are not copied at all: the line is then ``Pieces``, written by
    ``writev(2)`` from the body itself, with the GIL released.
    """
    pieces: list[bytes | memoryview] = []
    run: list[bytes | msgspec.Raw] = []
    sep = b"{"
    for key, value in row.items():
        run.append(sep + _ENCODER.encode(key) + b":")
        sep = b","
        if isinstance(value, msgspec.Raw) and len(value) >= PIECE_BYTES:
            pieces += (b"".join(run), memoryview(value))
            run = []
        else:
            run.append(value if isinstance(value, msgspec.Raw) else _ENCODER.encode(value))
    run.append(b"}\n" if row else b"{}\n")
    if not pieces:
        return b"".join(run)
    pieces.append(b"".join(run))
    return Pieces(tuple(pieces), sum(memoryview(piece).nbytes for piece in pieces))
