"""The operator tools end to end: the real ``dispatcher`` CLI on real runs' files.

Shards of a run merged back equal the unsharded run; ``--dispatch-budget-s
auto`` from a faked Slurm job; ``status`` and ``report`` read what real runs
wrote. Custom agents hold their answers on an ``asyncio.Event`` the test
owns, so a run stays in flight (or a rollout hangs) exactly as long as the
test wants.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from dispatcher.files.resume import OutputPaths
from tests.conftest import SimAgentFactory
from tests.helpers import (
    CliResult,
    keys_of,
    log_events,
    read_jsonl,
    run_args,
    run_cli,
    serve,
    spawn_cli,
    wait_until,
)

FAST = ("--fsync", "never")
Key = tuple[int, int]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ServerFactory = Callable[[Handler], Awaitable[str]]

# Variables a CI runner (or a developer's Slurm session) may carry that would
# steer `--shard auto` or `--dispatch-budget-s auto` of the runs under test.
_SCHEDULER_ENV = (
    "SLURM_ARRAY_TASK_ID",
    "SLURM_ARRAY_TASK_COUNT",
    "SLURM_ARRAY_TASK_MIN",
    "SLURM_ARRAY_TASK_MAX",
    "SLURM_ARRAY_TASK_STEP",
    "SLURM_JOB_ID",
    "SLURM_JOB_END_TIME",
    "JOB_COMPLETION_INDEX",
)


@pytest.fixture(autouse=True)
def _no_scheduler_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _SCHEDULER_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
async def agent_server() -> AsyncIterator[ServerFactory]:
    """Serve ``POST /run`` with a custom handler on 127.0.0.1; returns the base URL."""
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        app = web.Application()
        app.router.add_post("/run", handler)
        runner, url = await serve(app)
        runners.append(runner)
        return url

    yield start
    for runner in runners:
        await runner.cleanup()


def files(output: Path) -> OutputPaths:
    return OutputPaths.for_output(output)


def row_line(text: str) -> bytes:
    return orjson.dumps({"responses_create_params": {"input": text}, "agent_ref": {"name": "sim"}})


def write_task_file(path: Path, repeats: int) -> set[Key]:
    """30 rows over 24 distinct tasks (some rows repeated verbatim); the keys they expand to.

    Identical rows share one task index and each occurrence adds ``repeats``
    rollouts to it (contracts §1), so a shard must see every occurrence.
    """
    questions = [f"question {i}" for i in range(24)]
    order = [
        *questions[:8],
        questions[2],
        *questions[8:16],
        questions[5],
        questions[5],
        *questions[16:],
        questions[0],
        questions[13],
        questions[23],
    ]
    assert len(order) == 30
    path.write_bytes(b"".join(row_line(q) + b"\n" for q in order))
    task_of: dict[str, int] = {}
    rollouts: Counter[int] = Counter()
    for question in order:
        task = task_of.setdefault(question, len(task_of))
        rollouts[task] += repeats
    return {(task, r) for task, n in rollouts.items() for r in range(n)}


def outputs_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("out*.jsonl"))


def shard_keys(keys: set[Key], index: int, count: int) -> set[Key]:
    return {k for k in keys if k[0] % count == index}


def unique_keys(rows: list[dict[str, Any]]) -> set[Key]:
    keys = keys_of(rows)
    assert len(keys) == len(set(keys)), "a rollout has more than one row"
    return set(keys)


def by_key(rows: list[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    return {(r["_ng_task_index"], r["_ng_rollout_index"]): r for r in rows}


def summary_of(result: CliResult) -> dict[str, Any]:
    (summary,) = [e for e in log_events(result.stderr) if e["event"] == "run_summary"]
    return summary


async def json_command(*args: str) -> tuple[int, dict[str, Any]]:
    result = await run_cli(*args, "--json")
    assert result.stderr == "", result.stderr
    return result.returncode, orjson.loads(result.stdout)


# ---- shards -----------------------------------------------------------------------------


async def test_shards_merged_equal_the_unsharded_run(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, _ = await sim_agent(reward_p=0.5)
    tasks = tmp_path / "tasks.jsonl"
    expected = write_task_file(tasks, repeats=3)
    assert len(expected) == 90

    def run(output: Path, *extra: str) -> Awaitable[CliResult]:
        return run_cli(*run_args(tasks, output, url, "--num-repeats", "3", *FAST, *extra))

    whole = tmp_path / "whole.jsonl"
    sharded = tmp_path / "out.jsonl"
    shard_out = [tmp_path / f"out.shard-{k}-of-3.jsonl" for k in range(3)]
    # Shard 1 first runs with a budget of 0: it drains everything and writes no row.
    results = await asyncio.gather(
        run(whole),
        run(sharded, "--shard", "0/3"),
        run(sharded, "--shard", "1/3", "--dispatch-budget-s", "0"),
        run(sharded, "--shard", "2/3"),
    )
    assert [r.returncode for r in results] == [0, 0, 75, 0], [r.stderr[-2000:] for r in results]
    assert not sharded.exists(), "a shard wrote the unsharded output"
    for k in (0, 2):
        assert unique_keys(read_jsonl(shard_out[k])) == shard_keys(expected, k, 3)
        assert unique_keys(read_jsonl(files(shard_out[k]).materialized)) == shard_keys(
            expected, k, 3
        )
    assert read_jsonl(shard_out[1]) == []
    assert summary_of(results[2])["drained"] == len(shard_keys(expected, 1, 3))

    # A shard with rollouts left: 75, what is there is merged, the missing ones are named.
    merged = tmp_path / "merged.jsonl"
    incomplete = await run_cli("merge", "--output", str(merged), *map(str, shard_out))
    assert incomplete.returncode == 75, incomplete.stdout + incomplete.stderr
    missing_1 = shard_keys(expected, 1, 3)
    assert f"missing rollouts ({len(missing_1)})" in incomplete.stdout
    first = ", ".join(f"{t}-{r}" for t, r in sorted(missing_1)[:20])
    assert f"first: {first}" in incomplete.stdout
    assert unique_keys(read_jsonl(merged)) == expected - missing_1

    # Rerunning shard 1's command resumes it; merging again replaces the merged set.
    resumed = await run(sharded, "--shard", "1/3")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    complete = await run_cli("merge", "--output", str(merged), *map(str, shard_out))
    assert complete.returncode == 0, complete.stdout + complete.stderr

    assert unique_keys(read_jsonl(merged)) == unique_keys(read_jsonl(whole)) == expected
    assert by_key(read_jsonl(files(merged).materialized)) == by_key(
        read_jsonl(files(whole).materialized)
    )
    # The sim agent draws reward from the rollout's identity: same rollouts, same rewards.
    assert {k: r["reward"] for k, r in by_key(read_jsonl(merged)).items()} == {
        k: r["reward"] for k, r in by_key(read_jsonl(whole)).items()
    }
    assert read_jsonl(files(merged).failures) == []


async def test_merge_with_a_shard_missing_exits_75_and_names_it(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, _ = await sim_agent()
    tasks = tmp_path / "tasks.jsonl"
    expected = write_task_file(tasks, repeats=2)
    output = tmp_path / "out.jsonl"
    results = await asyncio.gather(
        *(
            run_cli(*run_args(tasks, output, url, "--num-repeats", "2", "--shard", k, *FAST))
            for k in ("0/3", "2/3")
        )
    )
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    shards = [str(tmp_path / f"out.shard-{k}-of-3.jsonl") for k in (0, 2)]

    merged = tmp_path / "merged.jsonl"
    text = await run_cli("merge", "--output", str(merged), *shards)
    assert text.returncode == 75, text.stdout + text.stderr
    assert "shards not given: 1/3" in text.stdout

    code, report = await json_command("merge", "--output", str(merged), *shards)
    assert code == 75
    assert report["missing_shards"] == ["1/3"]
    assert report["missing"] == 0  # the shards given are complete
    present = shard_keys(expected, 0, 3) | shard_keys(expected, 2, 3)
    assert report["expected"] == report["successes"] == len(present)
    assert unique_keys(read_jsonl(merged)) == present


@pytest.mark.parametrize(
    ("env", "index"),
    [
        pytest.param(
            {
                "SLURM_ARRAY_TASK_ID": "11",
                "SLURM_ARRAY_TASK_MIN": "10",
                "SLURM_ARRAY_TASK_COUNT": "3",
            },
            1,
            id="slurm-array",
        ),
        pytest.param(
            {"JOB_COMPLETION_INDEX": "2", "DISPATCHER_SHARD_COUNT": "3"}, 2, id="k8s-indexed-job"
        ),
    ],
)
async def test_shard_auto_from_the_scheduler_environment(
    tmp_path: Path, sim_agent: SimAgentFactory, env: dict[str, str], index: int
) -> None:
    url, _ = await sim_agent()
    tasks = tmp_path / "tasks.jsonl"
    expected = write_task_file(tasks, repeats=2)
    output = tmp_path / "out.jsonl"
    result = await run_cli(
        *run_args(tasks, output, url, "--num-repeats", "2", "--shard", "auto", *FAST), env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    shard_output = tmp_path / f"out.shard-{index}-of-3.jsonl"
    assert outputs_in(tmp_path) == [
        shard_output.name,
        f"out.shard-{index}-of-3_attempt_reservations.jsonl",
        f"out.shard-{index}-of-3_failures.jsonl",
        f"out.shard-{index}-of-3_materialized_inputs.jsonl",
    ]
    assert unique_keys(read_jsonl(shard_output)) == shard_keys(expected, index, 3)


# ---- --dispatch-budget-s auto -----------------------------------------------------------


@pytest.mark.parametrize(
    ("end_in_s", "reserve"),
    [
        pytest.param(1000, ("--budget-reserve-s", "1000"), id="reserve-eats-it"),
        pytest.param(-60, (), id="job-end-passed"),
    ],
)
async def test_budget_auto_at_the_job_end_drains_everything(
    tmp_path: Path, sim_agent: SimAgentFactory, end_in_s: int, reserve: tuple[str, ...]
) -> None:
    url, stats = await sim_agent()
    tasks = tmp_path / "tasks.jsonl"
    expected = write_task_file(tasks, repeats=1)
    output = tmp_path / "out.jsonl"
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_END_TIME": str(int(time.time()) + end_in_s)}
    result = await run_cli(
        *run_args(tasks, output, url, "--dispatch-budget-s", "auto", *reserve, *FAST), env=env
    )
    assert result.returncode == 75, result.stderr[-2000:]
    events = log_events(result.stderr)
    assert any(e["event"] == "dispatch_budget_exhausted" for e in events)
    summary = summary_of(result)
    assert summary["drained"] == summary["remaining"] == len(expected)
    assert "will run on resume" in summary["drained_note"]
    assert stats.requests == 0
    assert read_jsonl(output) == [] and read_jsonl(files(output).failures) == []

    code, status = await json_command("status", str(output))
    assert code == 75
    assert status["left_to_run"]["no_row"] == len(expected)
    assert status["left_to_run"]["last_run"]["drained"] == len(expected)
    assert status["left_to_run"]["never_started"] == 0


async def test_budget_auto_outside_slurm_is_a_config_error(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, stats = await sim_agent()
    tasks = tmp_path / "tasks.jsonl"
    write_task_file(tasks, repeats=1)
    output = tmp_path / "out.jsonl"
    result = await run_cli(*run_args(tasks, output, url, "--dispatch-budget-s", "auto", *FAST))
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: --dispatch-budget-s auto: not inside a Slurm job (neither SLURM_JOB_END_TIME "
        "nor SLURM_JOB_ID is set); give the budget in seconds instead"
    ]
    assert stats.requests == 0
    assert not files(output).materialized.exists()


async def test_budget_auto_with_time_left_runs_normally(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, stats = await sim_agent()
    tasks = tmp_path / "tasks.jsonl"
    expected = write_task_file(tasks, repeats=1)
    output = tmp_path / "out.jsonl"
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_END_TIME": str(int(time.time()) + 3600)}
    result = await run_cli(
        *run_args(
            tasks, output, url, "--dispatch-budget-s", "auto", "--budget-reserve-s", "300", *FAST
        ),
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (auto,) = [e for e in log_events(result.stderr) if e["event"] == "dispatch_budget_auto"]
    assert 3200 < auto["budget_s"] <= 3300
    assert auto["source"] == "SLURM_JOB_END_TIME"
    assert summary_of(result)["drained"] == 0
    assert unique_keys(read_jsonl(output)) == expected
    assert stats.requests == len(expected)


# ---- status -----------------------------------------------------------------------------


async def protocol_violation(request: web.Request) -> web.StreamResponse:
    """A 2xx answer whose body is a JSON list, not an object: terminal (contracts §5)."""
    await request.read()
    return web.json_response([1, 2, 3])


def write_two_agent_tasks(path: Path, sim_rows: int) -> None:
    lines = [row_line(f"question {i}") for i in range(sim_rows)]
    lines.append(
        orjson.dumps({"responses_create_params": {"input": "bad"}, "agent_ref": {"name": "bad"}})
    )
    path.write_bytes(b"".join(line + b"\n" for line in lines))


def tally_files(output: Path) -> dict[str, Any]:
    """What the status of a run must say, counted straight from its files."""
    successes = unique_keys(read_jsonl(output))
    failures: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    for row in read_jsonl(files(output).failures):
        failures[(row["_ng_task_index"], row["_ng_rollout_index"])].append(row)
    terminal = {k for k, rows in failures.items() if rows[-1]["_ng_failure_terminal"]}
    retryable = set(failures) - successes - terminal
    assert all(len(failures[k]) < 3 for k in retryable)
    return {
        "successes": len(successes),
        "terminal": len(terminal),
        "retryable": len(retryable),
        "failures_by_class": dict(
            Counter(r["_ng_failure_class"] for rows in failures.values() for r in rows)
        ),
    }


async def test_status_counts_agree_with_the_output_files(
    tmp_path: Path, sim_agent: SimAgentFactory, agent_server: ServerFactory
) -> None:
    sim_url, _ = await sim_agent(fail_500=0.3, seed=7)
    bad_url = await agent_server(protocol_violation)
    tasks = tmp_path / "tasks.jsonl"
    write_two_agent_tasks(tasks, sim_rows=20)
    output = tmp_path / "out.jsonl"
    args = run_args(tasks, output, sim_url, "--agent", f"bad={bad_url}", "--num-repeats", "2")
    result = await run_cli(*args, *FAST)
    assert result.returncode == 75, result.stderr[-2000:]

    counted = tally_files(output)
    assert counted["retryable"] > 0 and counted["terminal"] == 2
    assert counted["failures_by_class"] == {
        "agent_run_error": counted["retryable"],
        "protocol_violation": 2,
    }
    code, status = await json_command("status", str(output))
    assert code == 75
    assert status["running"] is False and status["lock"]["held"] is False
    assert status["expected"] == 42
    assert status["successes"] == counted["successes"] == 40 - counted["retryable"]
    assert status["terminal"] == 2
    assert status["attempts_used_up"] == 0
    assert status["failures_by_class"] == counted["failures_by_class"]
    assert status["failed_attempts"] == counted["retryable"] + 2
    assert status["final"] == counted["successes"] + 2
    assert status["coverage"] == pytest.approx(counted["successes"] / 42)
    assert status["complete"] is False
    left = status["left_to_run"]
    assert left["total"] == left["retryable"] == counted["retryable"]
    assert left["no_row"] == 0 and left["never_started"] == 0
    assert left["last_run"]["exit_code"] == 75 and left["last_run"]["stale"] is False

    bad, sim = status["per_agent"]["bad"], status["per_agent"]["sim"]
    assert (bad["expected"], bad["terminal"], bad["successes"]) == (2, 2, 0)
    assert bad["failures_by_class"] == {"protocol_violation": 2}
    assert (sim["expected"], sim["successes"], sim["retryable"]) == (
        40,
        counted["successes"],
        counted["retryable"],
    )
    assert {f["tail"] for f in status["files"].values()} == {"ok"}
    assert not any(status["anomalies"].values())

    text = await run_cli("status", str(output))
    assert text.returncode == 75
    assert "not running (run lock free)" in text.stdout
    assert f"left to run on resume: {counted['retryable']}" in text.stdout


async def test_status_reports_the_run_lock_while_a_dispatcher_runs(
    tmp_path: Path, agent_server: ServerFactory
) -> None:
    gate = asyncio.Event()
    arrived = 0

    async def gated(request: web.Request) -> web.StreamResponse:
        nonlocal arrived
        body = await request.json(loads=orjson.loads)
        arrived += 1
        await gate.wait()
        return web.json_response({"reward": 1.0, "echo_task": body["_ng_task_index"]})

    url = await agent_server(gated)
    tasks = tmp_path / "tasks.jsonl"
    expected = len(write_task_file(tasks, repeats=1))
    output = tmp_path / "out.jsonl"
    run = await spawn_cli(*run_args(tasks, output, url, *FAST))
    try:
        await wait_until(lambda: arrived == expected)
        code, status = await json_command("status", str(output))
        assert code == 75
        assert status["running"] is True
        assert status["lock"] == {"held": True, "pid": run.proc.pid}
        assert status["successes"] == 0 and status["left_to_run"]["no_row"] == expected
        text = await run_cli("status", str(output))
        assert f"running (pid {run.proc.pid} holds the run lock" in text.stdout

        gate.set()
        result = await run.wait()
        assert result.returncode == 0, result.stderr[-2000:]
    finally:
        gate.set()
        await run.kill()

    code, status = await json_command("status", str(output))
    assert code == 0
    assert status["running"] is False and status["lock"]["held"] is False
    assert status["successes"] == status["expected"] == expected
    assert status["complete"] is True


# ---- report -----------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


async def test_report_on_a_run_with_rollouts_that_hit_the_limit(
    tmp_path: Path, agent_server: ServerFactory
) -> None:
    never = asyncio.Event()  # set only at teardown: those rollouts run into the limit

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.json(loads=orjson.loads)
        task, rollout = body["_ng_task_index"], body["_ng_rollout_index"]
        if task % 4 == 3:
            await never.wait()
        # Task t passes in (t % 4) of its 4 repeats (0, 1 or 2).
        return web.json_response({"reward": 1.0 if rollout < task % 4 else 0.0})

    url = await agent_server(answer)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(b"".join(row_line(f"question {i}") + b"\n" for i in range(8)))
    output = tmp_path / "out.jsonl"
    args = run_args(tasks, output, url, "--num-repeats", "4", "--rollout-timeout-s", "0.5")
    try:
        result = await run_cli(*args, *FAST)
    finally:
        never.set()
    assert result.returncode == 75, result.stderr[-2000:]
    hung = 2 * 4  # tasks 3 and 7
    failures = read_jsonl(files(output).failures)
    assert [r["_ng_failure_class"] for r in failures] == ["timeout_exceeded"] * hung

    code, report = await json_command("report", str(output), "--rollout-timeout-s", "0.5")
    assert code == 0
    assert report["attempts"] == {
        "total": 32,
        "successes": 24,
        "failures": hung,
        "without_duration": 0,
    }
    for kind, n in (("success", 24), ("failure", hung), ("all", 32)):
        stats = report["durations_s"][kind]
        assert stats["n"] == n
        assert all(stats[p] is not None for p in ("mean", "p50", "p90", "p99", "max"))
        assert stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"]
    # uvloop's millisecond timers may fire a hair before 0.5 s of perf_counter time.
    assert report["durations_s"]["failure"]["p50"] >= 0.99 * 0.5
    limit = report["limit"]
    assert limit["rollout_timeout_s"] == 0.5
    assert limit["timeout_exceeded"] == hung
    assert limit["hit_limit"] == hung

    rewards = [r["reward"] for r in read_jsonl(output)]
    assert report["rewards"]["sim"]["successes"] == 24
    assert report["rewards"]["sim"]["mean"] == pytest.approx(sum(rewards) / len(rewards))

    # pass@k over the 6 tasks whose 4 rollouts are final (the hung ones are retryable).
    table = report["pass_at_k"]["sim"]
    assert (table["tasks"], table["max_repeats"]) == (6, 4)
    assert set(table["k"]) == {"1", "2", "4"}
    passes = [t % 4 for t in range(8) if t % 4 != 3]
    for k in (1, 2, 4):
        want = sum(pass_at_k(4, c, k) for c in passes) / len(passes)
        assert table["k"][str(k)] == {"value": pytest.approx(want), "tasks": 6}

    text = await run_cli("report", str(output), "--rollout-timeout-s", "0.5")
    assert text.returncode == 0, text.stderr
    assert f"per-rollout limit 0.5 s: {hung} attempts hit it" in text.stdout
    assert "pass@k" in text.stdout and "reward per agent" in text.stdout
