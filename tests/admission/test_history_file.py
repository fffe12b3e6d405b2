"""The task history's file: its update lines, written and read back."""

from __future__ import annotations

from pathlib import Path

import orjson

from dispatcher.admission.history import TaskHistory, task_digest, task_key
from dispatcher.admission.history_file import parse_updates, update_line, update_lines


def test_an_update_line_is_the_json_object_of_its_digest_and_average(tmp_path: Path) -> None:
    key = task_key(task_digest({"input": 1}))
    for average in (0.0, 0.1, 2.5, 1e16, 1.5e-7, 123456.789, 5e-324, 1.7976931348623157e308):
        line = update_line((key, average))
        assert line.endswith(b"\n") and orjson.loads(line) == {"t": f"{key:032x}", "s": average}
    path = tmp_path / "h.jsonl"
    history = TaskHistory.load(path)
    history.observe(key, 1e-9)
    history.flush()
    assert TaskHistory.load(path).estimate(key) == 1e-9


def test_names_that_are_not_digests_load_as_the_names_they_are(tmp_path: Path) -> None:
    # A load reads the digests' bytes all at once: names of other lengths, or of 32
    # characters that are not all hex digits, are each digested as ``task_key`` does.
    for names in (
        ["a" * 31, "b" * 33, "0" * 32],
        [" " + "c" * 31, "d" * 32],
        [" " + "c" * 31, "e" * 31 + " ", "f" * 32],
        ["A" * 32, "g" * 32],
    ):
        path = tmp_path / "h.jsonl"
        path.write_bytes(
            b"".join(orjson.dumps({"t": n, "s": float(i)}) + b"\n" for i, n in enumerate(names))
        )
        history = TaskHistory.load(path)
        assert [history.estimate(n) for n in names] == list(map(float, range(len(names))))


def test_a_batch_of_update_lines_reads_back_as_its_digests_and_averages() -> None:
    keys = [0, 1, (1 << 64) - 1, 1 << 64, (1 << 128) - 1, task_key(task_digest({"input": 1}))]
    averages = [0.0, 0.1, 2.5, 1e16, 1.5e-7, 5e-324]
    keys, averages = keys + keys[::-1], averages + [123456.789, 1.7976931348623157e308] * 3
    data = update_lines(keys, averages)
    assert [orjson.loads(line) for line in data.splitlines(keepends=True)] == [
        {"t": f"{key:032x}", "s": average} for key, average in zip(keys, averages, strict=True)
    ]
    assert data.endswith(b"\n") and update_lines([], []) == b""
    assert parse_updates(data) == ([f"{key:032x}" for key in keys], averages)


def test_an_update_of_no_finite_non_negative_average_is_foreign() -> None:
    data = b"".join(
        b'{"t":"%d","s":%s}\n' % (n, number)
        for n, number in enumerate([b"1e999", b"-1e-9", b'"1"', b"null", b"-0.0", b"2.5", b"0"])
    )
    assert parse_updates(data) == (["4", "5", "6"], [-0.0, 2.5, 0.0])
    assert parse_updates(data[data.index(b'{"t":"4"') :]) == (["4", "5", "6"], [-0.0, 2.5, 0.0])
