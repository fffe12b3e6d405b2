"""The task history: a moving average per task, bounded, kept in a file across restarts."""

from __future__ import annotations

import gc
import random
import sys
import tracemalloc
from pathlib import Path

import orjson
import pytest

import dispatcher.admission.history as history_module
from dispatcher.admission.history import ALPHA, TaskHistory, line_key, task_digest, task_key
from dispatcher.tasks.materialize import materialize
from tests.tasks.test_materialize import spec_for


def test_the_digest_ignores_the_dispatchers_keys_and_key_order() -> None:
    row = {"agent_ref": {"name": "a"}, "responses_create_params": {"input": "q"}}
    materialized = {**row, "_ng_task_index": 3, "_ng_rollout_index": 1}
    reordered = dict(reversed(list(row.items())))
    assert task_digest(materialized) == task_digest(row) == task_digest(reordered)
    assert task_digest({**row, "x": 1}) != task_digest(row)


def test_the_history_survives_a_restart_and_skips_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    history = TaskHistory.load(path, max_tasks=10)
    history.observe("a", 2.0)
    history.observe("a", 4.0)
    history.observe("b", 1.0)
    history.flush()
    with path.open("ab") as f:
        f.write(b'{"t": "c", "s"')  # a kill in the middle of an append
    again = TaskHistory.load(path, max_tasks=10)
    assert again.estimate("a") == 2.0 + ALPHA * (4.0 - 2.0)
    assert again.estimate("b") == 1.0
    assert again.estimate("c") is None


def test_the_history_is_bounded_in_tasks_and_lines(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    history = TaskHistory.load(path, max_tasks=3)
    for round_ in range(5):
        for task in "abcde":
            history.observe(task, float(round_))
        history.flush()
    assert len(history) == 3
    # The least recently updated are gone; the file never holds more than twice the tasks.
    assert history.estimate("a") is None and history.estimate("e") is not None
    assert len(path.read_bytes().splitlines()) <= 2 * 3 + 5
    again = TaskHistory.load(path, max_tasks=3)
    assert {t: again.estimate(t) for t in "cde"} == {t: history.estimate(t) for t in "cde"}


def test_a_foreign_line_is_skipped_and_the_last_update_of_a_task_wins(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    path.write_bytes(
        b'{"t":"a","s":1.0}\n'
        b"\n"
        b'{"t":"b","s":1},{"t":"c","s":2}\n'  # two objects on a line: not an update
        b'{"t":"d","s":-1}\n'
        b'{"t":"a","s":3}\n'
        b'{"t":"e","s":2.5,"x":0}\n'
    )
    history = TaskHistory.load(path, max_tasks=2)
    assert {t: history.estimate(t) for t in "abcde"} == {
        "a": 3.0,
        "b": None,
        "c": None,
        "d": None,
        "e": 2.5,
    }
    # The two updated last are kept, oldest first: "a" goes before "e".
    history.observe("f", 1.0)
    assert history.estimate("a") is None and history.estimate("e") == 2.5


def test_a_task_costs_the_history_a_few_dozen_bytes() -> None:
    # A daemon serving a job per prompt group sees a new task with nearly every job:
    # an ordered map of digest strings took ~200 bytes a task (20 MB at the default bound).
    count = 20_000
    tracemalloc.start()
    try:
        history = TaskHistory(None, max_tasks=count)
        for n in range(count):
            history.observe(task_digest({"input": n}), 1.5)
        per_task = tracemalloc.get_traced_memory()[0] / count
    finally:
        tracemalloc.stop()
    assert per_task < 60, per_task
    assert history.estimate(task_digest({"input": 0})) == 1.5


def test_the_history_forgets_the_least_recently_updated_in_a_batch(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    history = TaskHistory.load(path, max_tasks=32)
    tasks = [task_digest({"input": n}) for n in range(40)]
    for digest in tasks[:32]:
        history.observe(digest, 1.0)
    # The first task updated again: the second is now the one updated longest ago.
    history.observe(tasks[0], 3.0)
    history.observe(tasks[32], 2.0)
    # Over the bound: the least recently updated go, max_tasks // 16 more with it.
    assert len(history) == 30
    assert [history.estimate(t) is None for t in tasks[:4]] == [False, True, True, True]
    history.flush()
    # A restart keeps the last max_tasks updated (the batch's extra ones too).
    again = TaskHistory.load(path, max_tasks=32)
    kept = {t: history.estimate(t) for t in tasks if history.estimate(t) is not None}
    assert {t: again.estimate(t) for t in kept} == kept and len(again) == 32


def test_a_materialized_line_and_its_row_name_one_task() -> None:
    row = {"agent_ref": {"name": "a"}, "responses_create_params": {"input": "q"}}
    line = orjson.dumps({**row, "_ng_task_index": 3, "_ng_rollout_index": 1}) + b"\n"
    assert line_key(line) == task_key(task_digest(row)) == task_key(task_key(task_digest(row)))
    history = TaskHistory(None)
    history.observe(task_digest(row), 2.0)
    assert history.find(line_key(line))[0] == history.estimate(task_digest(row)) == 2.0


def test_an_update_at_a_place_since_moved_finds_its_task_again() -> None:
    history = TaskHistory(None, max_tasks=2000)
    keys = [task_key(task_digest({"input": n})) for n in range(2001)]
    for key in keys[:2000]:
        history.observe(key, 1.0)
    estimate, at = history.find(keys[1500])
    assert estimate == 1.0 and at >= 0
    # Over the bound: the oldest tasks are forgotten, and the places after them move.
    history.observe(keys[2000], 2.0)
    assert history.find(keys[1500])[1] != at
    assert history.find(keys[0]) == (None, -1)
    history.observe(keys[1500], 3.0, at)
    assert history.estimate(keys[1500]) == 1.0 + ALPHA * (3.0 - 1.0)
    kept = keys[2000 - len(history) + 1 : 2000]
    assert [history.estimate(k) for k in kept if k != keys[1500]] == [1.0] * (len(kept) - 1)
    assert history.estimate(keys[2000]) == 2.0
    # At its place still: updated there.
    estimate, at = history.find(keys[1700])
    history.observe(keys[1700], 2.0, at)
    assert history.find(keys[1700]) == (1.0 + ALPHA * (2.0 - 1.0), at)


def test_a_hint_of_other_places_is_no_place() -> None:
    """A hint names its places: one of another history (or of places since compressed)
    finds its task again, it does not update the task at that place."""
    first, second = TaskHistory(None), TaskHistory(None)
    keys = [task_key(task_digest({"input": n})) for n in range(2)]
    for key in keys:
        first.observe(key, 1.0)
    for key in reversed(keys):
        second.observe(key, 5.0)
    _, hint = first.find(keys[0])
    assert second.find(keys[0])[1] != hint
    second.observe(keys[0], 7.0, hint)
    assert second.estimate(keys[0]) == 5.0 + ALPHA * (7.0 - 5.0)
    assert second.estimate(keys[1]) == 5.0


def test_a_copy_of_the_places_takes_no_hint_of_the_original() -> None:
    """A copy (a compaction's snapshot) has places of its own: after both take a task
    at the same place, the original's hint finds its task in the copy again."""
    tasks = history_module._Tasks(16)
    a, b, c = (task_key(task_digest({"input": n})) for n in range(3))
    tasks.move_all([(a, 1.0, -1)], 100)
    copy = tasks.copy()
    tasks.move_all([(b, 2.0, -1)], 100)
    copy.move_all([(c, 3.0, -1)], 100)
    _, hint = tasks.find(b)
    copy.move_all([(b, 4.0, hint)], 100)
    assert copy.get(c) == 3.0 and copy.get(b) == 4.0


def test_a_compaction_holds_a_slice_of_the_tasks_as_objects_not_all_of_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A list of every task's line at each compaction raised the heap's high-water
    # mark for good: a long-running daemon's memory stepped up at each rewrite.
    tasks = 40_000
    history = TaskHistory(tmp_path / "h.jsonl", max_tasks=tasks)
    rnd = random.Random(3)
    for n in range(tasks):
        history.observe(f"{rnd.getrandbits(128):032x}", float(n % 97))
    history.flush()
    gc.collect()
    before, most = sys.getallocatedblocks(), 0
    line = history_module.update_line

    def counted(update: tuple[int, float]) -> bytes:
        nonlocal most
        most = max(most, sys.getallocatedblocks() - before)
        return line(update)

    monkeypatch.setattr(history_module, "update_line", counted)
    history._compact()
    assert most < tasks // 4, f"{most} small objects alive at once"


def test_a_compaction_writes_the_tasks_oldest_update_first_across_its_slices(
    tmp_path: Path,
) -> None:
    tasks = 20_000
    history = TaskHistory(tmp_path / "h.jsonl", max_tasks=tasks)
    rnd = random.Random(7)
    order = [f"{rnd.getrandbits(128):032x}" for _ in range(tasks)]
    for digest in order:
        history.observe(digest, 1.0)
    for digest in order[:100]:  # updated again: now the newest
        history.observe(digest, 2.0)
    history.flush()
    history._compact()
    written = [orjson.loads(line)["t"] for line in (tmp_path / "h.jsonl").read_bytes().splitlines()]
    assert written == order[100:] + order[:100]


def test_tasks_whose_digests_share_half_their_bits_are_told_apart() -> None:
    history = TaskHistory(None, max_tasks=10_000)
    same_high = [(12345 << 64) | n for n in range(3000)]
    same_low = [(n << 64) | 6789 for n in range(1, 3001)]
    for n, key in enumerate(same_high + same_low):
        history.observe(key, float(n))
    assert [history.estimate(k) for k in same_high + same_low] == list(map(float, range(6000)))
    assert history.estimate((12345 << 64) | 3000) is None
    assert history.estimate((3001 << 64) | 6789) is None


def test_observations_applied_in_batches_move_and_forget_as_one_at_a_time(
    tmp_path: Path,
) -> None:
    # Observations are applied a batch at a time (before every read, and every
    # SETTLE_EVERY of them): the averages and the forgetting are those of one
    # update at a time, wherever the bound is crossed in a batch.
    rng = random.Random(5)
    max_tasks = 48
    history = TaskHistory.load(tmp_path / "h.jsonl", max_tasks=max_tasks)
    model: dict[int, tuple[float, int]] = {}  # key -> average, tick
    keys = [task_key(task_digest({"input": n})) for n in range(120)]
    for tick in range(3 * history_module.SETTLE_EVERY):
        key, latency_s = rng.choice(keys), rng.choice([0.5, 1.0, rng.random()])
        history.observe(key, latency_s, rng.choice([-1, rng.randrange(max_tasks)]))
        average = model[key][0] + ALPHA * (latency_s - model[key][0]) if key in model else latency_s
        model[key] = (average, tick)
        if len(model) > max_tasks:
            oldest = sorted(model, key=lambda k: model[k][1])
            for gone in oldest[: len(model) - max_tasks + max_tasks // 16]:
                del model[gone]
        if rng.random() < 0.01:
            assert {k: history.estimate(k) for k in keys} == {
                k: model[k][0] if k in model else None for k in keys
            }
    assert {k: history.estimate(k) for k in keys} == {k: model.get(k, (None,))[0] for k in keys}
    history.flush()
    again = TaskHistory.load(tmp_path / "h.jsonl", max_tasks=max_tasks)
    assert {k: again.estimate(k) for k in model} == {k: v[0] for k, v in model.items()}


def test_a_history_written_before_is_found_from_a_materialized_line(tmp_path: Path) -> None:
    # A history line as every earlier tree wrote it for this row: the digest of a task
    # (its row's canonical JSON, blake2b) must stay, or every history on disk is lost.
    path = tmp_path / "task_history.jsonl"
    path.write_bytes(b'{"t":"3e4e4bdf50064e73f3196db2985ad0d9","s":2.5}\n')
    row = b'{"responses_create_params":{"input":"question 0"},"agent_ref":{"name":"sim"}}\n'
    (tmp_path / "tasks.jsonl").write_bytes(row)
    spec = spec_for(tmp_path / "tasks.jsonl", agents=frozenset({"sim"}), num_repeats=2)
    materialize(spec, tmp_path / "m.jsonl")
    lines = (tmp_path / "m.jsonl").read_bytes().splitlines(keepends=True)
    history = TaskHistory.load(path)
    assert [history.find(line_key(line))[0] for line in lines] == [2.5, 2.5]
