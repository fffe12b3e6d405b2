"""Chaos: SIGKILL the real CLI at random instants, rerun until done, audit the files.

Two thousand rollouts against a simulated agent with lognormal latency and
some retryable (and a few terminal) failures. Kill instants come from a
seeded generator as "after K more rows are written", "after K more requests
reach the agent" or "as soon as dispatch starts", so the test never sleeps
and a failure replays with the same schedule. After each kill, every rollout
the run had logged as a success must be in ``X.jsonl`` (``--fsync batch``).
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable
from pathlib import Path

import orjson

from dispatcher.sim.agent import SimAgentStats
from tests.conftest import SimAgentFactory
from tests.helpers import (
    CliProcess,
    audit_outputs,
    count_lines,
    expected_keys,
    keys_of,
    run_args,
    spawn_cli,
    wait_until,
    write_tasks,
)

TASKS, REPEATS, MAX_ATTEMPTS = 500, 4, 3
KILLS = 12
SEED = 20_251_129


def kill_point(
    rng: random.Random, proc: CliProcess, output_lines: Callable[[], int], stats: SimAgentStats
) -> Callable[[], bool]:
    """A condition that becomes true at a random instant of this run."""
    mode = rng.choice(("rows", "rows", "requests", "requests", "dispatch_started"))
    k = rng.randint(1, 160)
    if mode == "rows":
        target = output_lines() + k
        return lambda: output_lines() >= target
    if mode == "requests":
        target = stats.requests + k
        return lambda: stats.requests >= target
    return lambda: proc.saw("run_started")


def assert_acknowledged_rows_kept(proc: CliProcess, out: Path) -> None:
    """Every rollout the run logged as a success (logged after its write) is in X.jsonl."""
    acknowledged = {
        (e["task_index"], e["rollout_index"])
        for e in proc.events()
        if e["event"] == "rollout_finished" and e["outcome"] == "success"
    }
    lines = out.read_bytes().split(b"\n")[:-1] if out.exists() else []  # not a torn tail
    written = set(keys_of(orjson.loads(line) for line in lines))
    assert acknowledged <= written, f"lost acknowledged rows: {sorted(acknowledged - written)}"


async def test_sigkill_at_random_instants_then_resume_runs_every_rollout_exactly_once(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    rng = random.Random(SEED)
    url, stats = await sim_agent(
        latency="lognormal",
        latency_s=0.01,
        latency_sigma=1.0,
        fail_503=0.04,
        fail_500=0.01,
        malformed=0.003,
        seed=SEED,
    )
    tasks = write_tasks(tmp_path / "tasks.jsonl", TASKS)
    out = tmp_path / "out.jsonl"
    args = run_args(
        tasks,
        out,
        url,
        "--num-repeats",
        str(REPEATS),
        "--concurrency",
        "32",
        "--max-attempts",
        str(MAX_ATTEMPTS),
        "--fsync",
        "batch",
    )
    kills, codes = 0, []
    for _ in range(KILLS + 10):
        proc = await spawn_cli(*args)
        if kills < KILLS:
            reached = kill_point(rng, proc, lambda: count_lines(out), stats)
            await wait_until(lambda: proc.exited or reached(), timeout_s=30)  # noqa: B023
            kills += not proc.exited
            result = await proc.kill()
            assert_acknowledged_rows_kept(proc, out)
        else:
            result = await proc.wait()
        codes.append(result.returncode)
        if result.returncode == 0:
            break
        assert result.returncode in (75, -signal.SIGKILL), result.stderr[-3000:]

    assert codes[-1] == 0, f"no clean finish: {codes}"
    assert kills >= 8, f"only {kills} kills landed before the run finished: {codes}"
    audit = audit_outputs(out, expected_keys(TASKS, REPEATS), MAX_ATTEMPTS)
    assert len(audit.successes) > TASKS * REPEATS * 0.95
    assert audit.failures, "the failures sidecar should hold some retried attempts"
