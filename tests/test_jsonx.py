"""jsonx: integers of any size kept exact; everything orjson refuses refused, as orjson's error."""

from __future__ import annotations

import re

import orjson
import pytest

from dispatcher import jsonx


def test_integers_of_any_size_round_trip_exactly() -> None:
    value = {
        "id": 2**70 + 1,
        "neg": -(2**80),
        "small": 7,
        "f": 0.1,
        "text": "é 12345678901234567890",
    }
    raw = jsonx.dumps(value)
    assert raw == b'{"id":1180591620717411303425,"neg":-1208925819614629174706176,"small":7,' \
        b'"f":0.1,"text":"\xc3\xa9 12345678901234567890"}'  # fmt: skip
    assert jsonx.loads(raw) == value
    assert jsonx.loads(raw.decode()) == value


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"{bad json", "object keys must be strings: line 1 column 2 (char 1)"),
        (b"[1,]", "trailing comma in array: line 1 column 4 (char 3)"),
        (b"{}x", "trailing characters"),
        (b'"\xff"', "Invalid UTF-8"),
        (b'"\\ud800"', "truncated"),  # a lone surrogate: it could not be written back
        (b"1e400", "out of range"),
        (b"NaN", "invalid character"),
        (b"[" * 5000 + b"]" * 5000, "depth limit exceeded"),
        (b"", "truncated"),
    ],
)
def test_what_orjson_refuses_is_refused_as_its_error(raw: bytes, says: str) -> None:
    with pytest.raises(orjson.JSONDecodeError) as refused:
        orjson.loads(raw)
    assert refused  # orjson refuses it too
    with pytest.raises(orjson.JSONDecodeError, match=re.escape(says)) as caught:
        jsonx.loads(raw)
    assert "(byte" not in str(caught.value)


def test_an_indented_document_with_a_big_integer_is_written_exactly() -> None:
    # Manifests are written indented: a job's params may hold such an integer.
    value = {"b": [1, 2], "a": 10**30}
    written = jsonx.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
    assert jsonx.loads(written) == value
    small = {"b": [1, 2], "a": 1}
    fallback = jsonx.dumps({**small, "a": 10**30}, option=orjson.OPT_INDENT_2)
    assert fallback.replace(str(10**30).encode(), b"1") == orjson.dumps(
        small, option=orjson.OPT_INDENT_2
    )
