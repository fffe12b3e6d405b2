"""A big answer's body buffer (delivery/http1.py): it holds nothing of the process's
memory before the socket's bytes land in it."""

from __future__ import annotations

from dispatcher.delivery import http1


def test_a_direct_bodys_buffer_starts_zeroed_even_where_freed_memory_was() -> None:
    # A buffer of this size freed just before is what an allocator hands out next:
    # a buffer left as the allocator gave it showed those bytes (and heap pointers),
    # which a cut answer's kept prefix or a later bug could carry into a row.
    size = http1.DIRECT_BODY_BYTES * 2 + 123
    for _ in range(3):
        dirty = bytearray(b"\xaa") * size
        del dirty
        buffer = http1.body_buffer(size)
        assert len(buffer) == size
        assert buffer.count(0) == size
