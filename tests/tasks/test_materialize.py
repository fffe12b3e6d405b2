"""Materialization and rollout identity (contracts §1, §2)."""

from __future__ import annotations

import hashlib
import tracemalloc
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from dispatcher import jsonx
from dispatcher.errors import ConfigError
from dispatcher.tasks import lines as lines_module
from dispatcher.tasks.lines import iter_input_rows
from dispatcher.tasks.materialize import (
    MaterializeResult,
    MaterializeSpec,
    Rollout,
    materialize,
    rollout_id_for,
)
from tests.helpers import keys_of, read_jsonl


def spec_for(path: Path, **overrides: Any) -> MaterializeSpec:
    values: dict[str, Any] = {
        "input_path": path,
        "agents": frozenset({"a", "b"}),
        "default_agent": None,
        "num_repeats": 1,
        "limit": None,
        "overrides": {},
        "skip_invalid_rows": False,
    }
    values.update(overrides)
    return MaterializeSpec(**values)


def write_lines(path: Path, lines: Sequence[Mapping[str, Any] | str]) -> Path:
    data = b"".join(
        (line.encode() if isinstance(line, str) else orjson.dumps(line)) + b"\n" for line in lines
    )
    path.write_bytes(data)
    return path


def run(
    tmp_path: Path, lines: Sequence[Mapping[str, Any] | str], **overrides: Any
) -> tuple[MaterializeResult, list[dict[str, Any]]]:
    tasks = write_lines(tmp_path / "tasks.jsonl", lines)
    out = tmp_path / "materialized.jsonl"
    result = materialize(spec_for(tasks, **overrides), out)
    return result, read_jsonl(out)


def row(agent: str = "a", **fields: Any) -> dict[str, Any]:
    return {"agent_ref": {"name": agent}, **fields}


def test_repeats_are_laid_out_aabbcc(tmp_path: Path) -> None:
    result, rows = run(tmp_path, [row(q=0), row(q=1), row(q=2)], num_repeats=2)
    assert keys_of(rows) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [r["q"] for r in rows] == [0, 0, 1, 1, 2, 2]
    assert (result.input_rows, result.tasks, result.rollouts) == (3, 3, 6)
    assert result.rollouts_by_agent == {"a": 6}


def test_identical_rows_share_a_task_and_continue_its_rollout_indexes(tmp_path: Path) -> None:
    same = row(q="same")
    result, rows = run(tmp_path, [same, row(q="other"), same], num_repeats=2)
    assert keys_of(rows) == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3)]
    assert result.tasks == 2
    assert result.rollouts == 6


def test_a_row_carrying_its_own_task_index_keeps_it(tmp_path: Path) -> None:
    lines = [row(q=0, _ng_task_index=7), row(q=1), row(q=2, _ng_task_index=7)]
    result, rows = run(tmp_path, lines, num_repeats=2)
    assert keys_of(rows) == [(7, 0), (7, 1), (0, 0), (0, 1), (7, 2), (7, 3)]
    assert result.tasks == 3


@pytest.mark.parametrize("bad", [-1, "3", 1.5, True])
def test_a_bad_own_task_index_is_an_error(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"tasks.jsonl:1: _ng_task_index"):
        run(tmp_path, [row(_ng_task_index=bad)])


def test_num_repeats_per_agent_with_default(tmp_path: Path) -> None:
    result, rows = run(
        tmp_path,
        [row("a", q=0), row("b", q=1)],
        num_repeats={"a": 3, "_default": 1},
    )
    assert keys_of(rows) == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert result.rollouts_by_agent == {"a": 3, "b": 1}


def test_num_repeats_map_without_entry_or_default_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tasks.jsonl:2: num_repeats has no entry for agent 'b'"):
        run(tmp_path, [row("a"), row("b")], num_repeats={"a": 2})


def test_overrides_merge_shallowly_over_responses_create_params(tmp_path: Path) -> None:
    params = {"model": "m", "temperature": 0.1, "tools": [{"name": "t", "x": 1}]}
    overrides = {"temperature": 1.0, "tools": [{"name": "u"}], "max_output_tokens": 64}
    _, rows = run(tmp_path, [row(responses_create_params=params), row()], overrides=overrides)
    assert rows[0]["responses_create_params"] == {
        "model": "m",
        "temperature": 1.0,
        "tools": [{"name": "u"}],
        "max_output_tokens": 64,
    }
    assert rows[1]["responses_create_params"] == overrides


def test_params_pass_through_without_overrides(tmp_path: Path) -> None:
    params = {"input": [{"role": "user", "content": "hi"}], "nested": {"a": {"b": 1}}}
    _, rows = run(tmp_path, [row(responses_create_params=params)])
    assert rows[0]["responses_create_params"] == params


def test_non_object_params_are_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tasks.jsonl:1: responses_create_params must be"):
        run(tmp_path, [row(responses_create_params=[1, 2])])


def test_limit_caps_input_rows_read(tmp_path: Path) -> None:
    lines: Sequence[Mapping[str, Any] | str] = [row(q=0), "", row(q=1), row(q=2), "{bad"]
    result, rows = run(tmp_path, lines, limit=2, num_repeats=2)
    assert [r["q"] for r in rows] == [0, 0, 1, 1]
    assert result.input_rows == 2


def test_limit_zero_reads_nothing(tmp_path: Path) -> None:
    result, rows = run(tmp_path, [row()], limit=0)
    assert rows == []
    assert result.rollouts == 0


def test_blank_lines_are_skipped(tmp_path: Path) -> None:
    result, rows = run(tmp_path, ["", row(q=0), "   ", "\t", row(q=1), ""])
    assert [r["q"] for r in rows] == [0, 1]
    assert result.input_rows == 2


@pytest.mark.parametrize(
    ("line", "problem"),
    [("{bad json", "not valid JSON"), ("[1, 2]", "not a JSON object"), ('"text"', "not a JSON")],
)
def test_an_invalid_line_is_an_error_naming_file_and_line(
    tmp_path: Path, line: str, problem: str
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    with pytest.raises(ConfigError) as info:
        run(tmp_path, [row(), "", line])
    assert str(info.value).startswith(f"{tasks}:3: ")
    assert problem in str(info.value)


def test_skip_invalid_rows_skips_them(tmp_path: Path) -> None:
    result, rows = run(
        tmp_path, [row(q=0), "{bad", "[1]", row(q=1)], skip_invalid_rows=True, num_repeats=2
    )
    assert keys_of(rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert result.input_rows == 2


def test_default_agent_fills_rows_without_agent_ref(tmp_path: Path) -> None:
    _, rows = run(tmp_path, [{"q": 0}, row("a", q=1)], default_agent="b")
    assert [r["agent_ref"] for r in rows] == [{"name": "b"}, {"name": "a"}]


def test_a_row_without_agent_and_no_default_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tasks.jsonl:1: row has no agent_ref"):
        run(tmp_path, [{"q": 0}])


def test_an_unknown_agent_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tasks.jsonl:2: agent 'nope' is not configured"):
        run(tmp_path, [row("a"), row("nope")])


@pytest.mark.parametrize("ref", ["a", {"id": "a"}, {"name": 3}])
def test_a_malformed_agent_ref_is_an_error(tmp_path: Path, ref: Any) -> None:
    with pytest.raises(ConfigError, match=r"tasks.jsonl:1: agent_ref must be an object"):
        run(tmp_path, [{"agent_ref": ref}])


def test_digests_change_with_content(tmp_path: Path) -> None:
    first, _ = run(tmp_path, [row(q=0)])
    again, _ = run(tmp_path, [row(q=0)])
    other, _ = run(tmp_path, [row(q=1)])
    assert first.input_digest == again.input_digest
    assert first.materialized_digest == again.materialized_digest
    assert first.input_digest != other.input_digest
    assert first.materialized_digest != other.materialized_digest


def test_shard_filter_keeps_only_its_tasks(tmp_path: Path) -> None:
    result, rows = run(
        tmp_path, [row(q=i) for i in range(5)], shard_filter=lambda task: task % 2 == 1
    )
    assert keys_of(rows) == [(1, 0), (3, 0)]
    assert result.rollouts == 2


# ---- rollout identity (§2) ----------------------------------------------------


def test_rollout_ids() -> None:
    assert rollout_id_for({"_ng_task_index": 0, "_ng_rollout_index": 0}) == "0-0"
    assert rollout_id_for({"_ng_task_index": 3, "_ng_rollout_index": 1}, 2) == "3-1-a2"
    own = {"_ng_task_index": 3, "_ng_rollout_index": 0, "_ng_rollout_id": "task.x_7"}
    assert rollout_id_for(own) == "task.x_7"
    assert rollout_id_for(own, 1) == "task.x_7-a1"


def test_rollout_from_materialized_row() -> None:
    materialized = {"_ng_task_index": 3, "_ng_rollout_index": 1, "agent_ref": {"name": "a"}}
    first = Rollout.from_materialized(materialized, 0)
    assert first.rollout_id == "3-1"
    assert "_ng_attempt_index" not in first.body
    retry = Rollout.from_materialized(materialized, 2)
    assert retry.rollout_id == "3-1-a2"
    assert retry.body["_ng_attempt_index"] == 2
    assert retry.agent == "a"
    assert "_ng_attempt_index" not in materialized


def test_a_first_attempt_is_sent_as_its_materialized_line(tmp_path: Path) -> None:
    """The line's own bytes go to the agent: the same bytes encoding the body gives."""
    values = {"f": 0.1, "e": 1e16, "u": 'héllo \u2028 \\ "q"', "big": 2**70, "n": [None, True]}
    tasks = write_lines(tmp_path / "tasks.jsonl", [jsonx.dumps(row(**values)).decode()])
    out = tmp_path / "materialized.jsonl"
    materialize(spec_for(tasks), out)
    line = out.read_bytes()
    first = Rollout.from_materialized(jsonx.loads(line), 0, None, line)
    assert first.wire == jsonx.dumps(first.body)
    # A retry or a captured attempt carries more keys: its body is encoded.
    assert Rollout.from_materialized(jsonx.loads(line), 1, None, line).wire is None
    assert Rollout.from_materialized(jsonx.loads(line), 0, "t0k3n", line).wire is None


def test_own_rollout_id_is_kept_verbatim(tmp_path: Path) -> None:
    _, rows = run(tmp_path, [row(_ng_rollout_id="Task-01.v2_x")])
    assert rows[0]["_ng_rollout_id"] == "Task-01.v2_x"
    assert Rollout.from_materialized(rows[0], 0).rollout_id == "Task-01.v2_x"


@pytest.mark.parametrize("bad", ["-x", ".x", "has space", "a/b", "", "é", 12, None])
def test_an_invalid_own_rollout_id_is_an_error(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"tasks.jsonl:1: _ng_rollout_id"):
        run(tmp_path, [row(_ng_rollout_id=bad)])


def test_an_own_rollout_id_cannot_be_repeated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot be repeated"):
        run(tmp_path, [row(_ng_rollout_id="x")], num_repeats=2)


def test_a_line_longer_than_the_bound_is_an_error_naming_file_and_line(tmp_path: Path) -> None:
    # Read up to the bound and no further: a line of gigabytes never gets read whole.
    tasks = tmp_path / "tasks.jsonl"
    with pytest.raises(ConfigError) as info:
        run(tmp_path, [row(q=0), row(text="x" * 5000)], max_line_bytes=4096)
    assert str(info.value) == (
        f"{tasks}:2: a task line is longer than --max-task-line-bytes (4096 bytes)"
    )


def test_lines_longer_than_a_read_block_keep_their_rows_and_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lines_module, "READ_BLOCK_BYTES", 64)
    big = row(text="y" * 300)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(
        orjson.dumps(big) + b"\r\n  " + orjson.dumps(row(q=1)) + b"\n\n\t"
        + orjson.dumps(big) + b"  \n" + orjson.dumps(row(q=2))
    )  # fmt: skip
    out = tmp_path / "m.jsonl"
    result = materialize(spec_for(tasks), out)
    rows = read_jsonl(out)
    assert [(r.get("q"), r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows] == [
        (None, 0, 0), (1, 1, 0), (None, 0, 1), (2, 2, 0)
    ]  # fmt: skip
    assert result.input_digest == hashlib.sha256(tasks.read_bytes()).hexdigest()


def test_a_big_line_is_held_once_while_it_is_read(tmp_path: Path) -> None:
    # Read by lines, a line was joined from its pieces, then stripped into a copy:
    # a 1 GiB line cost 2.1 GB before it was even parsed. Now it is read into one
    # buffer that is parsed in place; what is left is the parsed row itself.
    size = 8 << 20
    tasks = write_lines(tmp_path / "tasks.jsonl", [row(text="z" * size)])
    tracemalloc.start()
    try:
        for _ in iter_input_rows(tasks, None, False, hashlib.sha256()):
            pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2.4 * size, f"peak {peak / size:.2f}x the line"


@pytest.mark.parametrize("limit", [None, 2])
def test_lines_in_memory_materialize_as_their_file_does(tmp_path: Path, limit: int | None) -> None:
    rows = [{"agent_ref": {"name": "a"}, "x": 1}, {"agent_ref": {"name": "b"}, "x": 1},
            {"agent_ref": {"name": "a"}, "x": 1}]  # fmt: skip
    path = write_lines(tmp_path / "in.jsonl", rows)
    spec = spec_for(path, num_repeats=2, limit=limit)
    from_file = materialize(spec, tmp_path / "file.jsonl")
    lines = [orjson.dumps(row) for row in rows]
    in_memory = materialize(spec, tmp_path / "memory.jsonl", lines=lines)
    assert in_memory == from_file
    assert (tmp_path / "memory.jsonl").read_bytes() == (tmp_path / "file.jsonl").read_bytes()


def test_a_line_in_memory_longer_than_the_bound_is_an_error_naming_it(tmp_path: Path) -> None:
    lines = [b'{"agent_ref":{"name":"a"}}', b'{"agent_ref":{"name":"a"},"x":"' + b"y" * 64 + b'"}']
    spec = spec_for(Path("rows"), max_line_bytes=64)
    with pytest.raises(ConfigError, match=r"^rows:2: a task line is longer"):
        materialize(spec, None, lines=lines)
