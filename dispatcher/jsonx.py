"""JSON that keeps integers exact: orjson on the hot path, the stdlib for big integers.

orjson reads an integer beyond 64 bits as a float (silently rounding it) and
refuses to write one. Task rows and agent results are other people's data and
may hold such integers (ids, hashes, seeds), so:

- ``loads`` parses with orjson, and again with the stdlib only when the text
  holds a run of 19 or more digits (only those can exceed 64 bits; a match
  inside a string just costs the slower parse);
- ``dumps`` falls back to the stdlib when orjson refuses an integer, writing
  the same compact form.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

_LONG_DIGITS = re.compile(rb"[0-9]{19}")
_BIG_INT_ERROR = "Integer exceeds 64-bit range"
# orjson options honoured by the fallback; any other option is not used here.
_SUPPORTED = orjson.OPT_APPEND_NEWLINE | orjson.OPT_SORT_KEYS


def loads(raw: bytes) -> Any:
    """Parse like ``orjson.loads`` (raising its ``JSONDecodeError``), integers kept exact."""
    value = orjson.loads(raw)
    if _LONG_DIGITS.search(raw) is None:
        return value
    return json.loads(raw)


def dumps(value: Any, option: int = 0) -> bytes:
    """Serialize like ``orjson.dumps``; integers beyond 64 bits are written exactly."""
    try:
        return orjson.dumps(value, option=option)
    except TypeError as exc:
        if _BIG_INT_ERROR not in str(exc) or option & ~_SUPPORTED:
            raise
    text = json.dumps(
        value,
        ensure_ascii=False,
        separators=(",", ":"),
        sort_keys=bool(option & orjson.OPT_SORT_KEYS),
        allow_nan=False,
    )
    data = text.encode("utf-8")
    return data + b"\n" if option & orjson.OPT_APPEND_NEWLINE else data
