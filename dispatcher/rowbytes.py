"""Big answers kept as the bytes that will be written (DESIGN A3, A4).

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
from typing import Any

import msgspec
import orjson

from dispatcher import jsonx
from dispatcher.agents import Classified, classify_object, classify_response
from dispatcher.rows import RESERVED_SUCCESS_KEYS

# Keys the dispatcher reads or overwrites are decoded (rows.py compares the
# reserved ones with its own values); everything else is bytes.
OWN_PREFIX = "_ng_"
# A surrogate escape is valid to the splitter but a lone one is not to orjson,
# which reads the output on resume: such bodies take the full parse.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abAB]")
_TOP_LEVEL = msgspec.json.Decoder(dict[str, msgspec.Raw])
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
    """``WireResult`` as plain JSON values, each decoded when it is read."""

    def __init__(self, result: WireResult) -> None:
        self._result = result

    def __getitem__(self, key: str) -> Any:
        value = self._result[key]
        return msgspec.json.decode(value) if isinstance(value, msgspec.Raw) else value

    def __iter__(self) -> Iterator[str]:
        return iter(self._result)

    def __len__(self) -> int:
        return len(self._result)


def classify_big(status: int, raw: bytes) -> Classified:
    """``classify_response`` for a big 2xx body, without parsing its values.

    Runs in a worker. Falls back to the full parse when the body holds
    something the splitter alone cannot vouch for (see ``_splittable``).
    """
    if not 200 <= status < 300 or not _splittable(raw):
        return classify_response(status, raw)
    try:
        top = _TOP_LEVEL.decode(raw)
    except msgspec.DecodeError:
        # The full parse names the fault the same way for every body size.
        return classify_response(status, raw)
    return classify_object(status, raw, split_result(top))


def _splittable(raw: bytes) -> bool:
    """True when splitting ``raw`` at its top level is exactly as strict as orjson.

    The splitter does not check UTF-8 inside strings, nor surrogate escapes,
    and kept values are written as they came: a newline between tokens would
    break the JSON-lines file.
    """
    if b"\n" in raw or b"\r" in raw:
        return False
    # A one-byte search runs at memchr speed; most big bodies hold no escape.
    escape = raw.find(b"\\")
    if escape != -1 and _SURROGATE_ESCAPE.search(raw, escape) is not None:
        return False
    if not raw.isascii():
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return False
    return True


def split_result(top: dict[str, msgspec.Raw]) -> WireResult:
    """The top-level values: the dispatcher's keys decoded, the rest kept as they came."""
    result = WireResult()
    for key, value in top.items():
        ours = key.startswith(OWN_PREFIX) or key in RESERVED_SUCCESS_KEYS
        result[key] = msgspec.json.decode(value) if ours else value
    return result


def row_line(row: Mapping[str, Any]) -> bytes:
    """The line appended for ``row``: one JSON object and its newline."""
    if any(isinstance(value, msgspec.Raw) for value in row.values()):
        # Kept values are copied into the line as they are, in one pass.
        return _ENCODER.encode(row) + b"\n"
    return jsonx.dumps(row, option=orjson.OPT_APPEND_NEWLINE)
