"""``dispatcher report``: timing, limit hits, start deciles, reward and pass@k from rows."""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Any

import orjson
import pytest

from dispatcher.files.resume import OutputPaths
from dispatcher.ops import report as report_cmd
from dispatcher.ops.report import build_report, pass_at_k, quantile, render_report

T0 = 1_700_000_000.0
TIMEOUT_S = 10.0


def ident(task: int, rollout: int, agent: str, attempt: int = 0) -> dict[str, Any]:
    row: dict[str, Any] = {
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
        "agent_ref": {"name": agent},
    }
    if attempt:
        row["_ng_attempt_index"] = attempt
    return row


def stamp(started: float, duration: float) -> dict[str, Any]:
    return {
        "_ng_dispatch": {
            "started_at": T0 + started,
            "duration_s": duration,
            "replica": "http://127.0.0.1:9000",
        }
    }


def ok(
    task: int,
    rollout: int,
    agent: str,
    reward: Any,
    started: float,
    duration: float,
    attempt: int = 0,
) -> dict[str, Any]:
    return {**ident(task, rollout, agent, attempt), "reward": reward, **stamp(started, duration)}


def fail(
    task: int,
    rollout: int,
    agent: str,
    cls: str,
    started: float,
    duration: float,
    attempt: int = 0,
    terminal: bool = False,
) -> dict[str, Any]:
    return {
        **ident(task, rollout, agent, attempt),
        "_ng_failure_class": cls,
        "_ng_failure_terminal": terminal,
        **stamp(started, duration),
    }


def write_jsonl(path: Path, rows: list[dict[str, Any]], tail: bytes = b"") -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows) + tail)


SUCCESS_DURATIONS = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 9.95, 2.0, 3.0]
FAILURE_DURATIONS = [0.5, 10.0, 7.0]


@pytest.fixture
def run(tmp_path: Path) -> OutputPaths:
    """math: task 0 x4 (rewards 1,0,0,1), task 1 x4 (0.5, 0, terminal, left to run);
    code: task 2 x2 (1, 1). One retried rollout, one success timed by ng_perf only,
    one without timing, a torn tail in the successes file."""
    paths = OutputPaths.for_output(tmp_path / "run.jsonl")
    materialized = [ident(t, r, "math") for t in (0, 1) for r in range(4)]
    materialized += [ident(2, r, "code") for r in range(2)]
    write_jsonl(paths.materialized, materialized)
    d = SUCCESS_DURATIONS
    successes = [
        ok(0, 0, "math", 1, 0, d[0]),
        ok(0, 1, "math", 0, 1, d[1]),
        ok(0, 2, "math", 0, 2, d[2]),
        ok(0, 3, "math", 1.0, 3, d[3], attempt=1),
        ok(1, 0, "math", 0.5, 4, d[4]),
        ok(1, 1, "math", 0, 5, d[5]),
        ok(2, 0, "code", 1, 6, d[6]),
        {**ident(2, 1, "code"), "reward": True, "ng_perf": {"total_latency_ms": d[7] * 1000}},
    ]
    # The last success row has neither _ng_dispatch nor ng_perf: no timing.
    last = {**ident(9, 9, "code"), "reward": 0}
    write_jsonl(paths.output, [*successes, last], tail=b'{"_ng_task_index": 1, "_ng_rol')
    failures = [
        fail(0, 3, "math", "agent_run_error", 0.5, FAILURE_DURATIONS[0]),
        fail(1, 2, "math", "timeout_exceeded", 7, FAILURE_DURATIONS[1]),
        fail(1, 2, "math", "protocol_violation", 8, FAILURE_DURATIONS[2], attempt=1, terminal=True),
    ]
    write_jsonl(paths.failures, failures)
    return paths


def reference(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {
        "p50": statistics.median(values),
        "p90": cuts[89],
        "p99": cuts[98],
        "mean": statistics.fmean(values),
        "max": max(values),
    }


def test_duration_percentiles(run: OutputPaths) -> None:
    report = build_report(run.output, TIMEOUT_S, None)
    attempts = report["attempts"]
    assert (attempts["total"], attempts["successes"], attempts["failures"]) == (12, 9, 3)
    assert attempts["without_duration"] == 1
    stats = report["durations_s"]
    assert stats["success"]["n"] == 8
    for name, values in (
        ("success", SUCCESS_DURATIONS[:8]),
        ("failure", FAILURE_DURATIONS),
        ("all", SUCCESS_DURATIONS[:8] + FAILURE_DURATIONS),
    ):
        for key, expected in reference(values).items():
            assert stats[name][key] == pytest.approx(expected), (name, key)


def test_limit_hits(run: OutputPaths) -> None:
    limit = build_report(run.output, TIMEOUT_S, None)["limit"]
    assert limit == {
        "rollout_timeout_s": TIMEOUT_S,
        "timeout_exceeded": 1,
        "ran_to_limit": 1,  # the 9.95 s success
        "hit_limit": 2,
    }
    without = build_report(run.output, None, None)["limit"]
    assert (without["timeout_exceeded"], without["ran_to_limit"], without["hit_limit"]) == (1, 0, 1)


def test_timeout_from_manifest(run: OutputPaths) -> None:
    run.manifest.write_bytes(orjson.dumps({"rollout_timeout_s": TIMEOUT_S}))
    assert build_report(run.output, None, None)["limit"]["hit_limit"] == 2


def test_start_deciles(run: OutputPaths) -> None:
    starts = build_report(run.output, TIMEOUT_S, None)["starts"]
    assert starts["first"] == T0
    assert starts["last"] == T0 + 8
    groups = starts["groups"]
    # Ten attempts carry started_at: 0, 0.5, 1, ..., 8 -> one per decile.
    assert [g["attempts"] for g in groups] == [1] * 10
    assert [g["from_s"] for g in groups] == [0, 0.5, 1, 2, 3, 4, 5, 6, 7, 8]
    assert [g["hit_limit"] for g in groups] == [0, 0, 0, 0, 0, 0, 0, 1, 1, 0]
    assert [g["failures"] for g in groups] == [0, 1, 0, 0, 0, 0, 0, 0, 1, 1]


def test_rewards_per_agent(run: OutputPaths) -> None:
    rewards = build_report(run.output, None, None)["rewards"]
    assert rewards["math"]["successes"] == 6
    assert rewards["math"]["mean"] == pytest.approx(2.5 / 6)
    assert rewards["math"]["positive_share"] == pytest.approx(3 / 6)
    assert rewards["code"]["successes"] == 3
    assert rewards["code"]["mean"] == pytest.approx(2 / 3)


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    return 1 - math.comb(n - c, k) / math.comb(n, k)


def test_pass_at_k_estimator() -> None:
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k))
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_pass_at_k_per_agent(run: OutputPaths) -> None:
    table = build_report(run.output, None, None)["pass_at_k"]
    math_agent = table["math"]
    # Task 0: n=4 final, c=2. Task 1: n=3 final (two successes, one terminal), c=1 (0.5 > 0).
    assert (math_agent["tasks"], math_agent["max_repeats"]) == (2, 4)
    assert math_agent["k"]["1"]["value"] == pytest.approx((2 / 4 + 1 / 3) / 2)
    expected_2 = (brute_pass_at_k(4, 2, 2) + brute_pass_at_k(3, 1, 2)) / 2
    assert math_agent["k"]["2"] == {"value": pytest.approx(expected_2), "tasks": 2}
    assert math_agent["k"]["4"] == {"value": 1.0, "tasks": 1}
    assert table["code"]["k"] == {"1": {"value": 1.0, "tasks": 1}, "2": {"value": 1.0, "tasks": 1}}


def test_quantile_interpolates() -> None:
    assert quantile([], 0.5) is None
    assert quantile([4.0], 0.9) == 4.0
    assert quantile([0.0, 10.0], 0.25) == 2.5


def test_report_reads_only(run: OutputPaths) -> None:
    before = {p.name: p.read_bytes() for p in run.output.parent.iterdir()}
    build_report(run.output, TIMEOUT_S, None)
    assert {p.name: p.read_bytes() for p in run.output.parent.iterdir()} == before


def test_cli(run: OutputPaths, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="dispatcher")
    report_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["report", str(run.output), "--rollout-timeout-s", "10"])
    assert args.handler(args) == 0
    text = capsys.readouterr().out
    assert "per-rollout limit 10 s: 2 attempts hit it" in text
    assert "pass@k" in text and "k=4" in text
    assert "1 without timing" in text
    args = parser.parse_args(["report", str(run.output), "--json"])
    assert args.handler(args) == 0
    assert orjson.loads(capsys.readouterr().out)["limit"]["timeout_exceeded"] == 1


def test_render_without_timing(tmp_path: Path) -> None:
    paths = OutputPaths.for_output(tmp_path / "bare.jsonl")
    write_jsonl(paths.materialized, [ident(0, 0, "a")])
    text = render_report(build_report(paths.output, None, None))
    assert "no row carries _ng_dispatch.started_at" in text
    assert "reward: no success rows" in text


def test_rows_are_read_for_the_keys_a_report_needs(tmp_path: Path) -> None:
    """Only a row's own keys are decoded; a big answer, an index past 64 bits or a line
    that is no object is read the way a whole parse would read it."""
    from dispatcher.tasks.keys import FactsReader

    reader = FactsReader(("_ng_task_index", "reward"))
    big = {"response": {"text": "x" * 100_000, "n": [1, 2]}, "_ng_task_index": 3, "reward": 0.5}
    assert reader.read(orjson.dumps(big)) == {"_ng_task_index": 3, "reward": 0.5}
    assert reader.read(b'{"_ng_task_index": 1180591620717411303424, "reward": 1}') == {
        "_ng_task_index": 2**70,
        "reward": 1,
    }
    assert reader.read(b"[1, 2]") is None
    assert reader.read(b'{"_ng_task_index": 1, "rew') is None
    paths = OutputPaths.for_output(tmp_path / "big.jsonl")
    write_jsonl(paths.materialized, [ident(0, 0, "a"), ident(0, 1, "a")])
    huge = {**ok(0, 0, "a", 1, 0, 2.0), "response": "y" * 2_000_000}
    past_64_bits = {**ok(0, 1, "a", 1, 1, 3.0), "_ng_task_index": 2**70}
    paths.output.write_bytes(orjson.dumps(huge) + b"\n" + json_line(past_64_bits))
    report = build_report(paths.output, None, None)
    assert report["attempts"]["total"] == 1  # the out-of-bounds index names no rollout
    assert report["durations_s"]["all"]["max"] == 2.0


def json_line(row: dict[str, Any]) -> bytes:
    import json

    return json.dumps(row).encode() + b"\n"
