"""``dispatcher merge``: shards of a run merged equal the unsharded run's rollout set."""

from __future__ import annotations

import argparse
import fcntl
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import orjson
import pytest

from dispatcher.errors import ConfigError
from dispatcher.files.resume import OutputPaths
from dispatcher.ops import merge as merge_cmd
from dispatcher.ops.merge import merge_shards
from dispatcher.settings.shard import Shard

TASKS = 7
REPEATS = 3
Outcome = Callable[[int, int], list[str]]


def every_key() -> list[tuple[int, int]]:
    return [(t, r) for t in range(TASKS) for r in range(REPEATS)]


def outcomes(task: int, rollout: int) -> list[str]:
    """Attempts of one rollout, deterministic: 'ok', 'fail', 'terminal'."""
    if (task, rollout) == (1, 2):
        return ["terminal"]
    if (task, rollout) == (4, 0):
        return ["fail", "fail", "fail"]
    if task % 3 == 2:
        return ["fail", "ok"]
    return ["ok"]


def write_run(
    output: Path,
    keys: Iterable[tuple[int, int]],
    outcome: Outcome = outcomes,
    extra_successes: int = 0,
) -> OutputPaths:
    """What a dispatcher leaves after running ``keys`` (crash-free, rows whole)."""
    paths = OutputPaths.for_output(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    materialized, successes, failures = [], [], []
    for task, rollout in keys:
        base = {"_ng_task_index": task, "_ng_rollout_index": rollout, "agent_ref": {"name": "a"}}
        materialized.append({**base, "responses_create_params": {"input": f"q{task}"}})
        for attempt, result in enumerate(outcome(task, rollout)):
            row = {**base, **({"_ng_attempt_index": attempt} if attempt else {})}
            if result == "ok":
                successes.append({**row, "reward": float(task % 2)})
            else:
                failures.append(
                    {
                        **row,
                        "_ng_failure_class": "agent_run_error",
                        "_ng_failure_terminal": result == "terminal",
                    }
                )
    successes += successes[:extra_successes]
    for path, rows in (
        (paths.materialized, materialized),
        (paths.output, successes),
        (paths.failures, failures),
    ):
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return paths


def shard_outputs(base: Path, count: int, outcome: Outcome = outcomes) -> list[Path]:
    outputs = []
    for k in range(count):
        shard = Shard(k, count)
        out = shard.output_for(base)
        write_run(out, [key for key in every_key() if shard.contains(key[0])], outcome)
        outputs.append(out)
    return outputs


def rows(path: Path) -> list[bytes]:
    return sorted(path.read_bytes().splitlines())


def test_merged_shards_equal_the_unsharded_run(tmp_path: Path) -> None:
    full = write_run(tmp_path / "full" / "run.jsonl", every_key())
    shards = shard_outputs(tmp_path / "shards" / "run.jsonl", 3)
    merged = OutputPaths.for_output(tmp_path / "merged" / "run.jsonl")

    result = merge_shards(shards, merged.output)

    assert result.exit_code == 0 and result.written
    assert result.to_json()["expected"] == TASKS * REPEATS
    for got, want in (
        (merged.output, full.output),
        (merged.failures, full.failures),
        (merged.materialized, full.materialized),
    ):
        assert rows(got) == rows(want)
    assert not merged.manifest.exists()
    assert sorted(p.name for p in merged.output.parent.iterdir()) == sorted(
        p.name for p in (merged.output, merged.failures, merged.materialized, merged.lock)
    )


def test_missing_rollout_is_reported_and_the_rest_written(tmp_path: Path) -> None:
    def with_gap(task: int, rollout: int) -> list[str]:
        return [] if (task, rollout) == (3, 1) else outcomes(task, rollout)

    shards = shard_outputs(tmp_path / "run.jsonl", 2, with_gap)
    merged = tmp_path / "out" / "merged.jsonl"
    result = merge_shards(shards, merged)
    assert result.exit_code == 75
    assert result.missing == 1
    assert result.shards[1].missing_sample == ["3-1"]
    assert result.written
    assert len(rows(merged)) == len(rows(shards[0])) + len(rows(shards[1]))


def test_retryable_rollout_counts_as_missing(tmp_path: Path) -> None:
    def one_failure(task: int, rollout: int) -> list[str]:
        return ["fail"] if (task, rollout) == (0, 0) else outcomes(task, rollout)

    shards = shard_outputs(tmp_path / "run.jsonl", 1, one_failure)
    assert merge_shards(shards, tmp_path / "m.jsonl").shards[0].missing_sample == ["0-0"]
    # With one attempt allowed, that failure is final.
    assert merge_shards(shards, tmp_path / "m.jsonl", max_attempts=1).exit_code == 0


def test_absent_and_unstarted_shards(tmp_path: Path) -> None:
    shards = shard_outputs(tmp_path / "run.jsonl", 3)
    result = merge_shards(shards[:2], tmp_path / "m.jsonl")
    assert result.missing_shards == ["2/3"]
    assert result.exit_code == 75

    unstarted = Shard(2, 3).output_for(tmp_path / "other" / "run.jsonl")
    result = merge_shards([*shards[:2], unstarted], tmp_path / "m.jsonl")
    assert result.to_json()["shards_not_started"] == [str(unstarted)]
    assert result.exit_code == 75


def test_duplicate_success_row_is_a_conflict(tmp_path: Path) -> None:
    shards = shard_outputs(tmp_path / "run.jsonl", 2)
    write_run(shards[0], [k for k in every_key() if k[0] % 2 == 0], extra_successes=1)
    merged = tmp_path / "out" / "merged.jsonl"
    result = merge_shards(shards, merged)
    assert result.exit_code == 2
    assert "more than one success row" in result.conflicts.sample[0]
    assert not result.written
    assert sorted(p.name for p in merged.parent.iterdir()) == ["merged_run.lock"]


def test_rollout_in_two_shards_is_a_conflict(tmp_path: Path) -> None:
    shards = shard_outputs(tmp_path / "run.jsonl", 2)
    stray = write_run(tmp_path / "stray.jsonl", [(0, 0)]).output
    result = merge_shards([*shards, stray], tmp_path / "m.jsonl")
    assert result.exit_code == 2
    assert any("materialized more than once" in m for m in result.conflicts.sample)


def test_rollout_in_the_wrong_shard_is_a_conflict(tmp_path: Path) -> None:
    wrong = write_run(Shard(0, 2).output_for(tmp_path / "run.jsonl"), [(1, 0)]).output
    result = merge_shards([wrong], tmp_path / "m.jsonl")
    assert result.exit_code == 2
    assert "does not belong to shard 0/2" in result.conflicts.sample[0]


def test_same_shard_twice_and_mixed_splits(tmp_path: Path) -> None:
    shards = shard_outputs(tmp_path / "run.jsonl", 2)
    assert merge_shards([shards[0], shards[0]], tmp_path / "m.jsonl").exit_code == 2
    other = shard_outputs(tmp_path / "x" / "run.jsonl", 3)
    result = merge_shards([shards[0], other[1]], tmp_path / "m.jsonl")
    assert result.exit_code == 2
    assert "different splits" in result.conflicts.sample[0]


def test_torn_tail_in_a_shard(tmp_path: Path) -> None:
    shards = shard_outputs(tmp_path / "run.jsonl", 1)
    data = shards[0].read_bytes()
    last = data.rstrip(b"\n").rsplit(b"\n", 1)[1]
    shards[0].write_bytes(data[: -len(last) - 1] + last[:10])  # the last success row torn
    result = merge_shards(shards, tmp_path / "m.jsonl")
    assert result.exit_code == 75
    assert result.shards[0].unreadable == 1
    assert result.missing == 1
    assert (tmp_path / "m.jsonl").read_bytes().endswith(b"}\n")


def test_unterminated_last_row_is_kept_whole(tmp_path: Path) -> None:
    shards = shard_outputs(tmp_path / "run.jsonl", 1)
    shards[0].write_bytes(shards[0].read_bytes().rstrip(b"\n"))
    assert merge_shards(shards, tmp_path / "m.jsonl").exit_code == 0
    assert rows(tmp_path / "m.jsonl") == rows(shards[0])


def test_refuses_a_shard_being_written(tmp_path: Path) -> None:
    shards = shard_outputs(tmp_path / "run.jsonl", 1)
    lock = OutputPaths.for_output(shards[0]).lock
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ConfigError, match="still writing"):
            merge_shards(shards, tmp_path / "m.jsonl")
    finally:
        os.close(fd)


def test_refuses_to_overwrite_a_run_or_an_input(tmp_path: Path) -> None:
    shards = shard_outputs(tmp_path / "run.jsonl", 1)
    with pytest.raises(ConfigError, match="also an input"):
        merge_shards(shards, shards[0])
    run = write_run(tmp_path / "real.jsonl", [(0, 0)])
    run.manifest.write_text("{}")
    with pytest.raises(ConfigError, match="is a run's output"):
        merge_shards(shards, run.output)


def cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dispatcher")
    merge_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shards = [str(p) for p in shard_outputs(tmp_path / "run.jsonl", 2)]
    args = cli(["merge", "--output", str(tmp_path / "m.jsonl"), *shards])
    assert args.handler(args) == 0
    assert f"expected {TASKS * REPEATS}" in capsys.readouterr().out
    args = cli(["merge", "--json", "--output", str(tmp_path / "m.jsonl"), shards[0]])
    assert args.handler(args) == 75
    summary: dict[str, Any] = orjson.loads(capsys.readouterr().out)
    assert summary["missing_shards"] == ["1/2"]


def test_all_ops_commands_register() -> None:
    from dispatcher.ops import add_parsers

    parser = argparse.ArgumentParser(prog="dispatcher")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    for argv in (["status", "x.jsonl"], ["report", "x.jsonl"], ["merge", "--output", "m", "a"]):
        assert callable(parser.parse_args(argv).handler)


def test_sidecars_caught_by_a_glob_name_their_sets(tmp_path: Path) -> None:
    # `dispatcher merge --output all.jsonl out/x.shard-*.jsonl` also catches each
    # shard's _failures and _materialized_inputs files: they used to be listed as
    # shards "not started" and a complete set exited 75.
    shard_outputs(tmp_path / "out" / "x.jsonl", 4)
    caught = sorted((tmp_path / "out").glob("x.shard-*.jsonl"))
    assert len(caught) == 12

    result = merge_shards(caught, tmp_path / "all.jsonl")

    assert result.exit_code == 0, result.to_json()
    assert len(result.shards) == 4 and all(s.started for s in result.shards)
    assert result.to_json()["expected"] == TASKS * REPEATS


def test_a_sidecar_alone_stands_for_its_set(tmp_path: Path) -> None:
    shards = shard_outputs(tmp_path / "x.jsonl", 2)
    sidecars = [OutputPaths.for_output(p).failures for p in shards]
    assert merge_shards(sidecars, tmp_path / "all.jsonl").exit_code == 0
    # The same set named twice directly is still a mistake.
    assert merge_shards([shards[0], shards[0], shards[1]], tmp_path / "m.jsonl").exit_code == 2
