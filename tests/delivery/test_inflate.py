"""An answer's Content-Encoding undone from bytes (``delivery/inflate.py``): no socket
adds anything to these rules, so they are fed the bytes directly."""

from __future__ import annotations

import gzip
import zlib

import pytest

from dispatcher.delivery.inflate import inflater_of


class Body:
    """A body under a cap: what ``http1.Connection`` gives an inflater."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()

    def room(self) -> int:
        return self.cap - len(self.data)

    def take(self, chunk: bytes) -> None:
        if len(chunk) > self.room():
            raise OverflowError("past the cap")
        self.data += chunk


def inflate(coding: bytes, wire: bytes, cap: int = 1 << 20, piece: int = 7) -> bytes:
    inflater = inflater_of(coding)
    assert inflater is not None
    body = Body(cap)
    for start in range(0, len(wire), piece):  # as a socket hands it over: in pieces
        inflater.feed(wire[start : start + piece], body)
    inflater.flush(body)
    return bytes(body.data)


ROW = b'{"reward": 1.0, "ids": [' + b",".join(b"%d" % i for i in range(500)) + b"]}"


def test_nothing_to_undo_is_none_and_an_unknown_coding_leaves_the_body_as_sent() -> None:
    assert inflater_of(b"") is None
    assert inflater_of(b"identity") is None
    assert inflater_of(b"br") is None
    assert inflater_of(b"gzip, br") is None


@pytest.mark.parametrize("coding", [b"gzip", b"x-gzip", b"GZIP", b" gzip , identity"])
def test_gzip_in_pieces(coding: bytes) -> None:
    assert inflate(coding, gzip.compress(ROW)) == ROW


def test_deflate_zlib_wrapped_as_the_standard_says_and_raw_as_some_servers_send() -> None:
    assert inflate(b"deflate", zlib.compress(ROW)) == ROW
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert inflate(b"deflate", raw.compress(ROW) + raw.flush()) == ROW


def test_a_multi_member_gzip_body_is_every_members_bytes() -> None:
    assert inflate(b"gzip", gzip.compress(ROW[:100]) + gzip.compress(ROW[100:])) == ROW


def test_codings_listed_in_order_are_undone_last_first() -> None:
    assert inflate(b"gzip, gzip", gzip.compress(gzip.compress(ROW))) == ROW
    assert inflate(b"deflate, gzip", gzip.compress(zlib.compress(ROW))) == ROW


def test_a_bomb_stops_at_the_cap_not_at_the_memorys_end() -> None:
    bomb = gzip.compress(b"\0" * (64 << 20))  # 64 MiB in about 64 KiB
    with pytest.raises(OverflowError):
        inflate(b"gzip", bomb, cap=1 << 20, piece=4096)


def test_a_stream_cut_short_is_an_error_at_its_end() -> None:
    whole = gzip.compress(ROW)
    with pytest.raises(zlib.error):
        inflate(b"gzip", whole[: len(whole) // 2])


def test_bytes_that_are_not_the_coding_are_an_error() -> None:
    with pytest.raises(zlib.error):
        inflate(b"gzip", b"not gzip at all")
