"""``dispatcher status``: figures from hand-built run folders, read without changing them."""

from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from dispatcher.errors import ConfigError
from dispatcher.files.resume import OutputPaths, Tail, tail_state
from dispatcher.ops import status_command as status_cmd
from dispatcher.ops.ending import next_step, run_ending
from dispatcher.ops.runfiles import lock_status
from dispatcher.ops.status import collect_status, render_status


def mat(task: int, rollout: int, agent: str) -> dict[str, Any]:
    return {
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
        "agent_ref": {"name": agent},
        "responses_create_params": {"input": f"task {task}"},
    }


def ok(task: int, rollout: int, agent: str, attempt: int = 0) -> dict[str, Any]:
    row = {**mat(task, rollout, agent), "reward": 1.0}
    if attempt:
        row["_ng_attempt_index"] = attempt
    return row


def fail(
    task: int, rollout: int, agent: str, cls: str, attempt: int = 0, terminal: bool = False
) -> dict[str, Any]:
    row = {
        **mat(task, rollout, agent),
        "_ng_failure_class": cls,
        "_ng_failure_type": "X",
        "_ng_failure_message": "m",
        "_ng_failure_http_status": None,
        "_ng_failure_response_body": None,
        "_ng_failure_terminal": terminal,
    }
    if attempt:
        row["_ng_attempt_index"] = attempt
    return row


def write_jsonl(path: Path, rows: list[dict[str, Any]], tail: bytes = b"") -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows) + tail)


@pytest.fixture
def run(tmp_path: Path) -> OutputPaths:
    """Tasks 0-1 for agent math, 2-3 for agent code, two repeats each.

    0-0 succeeded; 0-1 failed once then succeeded (id 0-1-a1); 1-0 failed
    terminally; 1-1 used up its 3 attempts; 2-0 failed once (retryable);
    2-1 has no row; 3-0's success row is a torn tail (no row); 3-1 succeeded.
    The failures file ends with a whole row lacking its newline.
    """
    paths = OutputPaths.for_output(tmp_path / "run.jsonl")
    agents = {0: "math", 1: "math", 2: "code", 3: "code"}
    write_jsonl(paths.materialized, [mat(t, r, agents[t]) for t in range(4) for r in range(2)])
    write_jsonl(
        paths.output,
        [ok(0, 0, "math"), ok(0, 1, "math", attempt=1), ok(3, 1, "code")],
        tail=orjson.dumps(ok(3, 0, "code"))[:25],
    )
    failures = [
        fail(0, 1, "math", "agent_request_failed"),
        fail(1, 0, "math", "protocol_violation", terminal=True),
        fail(1, 1, "math", "agent_run_error"),
        fail(1, 1, "math", "agent_run_error", attempt=1),
        fail(1, 1, "math", "timeout_exceeded", attempt=2),
    ]
    write_jsonl(paths.failures, failures, tail=orjson.dumps(fail(2, 0, "code", "timeout_exceeded")))
    return paths


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in directory.iterdir()}


def test_status_figures(run: OutputPaths) -> None:
    before = snapshot(run.output.parent)
    data = collect_status(run.output).to_json()
    assert snapshot(run.output.parent) == before, "status must not change any file"
    assert not run.lock.exists()

    assert data["expected"] == 8
    assert data["successes"] == 3
    assert data["terminal"] == 1
    assert data["attempts_used_up"] == 1
    assert data["final"] == 5
    assert data["coverage"] == pytest.approx(3 / 8)
    assert data["failed_attempts"] == 6
    assert data["failures_by_class"] == {
        "agent_run_error": 2,
        "timeout_exceeded": 2,
        "agent_request_failed": 1,
        "protocol_violation": 1,
    }
    left = data["left_to_run"]
    assert (left["total"], left["retryable"], left["no_row"]) == (3, 1, 2)
    assert left["last_run"] is None and left["never_started"] is None
    assert data["complete"] is False
    assert data["running"] is False


def test_status_per_agent(run: OutputPaths) -> None:
    agents = collect_status(run.output).to_json()["per_agent"]
    math, code = agents["math"], agents["code"]
    assert (math["expected"], math["successes"], math["terminal"], math["attempts_used_up"]) == (
        4,
        2,
        1,
        1,
    )
    assert (math["retryable"], math["no_row"], math["coverage"]) == (0, 0, 0.5)
    assert math["failed_attempts"] == 5
    assert (code["expected"], code["successes"], code["retryable"], code["no_row"]) == (4, 1, 1, 2)
    assert code["failures_by_class"] == {"timeout_exceeded": 1}


def test_status_reports_file_tails(run: OutputPaths) -> None:
    files = collect_status(run.output).to_json()["files"]
    assert files["output"] | {"path": ""} == {
        "path": "",
        "rows": 3,
        "unreadable": 0,
        "tail": "torn",
    }
    assert files["failures"]["rows"] == 6
    assert files["failures"]["tail"] == "unterminated"
    assert files["materialized"]["tail"] == "ok"
    assert tail_state(run.lock) is Tail.ABSENT


def test_last_run_explains_rows_that_wrote_nothing(run: OutputPaths) -> None:
    newest = max(run.output.stat().st_mtime, run.failures.stat().st_mtime)
    last = {
        "finished_at": newest + 10,
        "exit_code": 75,
        "drained": 1,
        "cancelled": 0,
        "kill_shaped": 0,
    }
    run.manifest.write_bytes(orjson.dumps({"run_id": "r1", "last_run": last}))
    left = collect_status(run.output).to_json()["left_to_run"]
    assert left["last_run"]["drained"] == 1 and left["last_run"]["stale"] is False
    assert left["never_started"] == 1

    # The dispatcher writes finished_at as an ISO-8601 UTC time.
    last["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(newest - 3600))
    run.manifest.write_bytes(orjson.dumps({"run_id": "r1", "last_run": last}))
    left = collect_status(run.output).to_json()["left_to_run"]
    assert left["last_run"]["finished_at"] == pytest.approx(int(newest - 3600))
    assert left["last_run"]["stale"] is True
    assert left["never_started"] is None
    assert "rows were written since" in render_status(collect_status(run.output))


def test_attempt_cap_from_flag_or_manifest(run: OutputPaths) -> None:
    assert collect_status(run.output, max_attempts=4).to_json()["attempts_used_up"] == 0
    run.manifest.write_bytes(orjson.dumps({"max_attempts": 4}))
    data = collect_status(run.output).to_json()
    assert data["max_attempts"] == 4
    assert data["left_to_run"]["retryable"] == 2


def test_anomalies(tmp_path: Path) -> None:
    paths = OutputPaths.for_output(tmp_path / "a.jsonl")
    write_jsonl(paths.materialized, [mat(0, 0, "m"), mat(0, 0, "m")])
    write_jsonl(paths.output, [ok(0, 0, "m"), ok(0, 0, "m"), ok(9, 0, "m")], tail=b"{not json\n")
    write_jsonl(paths.failures, [fail(8, 0, "m", "agent_run_error")])
    data = collect_status(paths.output).to_json()
    assert data["anomalies"] == {
        "duplicate_success_rows": 1,
        "duplicate_materialized_rows": 1,
        "success_rows_not_materialized": 1,
        "failure_rows_not_materialized": 1,
    }
    assert data["files"]["output"]["unreadable"] == 1
    assert data["complete"] is True
    assert "duplicate success rows: 1" in render_status(collect_status(paths.output))


def test_no_run_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="materialized_inputs"):
        collect_status(tmp_path / "nothing.jsonl")


def test_render_human_table(run: OutputPaths) -> None:
    text = render_status(collect_status(run.output))
    assert "not running" in text
    assert "expected     8 rollouts" in text
    assert "37.5%" in text
    assert "torn last line" in text
    assert "math" in text and "code" in text
    assert "no summary of the last hop" in text


def test_the_ending_of_a_run_is_the_brief_table_and_the_next_step(run: OutputPaths) -> None:
    table, step = run_ending(run.output, 3, 75)
    text = table + step
    lines = text.splitlines()

    assert lines[0] == f"{run.output}: 37.5% covered (3 of 8 succeeded); left to run: 3"
    table = render_status(collect_status(run.output))
    assert "\n".join(lines[2:8]) in table  # status's own standings table
    assert "failed attempts by class (6)" in text and "per agent" in text
    assert "files" not in text and "dispatcher   " not in text  # the short form
    assert lines[-1] == (
        "exit 75: rerun the same command to finish 3 rollouts (finished ones are kept)"
    )


@pytest.mark.parametrize(
    ("code", "step"),
    [
        (1, "exit 1: the run stopped on the error below; once it is fixed, rerun the same "
            "command to finish 3 rollouts"),
        (2, "exit 2: the run stopped on the error below; once it is fixed, rerun the same "
            "command to finish 3 rollouts"),
    ],
)  # fmt: skip
def test_the_next_step_after_an_error(run: OutputPaths, code: int, step: str) -> None:
    assert next_step(collect_status(run.output), code) == step


def test_the_next_step_after_an_error_with_nothing_left_to_run(tmp_path: Path) -> None:
    paths = OutputPaths.for_output(tmp_path / "none.jsonl")
    write_jsonl(paths.materialized, [mat(0, 0, "a")])
    write_jsonl(paths.failures, [fail(0, 0, "a", "agent_run_error", terminal=True)])
    assert next_step(collect_status(paths.output), 1) == (
        "exit 1: the run stopped on the error below, which says what to do"
    )


def test_the_next_step_of_a_finished_run_says_where_the_rows_are(tmp_path: Path) -> None:
    paths = OutputPaths.for_output(tmp_path / "done.jsonl")
    write_jsonl(paths.materialized, [mat(0, 0, "a"), mat(1, 0, "a")])
    write_jsonl(paths.output, [ok(0, 0, "a")])
    write_jsonl(paths.failures, [fail(1, 0, "a", "protocol_violation", terminal=True)])

    assert next_step(collect_status(paths.output), 0) == (
        f"exit 0: every rollout is final; the rows are in {paths.output} (1 succeeded), "
        f"the 1 failed for good in {paths.failures}; `dispatcher report {paths.output}` "
        "tells more"
    )


def lock_holder(lock: Path) -> subprocess.Popen[str]:
    code = (
        "import fcntl, os, sys\n"
        f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT, 0o644)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "os.write(fd, str(os.getpid()).encode())\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def test_lock_held_by_another_process(run: OutputPaths) -> None:
    holder = lock_holder(run.lock)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        data = collect_status(run.output).to_json()
        assert data["running"] is True
        assert data["lock"] == {"held": True, "pid": holder.pid}
        assert f"pid {holder.pid} holds the run lock" in render_status(collect_status(run.output))
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
        assert holder.stdout is not None
        holder.stdout.close()
    assert lock_status(run.lock).held is False


def test_lock_probe_does_not_take_the_lock(tmp_path: Path) -> None:
    lock = tmp_path / "x_run.lock"
    lock.write_text("not a pid")
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert lock_status(lock).held is True
        assert lock_status(lock).pid is None
        fcntl.flock(fd, fcntl.LOCK_UN)
        assert lock_status(lock).held is False
        # The probe released its own shared lock: an exclusive one is free again.
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dispatcher")
    status_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_json_and_exit_codes(run: OutputPaths, capsys: pytest.CaptureFixture[str]) -> None:
    args = cli(["status", str(run.output), "--json"])
    assert args.handler(args) == 75
    data = orjson.loads(capsys.readouterr().out)
    assert data["expected"] == 8

    complete = OutputPaths.for_output(run.output.parent / "done.jsonl")
    write_jsonl(complete.materialized, [mat(0, 0, "m")])
    write_jsonl(complete.output, [ok(0, 0, "m")])
    args = cli(["status", str(complete.output)])
    assert args.handler(args) == 0
    assert "coverage     100.0%" in capsys.readouterr().out


def test_cli_rejects_bad_max_attempts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli(["status", "x.jsonl", "--max-attempts", "0"])
    assert "must be >= 1" in capsys.readouterr().err
