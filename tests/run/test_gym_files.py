"""NeMo Gym Main's contracts in a run (contracts §15): the run id and failure record on
rows, omitted rollouts, the coverage and status files, the failure limit, resume order
and extra attempts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from dispatcher.delivery.answers import Failure
from dispatcher.delivery.statuses import RetryReason
from dispatcher.errors import ConfigError
from dispatcher.files.coverage import Omissions, coverage
from dispatcher.files.resume import OutputPaths, RunState, load_run_state
from dispatcher.ops.merge import merge_shards
from dispatcher.ops.report import build_report
from dispatcher.ops.status import collect_status
from dispatcher.rows.failure_record import (
    FailureKind,
    collector_record,
    environment_record,
    kind_for_class,
    kind_for_retry_reason,
)
from dispatcher.run.gym_files import StatusThrottle
from dispatcher.run.pending import longest_first
from dispatcher.settings.config import load_settings
from dispatcher.tasks.keys import rollout_key
from tests.helpers import (
    CliProcess,
    FakeAgent,
    log_events,
    read_jsonl,
    run_args,
    run_cli,
    spawn_cli,
    wait_until,
    write_tasks,
)

# -- pure rules -----------------------------------------------------------------------


def test_failure_kinds_map_our_classes_and_retry_reasons_onto_gyms_names() -> None:
    assert kind_for_class("agent_run_error") is FailureKind.AGENT_RUN_ERROR
    assert kind_for_class("timeout_exceeded") is FailureKind.AGENT_TIMEOUT
    assert kind_for_class("protocol_violation") is FailureKind.PROTOCOL_VIOLATION
    assert kind_for_class("agent_request_failed") is FailureKind.AGENT_REQUEST_FAILED
    assert kind_for_class("cancelled") is FailureKind.CANCELLED
    assert kind_for_class("kill_shaped") is FailureKind.KILL_SHAPED
    assert kind_for_class("drained") is FailureKind.SHUTDOWN
    # An agent's own class: kept when Gym knows it, else the environment's failure.
    assert kind_for_class("judge_failed") is FailureKind.JUDGE_FAILED
    assert kind_for_class("my_own_thing") is FailureKind.ENVIRONMENT_SERVER_FAILED
    reasons = {reason: kind_for_retry_reason(reason) for reason in RetryReason}
    assert reasons[RetryReason.NO_ANSWER] is FailureKind.TRANSPORT_UNREACHABLE
    assert reasons[RetryReason.CONNECT_TIMEOUT] is FailureKind.TRANSPORT_TIMEOUT
    assert reasons[RetryReason.FIRST_BYTE_TIMEOUT] is FailureKind.TRANSPORT_TIMEOUT
    for status in ("http_409_admission_closed", "http_429", "http_502", "http_503", "http_504"):
        assert reasons[RetryReason(status)] is FailureKind.AGENT_REQUEST_FAILED
    assert kind_for_retry_reason(None) is FailureKind.TRANSPORT_UNREACHABLE


def test_a_collector_record_says_what_the_dispatcher_saw() -> None:
    row = {"_ng_task_index": 3, "_ng_rollout_index": 1}
    missed = Failure(
        "agent_request_failed", "DeliveryDeadlineExceeded", "x" * 5000,
        not_delivered=True, retry_reason="connect_timeout",
    )  # fmt: skip
    record = collector_record(row, 2, "run-1", missed)
    assert record == {
        "schema_version": 1,
        "episode_id": {"rollout_id": "3-1", "attempt": 2},
        "run_id": "run-1",
        "source": "collector",
        "delivery": "not_sent",
        "failure": {
            "failure_reason": "x" * 2000,
            "terminal": False,
            "failure_kind": "transport_timeout",
        },
        "http_status": None,
        "exception_type": "DeliveryDeadlineExceeded",
    }
    answered = Failure("agent_run_error", "ClientResponseError", "HTTP 500", http_status=500)
    assert collector_record(row, 0, "r", answered)["delivery"] == "delivered"
    timed_out = Failure("timeout_exceeded", "TimeoutError", "ran out")
    assert collector_record(row, 0, "r", timed_out)["delivery"] == "possibly_delivered"


def test_an_environment_record_keeps_the_agents_stage_and_kind() -> None:
    row = {
        "_ng_task_index": 0,
        "_ng_rollout_index": 0,
        "_ng_rollout_id": "task-a",
        "_ng_failure_class": "judge_failed",
        "_ng_failure_stage": "verification",
        "_ng_failure_message": "judge down",
        "_ng_failure_type": "AgentReportedFailure",
        "_ng_failure_terminal": True,
        "_ng_failure_http_status": None,
    }
    record = environment_record(row, 1, "r")
    assert record["episode_id"] == {"rollout_id": "task-a", "attempt": 1}
    assert (record["source"], record["delivery"]) == ("environment", "delivered")
    assert record["failure"] == {
        "failure_reason": "judge down",
        "terminal": True,
        "failure_kind": "judge_failed",
        "stage": "verification",
    }
    row["_ng_failure_stage"] = "nowhere"
    assert "stage" not in environment_record(row, 1, "r")["failure"]


def test_the_status_file_is_refreshed_at_most_every_interval() -> None:
    now = [100.0]
    throttle = StatusThrottle(5.0, clock=lambda: now[0])
    assert throttle.due()  # the first durable row
    now[0] = 104.9
    assert not throttle.due()
    now[0] = 105.0
    assert throttle.due()
    now[0] = 106.0
    assert not throttle.due()


def test_coverage_counts_each_rollout_once() -> None:
    state = RunState(max_attempts=2)
    state.add_success(rollout_key(0, 0), "a", 1.0, None)
    state.add_success(rollout_key(1, 0), "a", 0.0, True)  # masked
    state.add_success(rollout_key(2, 0), "a", None, None)  # unscored
    state.add_success(rollout_key(2, 0), "a", None, None)  # a duplicate row counts once
    state.add_success(rollout_key(3, 0), "a", True, None)  # a bool is no score
    fail = {"agent_ref": {"name": "a"}, "_ng_failure_class": "agent_run_error"}
    state.add_failure(rollout_key(4, 0), {**fail, "_ng_failure_terminal": True})
    state.add_failure(rollout_key(5, 0), fail)
    state.add_failure(rollout_key(5, 0), fail)  # exhausted
    state.add_failure(rollout_key(6, 0), fail)  # waits for a retry
    state.add_failure(rollout_key(7, 0), {**fail, "_ng_failure_not_delivered": True})
    state.add_failure(rollout_key(8, 0), {**fail, "_ng_omitted_rollout": True})  # nothing
    got = coverage(state, 12, Omissions(total=2, without_attempts=1))
    assert {k: v for k, v in got.items() if k != "schema_version"} == {
        "expected": 12,
        "successful": 4,
        "failed": 2,
        "masked": 1,
        "unscored": 2,
        "intentionally_omitted": 2,
        # 12 - 6 final = 6 not final: 2 wait for a retry, 1 omitted without attempts.
        "never_dispatched": 3,
        "retry_pending": 2,
        "attempts": 4 + 5,
        "counted_failures": 4,
        "attempts_exhausted": 1,
        "completion_fraction": 0.5,
        "complete": False,
    }


def test_extend_attempts_raises_the_cap_and_bad_values_are_refused(tmp_path: Path) -> None:
    base = {"input": "t.jsonl", "output": str(tmp_path / "x.jsonl")}
    assert load_settings({**base, "extend_attempts": "2"}, env={}).attempt_cap == 5
    assert load_settings(base, env={}).attempt_cap == 3
    with pytest.raises(ConfigError, match="max_failure_fraction"):
        load_settings({**base, "max_failure_fraction": "1.5"}, env={})
    with pytest.raises(ConfigError, match="extend_attempts"):
        load_settings({**base, "extend_attempts": "-1"}, env={})


def test_resume_order_is_longest_earlier_attempt_first_then_input_order(tmp_path: Path) -> None:
    materialized = tmp_path / "m.jsonl"
    lines = [
        orjson.dumps({"q": i, "_ng_task_index": i, "_ng_rollout_index": 0}) + b"\n"
        for i in range(6)
    ]
    materialized.write_bytes(b"".join(lines))
    offsets = [sum(len(line) for line in lines[:i]) for i in range(6)]
    state = RunState(max_attempts=3)
    for task, duration in ((1, 2.0), (4, 9.0), (2, 2.0), (5, 1.0)):
        state.longest_s[rollout_key(task, 0)] = duration
    state.add_success(rollout_key(5, 0), "a", 1.0, None)  # final: not started again
    with materialized.open("rb") as f:
        order = longest_first(f, state)
    assert order == [offsets[4], offsets[1], offsets[2]]


# -- real runs ------------------------------------------------------------------------


def _answer(body: dict[str, Any]) -> web.StreamResponse:
    """Task 0 succeeds, 1 is an agent error, 2 a failure the agent reports, 3 is
    masked, 4 scores nothing, 5 is kill-shaped."""
    task = body["_ng_task_index"]
    if task == 1:
        return web.json_response({"detail": "boom"}, status=500)
    if task == 2:
        return web.json_response(
            {
                "_ng_failure_class": "judge_failed",
                "_ng_failure_stage": "verification",
                "_ng_failure_message": "judge unreachable",
                "_ng_failure_terminal": True,
            }
        )
    if task == 3:
        return web.json_response({"reward": 0.0, "mask_sample": True})
    if task == 4:
        return web.json_response({"answer": "no reward"})
    if task == 5:
        return web.json_response({"_ng_no_persist": True})
    return web.json_response({"reward": 1.0})


async def _run(tmp_path: Path, respond: Any, tasks: int, *extra: str) -> tuple[Any, OutputPaths]:
    agent = FakeAgent(respond)
    await agent.start()
    try:
        write_tasks(tmp_path / "tasks.jsonl", tasks)
        output = tmp_path / "x.jsonl"
        args = run_args(tmp_path / "tasks.jsonl", output, agent.url, "--fsync", "never", *extra)
        result = await run_cli(*args)
    finally:
        await agent.close()
    return result, OutputPaths.for_output(output)


def _json(path: Path) -> dict[str, Any]:
    body: dict[str, Any] = orjson.loads(path.read_bytes())
    return body


async def test_rows_carry_the_run_id_and_failures_a_typed_record(tmp_path: Path) -> None:
    result, paths = await _run(tmp_path, _answer, 6, "--max-attempts", "1", "--record-omitted")
    assert result.returncode == 75, result.stderr[-2000:]  # the kill-shaped one remains
    run_id = _json(paths.manifest)["run_id"]
    rows, failures = read_jsonl(paths.output), read_jsonl(paths.failures)
    assert len(rows) == 3 and len(failures) == 3
    assert {row["_ng_run_id"] for row in rows + failures} == {run_id}
    by_task = {row["_ng_task_index"]: row for row in failures}
    agent_error = by_task[1]["_ng_failure_record"]
    assert agent_error["episode_id"] == {"rollout_id": "1-0", "attempt": 0}
    assert (agent_error["source"], agent_error["delivery"]) == ("collector", "delivered")
    assert agent_error["failure"]["failure_kind"] == "agent_run_error"
    assert (agent_error["http_status"], agent_error["run_id"]) == (500, run_id)
    reported = by_task[2]["_ng_failure_record"]
    assert (reported["source"], reported["delivery"]) == ("environment", "delivered")
    assert reported["failure"] == {
        "failure_reason": "judge unreachable",
        "terminal": True,
        "failure_kind": "judge_failed",
        "stage": "verification",
    }
    omitted = by_task[5]
    assert omitted["_ng_omitted_rollout"] is True
    assert omitted["_ng_omitted_cause"] == "kill_shaped"
    assert omitted["_ng_failure_record"]["failure"]["failure_kind"] == "kill_shaped"


async def test_coverage_and_status_files_at_the_end_of_the_hop(tmp_path: Path) -> None:
    result, paths = await _run(tmp_path, _answer, 6, "--max-attempts", "1")
    assert result.returncode == 75, result.stderr[-2000:]
    got = _json(paths.coverage)
    assert {k: got[k] for k in ("expected", "successful", "failed", "masked", "unscored")} == {
        "expected": 6,
        "successful": 3,
        "failed": 2,
        "masked": 1,
        "unscored": 1,
    }
    assert (got["intentionally_omitted"], got["never_dispatched"]) == (1, 0)
    assert (got["attempts"], got["counted_failures"], got["attempts_exhausted"]) == (5, 2, 1)
    assert (got["completion_fraction"], got["complete"]) == (round(5 / 6, 6), False)
    status = _json(paths.status)
    assert status["run_id"] == _json(paths.manifest)["run_id"]
    assert status["agents"]["sim"] == {
        "expected_rollout_count": 6,
        "completed_rollout_count": 5,
        "remaining_rollout_count": 1,
        "failures_by_class": {"agent_run_error": 1, "judge_failed": 1},
        "aggregation_status": "pending",
    }


async def test_omitted_rows_count_as_nothing_and_resume_runs_them(tmp_path: Path) -> None:
    # A budget of 0 s drains every rollout: each gets an omitted row, none an attempt.
    result, paths = await _run(tmp_path, _answer, 4, "--record-omitted", "--dispatch-budget-s", "0")
    assert result.returncode == 75, result.stderr[-2000:]
    failures = read_jsonl(paths.failures)
    assert [row["_ng_omitted_cause"] for row in failures] == ["drained"] * 4
    assert {row["_ng_failure_record"]["delivery"] for row in failures} == {"not_sent"}
    state = load_run_state(paths, 1)
    assert (state.failed_attempts, state.failure_classes, state.latest_failure) == (
        Counter(),
        Counter(),
        {},
    )
    status = collect_status(paths.output).to_json()
    assert status["per_agent"]["sim"]["failures_by_class"] == {}
    assert status["left_to_run"]["total"] == 4
    assert build_report(paths.output, None, None)["attempts"]["total"] == 0
    merged = merge_shards([paths.output], tmp_path / "merged" / "m.jsonl")
    assert (merged.shards[0].final, merged.shards[0].missing) == (0, 4)
    got = _json(paths.coverage)
    assert (got["intentionally_omitted"], got["never_dispatched"], got["attempts"]) == (4, 0, 0)

    # The next hop runs them all, as first attempts.
    result, _ = await _run(tmp_path, lambda body: web.json_response({"reward": 1.0}), 4)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = read_jsonl(paths.output)
    assert len(rows) == 4 and not any("_ng_attempt_index" in row for row in rows)
    assert _json(paths.coverage)["complete"] is True


async def test_the_failure_limit_stops_the_run_with_exit_1(tmp_path: Path) -> None:
    broken = FakeAgent(lambda body: web.json_response({"detail": "broken"}, status=500), gated=True)
    await broken.start()
    write_tasks(tmp_path / "tasks.jsonl", 40)
    args = run_args(
        tmp_path / "tasks.jsonl", tmp_path / "x.jsonl", broken.url,
        "--concurrency", "1", "--max-failure-fraction", "0.05",
    )  # fmt: skip
    proc = await spawn_cli(*args)
    try:
        # One answer at a time, each counted before the next: 3 counted failures
        # exceed 0.05 x 40 = 2.
        for answered in range(1, 4):
            await wait_until(lambda: broken.holding == 1 or proc.exited, timeout_s=60)
            broken.release_next()
            await wait_until(_answered(proc, answered), timeout_s=60)
        result = await proc.wait()
    finally:
        await proc.kill()
        await broken.close()
    assert result.returncode == 1, result.stderr[-2000:]
    assert "--max-failure-fraction 0.05" in result.stderr
    # The one started meanwhile is cancelled; nothing more starts.
    assert broken.seen in (3, 4)
    summary = next(e for e in log_events(result.stderr) if e.get("event") == "run_summary")
    assert "--max-failure-fraction" in summary["failure_limit_exceeded"]


def _answered(proc: CliProcess, count: int) -> Callable[[], bool]:
    """True once ``count`` rollouts were counted (or the run ended)."""

    def counted() -> bool:
        finished = [e for e in proc.events() if e.get("event") == "rollout_finished"]
        return len(finished) >= count or proc.exited

    return counted


async def test_resume_starts_the_longest_first_and_extend_attempts_adds_tries(
    tmp_path: Path,
) -> None:
    failing = lambda body: web.json_response({"detail": "no"}, status=500)  # noqa: E731
    result, paths = await _run(tmp_path, failing, 5, "--max-attempts", "1")
    # Every rollout failed and is final; all as agent_run_error, so not done (exit 1).
    assert result.returncode == 1, result.stderr[-2000:]
    # The earlier attempts' durations, as the failure rows carry them.
    durations = {0: 0.5, 1: 4.0, 2: 0.1, 3: 4.0, 4: 2.0}
    rows = read_jsonl(paths.failures)
    for row in rows:
        row["_ng_dispatch"]["duration_s"] = durations[row["_ng_task_index"]]
    paths.failures.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))

    # Without more attempts every rollout is final: nothing runs.
    result, _ = await _run(tmp_path, failing, 5, "--max-attempts", "1")
    assert result.returncode == 1
    agent = FakeAgent(lambda body: web.json_response({"reward": 1.0}))
    await agent.start()
    try:
        args = run_args(
            tmp_path / "tasks.jsonl", paths.output, agent.url,
            "--max-attempts", "1", "--extend-attempts", "1", "--concurrency", "1",
        )  # fmt: skip
        result = await run_cli(*args)
    finally:
        await agent.close()
    assert result.returncode == 0, result.stderr[-2000:]
    assert agent.task_indexes() == [1, 3, 4, 0, 2]
    assert {body["_ng_attempt_index"] for body in agent.bodies} == {1}
    assert _json(paths.manifest)["max_attempts"] == 2


async def test_status_and_report_count_the_attempt_cap_as_the_hop_did_with_extend_attempts(
    tmp_path: Path,
) -> None:
    # A job script that asks `status` with the flags it ran with: the hop's cap was
    # --max-attempts + --extend-attempts, and status must not judge with another.
    failing = lambda body: web.json_response({"detail": "no"}, status=500)  # noqa: E731
    flags = ("--max-attempts", "1", "--extend-attempts", "2")
    result, paths = await _run(tmp_path, failing, 2, *flags)
    assert result.returncode == 75, result.stderr[-2000:]  # one failure each of 3 allowed

    status = await run_cli("status", str(paths.output), "--json", *flags)
    report = await run_cli("report", str(paths.output), *flags)

    assert status.returncode == 75, status.stderr
    assert orjson.loads(status.stdout)["max_attempts"] == 3
    assert report.returncode == 0, report.stderr  # it took the flags the hop took


async def test_each_service_job_writes_its_files_in_its_folder(tmp_path: Path) -> None:
    from tests.serve.test_service_e2e import Serve, rows

    agent = FakeAgent(lambda body: web.json_response({"reward": 1.0}))
    await agent.start()
    serve = await Serve.start(tmp_path / "state", agent.url)
    try:
        await serve.submit(job_id="j1", rows=rows(3))
        stream = await serve.results("j1", wait=True)
    finally:
        assert await serve.stop() == 0
        await agent.close()
    assert stream[-1] == {"end": "done"}
    paths = OutputPaths.for_output(tmp_path / "state" / "jobs" / "j1" / "rollouts.jsonl")
    run_id = _json(paths.manifest)["run_id"]
    assert {row["_ng_run_id"] for row in read_jsonl(paths.output)} == {run_id}
    got = _json(paths.coverage)
    assert (got["expected"], got["successful"], got["complete"]) == (3, 3, True)
    status = _json(paths.status)
    assert status["run_id"] == run_id
    assert status["agents"]["sim"]["completed_rollout_count"] == 3


async def test_the_status_file_is_written_on_the_first_durable_row(tmp_path: Path) -> None:
    agent = FakeAgent(lambda body: web.json_response({"reward": 1.0}), gated=True)
    await agent.start()
    write_tasks(tmp_path / "tasks.jsonl", 3)
    paths = OutputPaths.for_output(tmp_path / "x.jsonl")
    args = run_args(tmp_path / "tasks.jsonl", paths.output, agent.url, "--concurrency", "1")
    proc = await spawn_cli(*args)
    try:
        await wait_until(lambda: agent.holding == 1 or proc.exited, timeout_s=60)
        agent.release_next()
        # The run goes on (the next rollout is held) while its status is on disk.
        await wait_until(lambda: paths.status.exists() or proc.exited, timeout_s=60)
        assert not proc.exited
        during = _json(paths.status)["agents"]["sim"]
        assert not paths.coverage.exists()
        agent.open()
        result = await proc.wait()
    finally:
        await proc.kill()
        await agent.close()
    assert result.returncode == 0, result.stderr[-2000:]
    assert (during["completed_rollout_count"], during["remaining_rollout_count"]) == (1, 2)
    assert during["aggregation_status"] == "pending"
    after = _json(paths.status)["agents"]["sim"]
    assert (after["completed_rollout_count"], after["remaining_rollout_count"]) == (3, 0)
