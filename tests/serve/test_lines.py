"""The service's JSON lines (``serve/lines.py``), from bytes: strict, as the stream's
readers rely on."""

from __future__ import annotations

import pytest

from dispatcher.serve.lines import BadLine, EndLine, GroupLine, encode, read_end, read_group


def test_a_group_line_round_trips_and_leaves_defaults_out() -> None:
    line = encode(GroupLine(task_index=3, rows=[0, 4, 9], failures=1))
    assert line == b'{"task_index":3,"rows":[0,4,9],"failures":1}\n'
    assert read_group(line) == GroupLine(3, [0, 4, 9], 1)
    filtered = encode(GroupLine(3, [0], 0, filtered=True))
    assert read_group(filtered).filtered is True


@pytest.mark.parametrize(
    "line",
    [
        b'{"task_index":true,"rows":[],"failures":0}',  # a bool is not an int
        b'{"task_index":1,"rows":[]}',  # a field missing
        b'{"task_index":1,"rows":["0"],"failures":0}',
        b"[1, 2]",
        b'{"task_index":1,"rows":[],"fail',  # cut short
    ],
)
def test_what_is_not_a_group_line_is_a_bad_line(line: bytes) -> None:
    with pytest.raises(BadLine):
        read_group(line)


def test_an_end_line_carries_the_state_and_a_failed_jobs_error() -> None:
    assert encode(EndLine("done")) == b'{"end":"done"}\n'
    assert read_end(b'{"end":"failed","error":"disk full"}') == EndLine("failed", "disk full")
    with pytest.raises(BadLine):
        read_end(b'{"task_index":1,"rows":[],"failures":0}')
