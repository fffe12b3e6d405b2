"""The task history's file: its update lines, written and read back."""

from __future__ import annotations

from pathlib import Path

import orjson

from dispatcher.admission.history import TaskHistory, task_digest, task_key
from dispatcher.admission.history_file import update_line


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
