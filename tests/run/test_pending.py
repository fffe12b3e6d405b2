"""What is left to start: final lines skipped, each batch reserved before it is handed out."""

from __future__ import annotations

from pathlib import Path

import orjson

from dispatcher.files.resume import RunState
from dispatcher.run.pending import READ_BATCH_ROWS, Pending
from dispatcher.tasks.keys import rollout_key


def _materialized(path: Path, count: int) -> Path:
    rows = (
        {"agent_ref": {"name": "sim"}, "_ng_task_index": t, "_ng_rollout_index": 0}
        for t in range(count)
    )
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return path


async def _keys(pending: Pending) -> list[tuple[int, int]]:
    return [(r.task_index, r.attempt_index) async for r in pending.each(lambda: False)]


async def test_a_long_stretch_of_final_lines_does_not_end_the_file(tmp_path: Path) -> None:
    # Failed once: a read of only final lines came back empty and read as the end,
    # so a resume whose pending rollouts lay past them started nothing (exit 75).
    count = READ_BATCH_ROWS * 8 * 2 + 3
    materialized = _materialized(tmp_path / "m.jsonl", count)
    state = RunState(max_attempts=3)
    for task in range(count - 1):
        state.add_success(rollout_key(task, 0), "sim", 1.0, None)
    reservations = tmp_path / "r.jsonl"
    pending = Pending(materialized, state, None, None, reservations)
    assert await _keys(pending) == [(count - 1, 0)]
    # The next hop: the line was reserved, so its next attempt has a new index.
    again = Pending(materialized, state, None, None, reservations)
    assert await _keys(again) == [(count - 1, 1)]
