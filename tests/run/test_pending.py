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
    """Each rollout handed out, reserved as a job does before sending it."""
    handed = []
    async for rollout in pending.each(lambda: False):
        await pending.reserve()
        handed.append((rollout.task_index, rollout.attempt_index))
    return handed


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


async def test_a_hop_that_sends_nothing_reserves_nothing(tmp_path: Path) -> None:
    materialized = _materialized(tmp_path / "m.jsonl", 3)
    state = RunState(max_attempts=3)
    reservations = tmp_path / "r.jsonl"
    drained = Pending(materialized, state, None, None, reservations)
    assert [r.attempt_index async for r in drained.each(lambda: False)] == [0, 0, 0]
    assert not reservations.exists()
    again = Pending(materialized, state, None, None, reservations)
    assert await _keys(again) == [(0, 0), (1, 0), (2, 0)]
    assert await _keys(Pending(materialized, state, None, None, reservations)) == [
        (0, 1),
        (1, 1),
        (2, 1),
    ]
