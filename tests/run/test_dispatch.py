"""The dispatch core end to end: the real CLI against real agent servers on 127.0.0.1.

Fake agents hold their answers on futures the test releases, so every
ordering asserted here is caused, never timed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from dispatcher.admission.pool import Budget, RolloutPool
from dispatcher.delivery.client import body_excerpt
from dispatcher.tasks.materialize import Rollout
from tests.conftest import SimAgentFactory
from tests.helpers import (
    CliResult,
    FakeAgent,
    Responder,
    echo_result,
    free_port,
    keys_of,
    log_events,
    read_jsonl,
    run_args,
    run_cli,
    spawn_cli,
    wait_until,
    write_tasks,
)

FAST = ("--fsync", "never")
AgentFactory = Callable[..., Awaitable[FakeAgent]]


@pytest.fixture
async def fake_agent() -> AsyncIterator[AgentFactory]:
    """Start scriptable agents: ``agent = await fake_agent(respond, gated=True)``."""
    agents: list[FakeAgent] = []

    async def start(respond: Responder = echo_result, *, gated: bool = False) -> FakeAgent:
        agent = FakeAgent(respond, gated=gated)
        await agent.start()
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        await agent.close()


class Run:
    """The files of one ``--output`` under ``tmp_path``."""

    def __init__(self, tmp_path: Path, tasks: int = 0, **row: Any) -> None:
        self.dir = tmp_path / "out"
        self.dir.mkdir()
        self.tasks = tmp_path / "tasks.jsonl"
        if tasks:
            write_tasks(self.tasks, tasks, **row)
        self.output = self.dir / "x.jsonl"
        self.failures = self.dir / "x_failures.jsonl"

    def args(self, url: str, *extra: str) -> list[str]:
        return run_args(self.tasks, self.output, url, *FAST, *extra)

    def rows(self) -> list[dict[str, Any]]:
        return read_jsonl(self.output)

    def failure_rows(self) -> list[dict[str, Any]]:
        return read_jsonl(self.failures)


def summary_of(result: CliResult) -> dict[str, Any]:
    summaries = [e for e in log_events(result.stderr) if e["event"] == "run_summary"]
    assert len(summaries) == 1, result.stderr[-3000:]
    return summaries[0]


def json_response(data: Any, status: int = 200) -> Responder:
    return lambda body: web.Response(status=status, body=orjson.dumps(data))


def raw_response(status: int, body: bytes | str) -> Responder:
    return lambda _: web.Response(status=status, body=body)


def seen_count(agent: FakeAgent, count: int) -> Callable[[], bool]:
    return lambda: agent.seen == count


def names_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---- the bounded pool --------------------------------------------------------


async def test_a_thousand_rollouts_at_concurrency_50(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, stats = await sim_agent(latency="lognormal", latency_s=0.01, latency_sigma=0.3)
    run = Run(tmp_path, tasks=250)
    result = await run_cli(*run.args(url, "--num-repeats", "4", "--concurrency", "50"))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = run.rows()
    assert len(rows) == 1000
    assert set(keys_of(rows)) == {(t, r) for t in range(250) for r in range(4)}
    assert run.failure_rows() == []
    assert stats.requests == 1000
    assert 1 < stats.max_in_flight <= 50
    summary = summary_of(result)
    assert summary["outcomes"] == {"success": 1000}
    assert summary["remaining"] == 0
    assert len(read_jsonl(run.dir / "x_materialized_inputs.jsonl")) == 1000
    assert (run.dir / "x_manifest.json").exists()


async def test_rollouts_start_in_input_order_within_the_bound(
    tmp_path: Path, fake_agent: AgentFactory
) -> None:
    agent = await fake_agent(gated=True)
    run = Run(tmp_path, tasks=12)
    proc = await spawn_cli(*run.args(agent.url, "--concurrency", "4"))
    await wait_until(lambda: agent.seen == 4)
    assert sorted(agent.task_indexes()) == [0, 1, 2, 3]
    # Each answer frees one slot, and exactly the next row in the file takes it.
    for n in range(4, 12):
        agent.release_next()
        await wait_until(seen_count(agent, n + 1))
        assert agent.task_indexes()[n] == n
        assert agent.in_flight == 4
    agent.open()
    result = await proc.wait()
    assert result.returncode == 0, result.stderr[-3000:]
    assert agent.max_in_flight == 4
    assert sorted(keys_of(run.rows())) == [(t, 0) for t in range(12)]


async def test_replicas_share_load_by_fewest_in_flight(
    tmp_path: Path, fake_agent: AgentFactory
) -> None:
    a = await fake_agent(gated=True)
    b = await fake_agent(gated=True)
    run = Run(tmp_path, tasks=4)
    proc = await spawn_cli(*run.args(f"{a.url},{b.url}", "--concurrency", "4"))
    await wait_until(lambda: a.seen + b.seen == 4)
    assert (a.seen, b.seen) == (2, 2)
    a.open()
    b.open()
    result = await proc.wait()
    assert result.returncode == 0, result.stderr[-3000:]
    replicas = {row["_ng_dispatch"]["replica"] for row in run.rows()}
    assert replicas == {a.url, b.url}


async def test_a_busy_replica_gets_no_more_work(tmp_path: Path, fake_agent: AgentFactory) -> None:
    slow = await fake_agent(gated=True)
    fast = await fake_agent()
    run = Run(tmp_path, tasks=10)
    proc = await spawn_cli(*run.args(f"{slow.url},{fast.url}", "--concurrency", "2"))
    # Round robin would send five to each; fewest-in-flight routes around the held one.
    await wait_until(lambda: slow.seen == 1 and fast.seen == 9)
    slow.open()
    result = await proc.wait()
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(run.rows()) == 10
    assert (slow.seen, fast.seen) == (1, 9)


# ---- failure classes, each from its cause -------------------------------------


# (404 and 405 to POST /run are a wrong agent URL: tests/delivery/test_prober_e2e.py.)
@pytest.mark.parametrize("status", [500, 400, 409])
async def test_http_error_statuses_are_agent_run_errors(
    tmp_path: Path, fake_agent: AgentFactory, status: int
) -> None:
    agent = await fake_agent(raw_response(status, "agent says no"))
    run = Run(tmp_path, tasks=2)
    result = await run_cli(*run.args(agent.url))
    # Retryable: a rerun of the same command gives them another attempt.
    assert result.returncode == 75, result.stderr[-3000:]
    assert run.rows() == []
    failures = sorted(run.failure_rows(), key=lambda r: r["_ng_task_index"])
    assert keys_of(failures) == [(0, 0), (1, 0)]
    for row in failures:
        assert row["_ng_failure_class"] == "agent_run_error"
        assert row["_ng_failure_http_status"] == status
        assert row["_ng_failure_response_body"] == "agent says no"
        assert row["_ng_failure_terminal"] is False
        assert row["_ng_failure_type"]
        assert str(status) in row["_ng_failure_message"]
        assert row["agent_ref"] == {"name": "sim"}
        assert "_ng_attempt_index" not in row
        assert "_ng_failure_not_delivered" not in row
    assert summary_of(result)["outcomes"] == {"agent_run_error": 2}


@pytest.mark.parametrize("status", [429, 502, 503, 504])
async def test_not_delivered_statuses_past_the_deadline_spend_no_attempt(
    tmp_path: Path, fake_agent: AgentFactory, status: int
) -> None:
    agent = await fake_agent(raw_response(status, "agent says no"))
    run = Run(tmp_path, tasks=2)
    # A zero delivery deadline: one try, then the not-delivered row (contracts §11).
    result = await run_cli(*run.args(agent.url), "--delivery-deadline-s", "0")
    assert result.returncode == 75, result.stderr[-3000:]
    assert run.rows() == []
    failures = sorted(run.failure_rows(), key=lambda r: r["_ng_task_index"])
    assert keys_of(failures) == [(0, 0), (1, 0)]
    for row in failures:
        assert row["_ng_failure_class"] == "agent_request_failed"
        assert row["_ng_failure_not_delivered"] is True
        assert row["_ng_failure_http_status"] == status
        assert row["_ng_failure_response_body"] == "agent says no"
        assert row["_ng_failure_terminal"] is False
        assert str(status) in row["_ng_failure_message"]
    assert summary_of(result)["outcomes"] == {"agent_request_failed": 2}
    # Not counted, yet the rerun is a new attempt index: never one twice (contracts §5).
    again = await run_cli(*run.args(agent.url), "--delivery-deadline-s", "0")
    assert again.returncode == 75
    assert [r.get("_ng_attempt_index", 0) for r in run.failure_rows()] == [0, 0, 1, 1]


async def test_an_agent_that_is_down(tmp_path: Path) -> None:
    run = Run(tmp_path, tasks=3)
    result = await run_cli(
        *run.args(f"http://127.0.0.1:{free_port()}"), "--delivery-deadline-s", "0"
    )
    assert result.returncode == 75, result.stderr[-3000:]
    failures = run.failure_rows()
    assert len(failures) == 3
    for row in failures:
        assert row["_ng_failure_class"] == "agent_request_failed"
        assert row["_ng_failure_http_status"] is None
        assert row["_ng_failure_terminal"] is False
        assert row["_ng_failure_type"]
    summary = summary_of(result)
    assert summary["outcomes"] == {"agent_request_failed": 3}
    assert summary["remaining"] == 3


async def test_the_rollout_timeout_cancels_the_http_call(
    tmp_path: Path, fake_agent: AgentFactory
) -> None:
    first_gone = asyncio.Event()

    async def respond(body: dict[str, Any]) -> web.StreamResponse:
        if body["_ng_task_index"] == 0:
            try:
                await asyncio.Event().wait()  # hangs until the client goes away
            finally:
                first_gone.set()
        # The second rollout answers only once the first call was cut, so it
        # succeeds only if the timeout really closed that request.
        await first_gone.wait()
        return echo_result(body)

    agent = await fake_agent(respond)
    run = Run(tmp_path, tasks=2)
    result = await run_cli(*run.args(agent.url, "--concurrency", "1", "--rollout-timeout-s", "0.5"))
    assert result.returncode == 75, result.stderr[-3000:]
    assert agent.disconnects == 1
    (failure,) = run.failure_rows()
    assert keys_of([failure]) == [(0, 0)]
    assert failure["_ng_failure_class"] == "timeout_exceeded"
    assert failure["_ng_failure_http_status"] is None
    assert failure["_ng_failure_terminal"] is False
    # uvloop's timers tick in milliseconds, so the cut may come a hair early.
    assert 0.49 <= failure["_ng_dispatch"]["duration_s"] < 5
    assert keys_of(run.rows()) == [(1, 0)]


@pytest.mark.parametrize(
    ("body", "failure_type"),
    [
        (b"[1, 2]", "TypeError"),
        (b'"just a string"', "TypeError"),
        (b"null", "TypeError"),
        (b"{not json", "JSONDecodeError"),
        (b"", "JSONDecodeError"),
    ],
)
async def test_a_body_that_is_not_a_json_object_is_a_protocol_violation(
    tmp_path: Path, fake_agent: AgentFactory, body: bytes, failure_type: str
) -> None:
    agent = await fake_agent(raw_response(200, body))
    run = Run(tmp_path, tasks=2)
    result = await run_cli(*run.args(agent.url))
    # Terminal: every rollout has its final outcome. None succeeded and all failed
    # the same way: the agent is broken, and the run is not done (exit 1).
    assert result.returncode == 1, result.stderr[-3000:]
    assert "failed as protocol_violation" in result.stderr.splitlines()[-1]
    assert run.rows() == []
    failures = run.failure_rows()
    assert len(failures) == 2
    for row in failures:
        assert row["_ng_failure_class"] == "protocol_violation"
        assert row["_ng_failure_terminal"] is True
        assert row["_ng_failure_http_status"] == 200
        assert row["_ng_failure_type"] == failure_type
        assert row["_ng_failure_response_body"] == body.decode()
    # Terminal failures are final: a rerun sends nothing (and is no more done).
    again = await run_cli(*run.args(agent.url))
    assert again.returncode == 1, again.stderr[-3000:]
    assert agent.seen == 2


@pytest.mark.parametrize(("terminal", "exit_code"), [(False, 75), (True, 0)])
async def test_an_agent_reported_failure(
    tmp_path: Path, fake_agent: AgentFactory, terminal: bool, exit_code: int
) -> None:
    result_body = {
        "_ng_failure_class": "sandbox_crashed",
        "_ng_failure_message": "out of memory",
        "_ng_failure_terminal": terminal,
        "reward": 0.0,
    }
    agent = await fake_agent(json_response(result_body))
    run = Run(tmp_path, tasks=1)
    result = await run_cli(*run.args(agent.url))
    assert result.returncode == exit_code, result.stderr[-3000:]
    assert run.rows() == []
    (row,) = run.failure_rows()
    assert row["_ng_failure_class"] == "sandbox_crashed"
    assert row["_ng_failure_message"] == "out of memory"
    assert row["_ng_failure_terminal"] is terminal
    assert keys_of([row]) == [(0, 0)]
    assert row["agent_ref"] == {"name": "sim"}


async def test_a_kill_shaped_result_writes_nothing_and_runs_again(
    tmp_path: Path, fake_agent: AgentFactory
) -> None:
    killed = await fake_agent(json_response({"_ng_no_persist": True, "reason": "preempted"}))
    run = Run(tmp_path, tasks=3)
    result = await run_cli(*run.args(killed.url))
    assert result.returncode == 75, result.stderr[-3000:]
    assert run.rows() == []
    assert run.failure_rows() == []
    assert summary_of(result)["outcomes"] == {"kill_shaped": 3}
    # No attempt was spent, but the agent had them: the rerun is attempt 1 (§5).
    healthy = await fake_agent()
    again = await run_cli(*run.args(healthy.url))
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(keys_of(run.rows())) == [(0, 0), (1, 0), (2, 0)]
    assert all(body["_ng_attempt_index"] == 1 for body in healthy.bodies)


async def test_a_long_error_body_is_cut_to_an_excerpt(
    tmp_path: Path, fake_agent: AgentFactory
) -> None:
    agent = await fake_agent(raw_response(500, "é" * 6000))  # 12,000 bytes
    run = Run(tmp_path, tasks=1)
    result = await run_cli(*run.args(agent.url))
    assert result.returncode == 75, result.stderr[-3000:]
    (row,) = run.failure_rows()
    assert row["_ng_failure_response_body"] == "é" * 2000 + "…"


@pytest.mark.parametrize(
    ("raw", "excerpt"),
    [
        (b"", ""),
        (b"x" * 2000, "x" * 2000),
        (b"x" * 2001, "x" * 2000 + "…"),
        (b"x" * 9000, "x" * 2000 + "…"),
        # 4-byte characters: 8,000 bytes hold exactly 2,000 of them.
        ("😀".encode() * 2000, "😀" * 2000),
        ("😀".encode() * 2001, "😀" * 2000 + "…"),
        ("😀".encode() * 1999 + b"abc", "😀" * 1999 + "a…"),
        # Only the first 8,000 bytes are decoded; a character cut there is not kept.
        ("€".encode() * 3000, "€" * 2000 + "…"),
        (b"\xff\xfe ok", "\ufffd\ufffd ok"),
    ],
)
def test_body_excerpt(raw: bytes, excerpt: str) -> None:
    assert body_excerpt(raw) == excerpt


async def test_failed_attempts_are_retried_with_their_attempt_index(
    tmp_path: Path, fake_agent: AgentFactory
) -> None:
    agent = await fake_agent(raw_response(500, "broken"))
    run = Run(tmp_path, tasks=2)
    first = await run_cli(*run.args(agent.url, "--max-attempts", "2"))
    assert first.returncode == 75, first.stderr[-3000:]
    second = await run_cli(*run.args(agent.url, "--max-attempts", "2"))
    # Attempts used up: every rollout is final, none succeeded, all as agent_run_error:
    # exit 1, never 0 (contracts §10).
    assert second.returncode == 1, second.stderr[-3000:]
    assert [b.get("_ng_attempt_index") for b in agent.bodies] == [None, None, 1, 1]
    retries = [r for r in run.failure_rows() if r.get("_ng_attempt_index") == 1]
    assert sorted(r["_ng_dispatch"]["rollout_id"] for r in retries) == ["0-0-a1", "1-0-a1"]
    third = await run_cli(*run.args(agent.url, "--max-attempts", "2"))
    assert third.returncode == 1, third.stderr[-3000:]
    assert agent.seen == 4


# ---- the dispatch budget -----------------------------------------------------


def assert_drained(result: CliResult, count: int) -> None:
    assert result.returncode == 75, result.stderr[-3000:]
    summary = summary_of(result)
    assert summary["drained"] == count
    assert summary["outcomes"].get("drained") == count
    assert str(count) in summary["drained_note"]
    assert "resume" in summary["drained_note"]


@pytest.mark.parametrize(
    "budget_flags",
    [
        ("--dispatch-budget-s", "0"),
        ("--dispatch-budget-s", "0", "--drain-margin-s", "0"),
        ("--dispatch-budget-s", "30", "--drain-margin-s", "60"),
    ],
)
async def test_a_budget_that_leaves_no_time_drains_everything(
    tmp_path: Path, fake_agent: AgentFactory, budget_flags: tuple[str, ...]
) -> None:
    agent = await fake_agent()
    run = Run(tmp_path, tasks=5)
    result = await run_cli(*run.args(agent.url, "--concurrency", "2", *budget_flags))
    assert_drained(result, 5)
    assert agent.seen == 0
    assert run.rows() == []
    assert run.failure_rows() == []
    # The rerun (here without a budget) runs everything exactly once.
    again = await run_cli(*run.args(agent.url, "--concurrency", "2"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(keys_of(run.rows())) == [(t, 0) for t in range(5)]
    assert agent.seen == 5


@pytest.mark.parametrize(
    ("budget_s", "margin_s", "hold_s"),
    [
        ("1", None, 1.0),  # the budget runs out while the first rollout is held
        ("10", "9", 1.0),  # less than the margin is left once it is released
    ],
)
async def test_nothing_starts_inside_the_drain_margin(
    tmp_path: Path,
    fake_agent: AgentFactory,
    budget_s: str,
    margin_s: str | None,
    hold_s: float,
) -> None:
    agent = await fake_agent(gated=True)
    run = Run(tmp_path, tasks=5)
    budget = ["--dispatch-budget-s", budget_s]
    if margin_s is not None:
        budget += ["--drain-margin-s", margin_s]
    proc = await spawn_cli(*run.args(agent.url, "--concurrency", "1", *budget))
    await wait_until(lambda: agent.seen == 1)
    # The deadline was fixed before this request was sent, so once hold_s has
    # passed since it arrived, remaining < budget - hold_s for certain.
    arrived = time.monotonic()
    await wait_until(lambda: time.monotonic() > arrived + hold_s)
    agent.release_next()
    result = await proc.wait()
    assert_drained(result, 4)
    assert agent.seen == 1
    assert keys_of(run.rows()) == [(0, 0)]
    # A rerun finishes the rest with no duplicate.
    agent.open()
    again = await run_cli(*run.args(agent.url, "--concurrency", "1"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(keys_of(run.rows())) == [(t, 0) for t in range(5)]
    assert agent.task_indexes() == [0, 1, 2, 3, 4]


async def test_a_budget_with_room_drains_nothing(tmp_path: Path, fake_agent: AgentFactory) -> None:
    agent = await fake_agent()
    run = Run(tmp_path, tasks=6)
    budget = ("--dispatch-budget-s", "60", "--drain-margin-s", "0")
    result = await run_cli(*run.args(agent.url, "--concurrency", "2", *budget))
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary_of(result)["drained"] == 0
    assert len(run.rows()) == 6


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rollout(task_index: int) -> Rollout:
    row = {"_ng_task_index": task_index, "_ng_rollout_index": 0, "agent_ref": {"name": "a"}}
    return Rollout.from_materialized(row, 0)


@pytest.mark.parametrize(
    ("elapsed_s", "margin_s", "drain"),
    [
        (0.0, None, False),
        (9.9, None, False),
        (10.0, None, True),  # nothing left
        (11.0, None, True),
        (4.0, 6.0, False),  # exactly the margin left: still starts
        (4.1, 6.0, True),  # less than the margin left
        (0.0, 0.0, False),
        (10.0, 0.0, True),
    ],
)
def test_the_drain_decision(elapsed_s: float, margin_s: float | None, drain: bool) -> None:
    clock = FakeClock()
    budget = Budget(10.0, clock=clock)
    clock.now += elapsed_s
    assert budget.should_drain(margin_s) is drain


def test_without_a_budget_nothing_drains() -> None:
    budget = Budget(None)
    assert budget.remaining_s() is None
    assert budget.should_drain(1e9) is False


async def test_the_drain_is_decided_after_the_slot_is_won() -> None:
    clock = FakeClock()
    pool = RolloutPool(1, Budget(5.0, clock=clock), lambda: None)
    first = await pool.admit("sim")
    assert first is not None
    waiting = asyncio.create_task(pool.admit("sim"))
    await asyncio.sleep(0)
    assert not waiting.done()  # no slot yet
    clock.now += 5.0  # the budget runs out while it waits for the slot
    first.release()
    assert await waiting is None  # drained
    # A drained rollout gives its slot back at once.
    assert await pool.admit("sim") is None
    assert pool.slots is not None and pool.slots.in_use == 0


async def test_a_learned_margin_drains_once_known() -> None:
    clock = FakeClock()
    margin: list[float | None] = [None]
    pool = RolloutPool(2, Budget(10.0, clock=clock), lambda: margin[0])
    clock.now += 7.0
    assert await pool.admit("sim") is not None
    margin[0] = 3.5  # e.g. the p75, known once five rollouts finished
    assert await pool.admit("sim") is None
    margin[0] = 2.5
    assert await pool.admit("sim") is not None
    assert pool.slots is not None and pool.slots.in_use == 2


async def test_a_free_slot_goes_to_the_best_rank_then_the_first_comer() -> None:
    pool = RolloutPool(1, Budget(None), lambda: None)
    held = await pool.admit("sim")
    assert held is not None
    order: list[str] = []

    async def admit(name: str, rank: tuple[int, ...]) -> None:
        slots = await pool.admit("sim", rank)
        assert slots is not None
        order.append(name)
        slots.release()

    waiters = [
        asyncio.create_task(admit("low", (0,))),
        asyncio.create_task(admit("high-first", (-1,))),
        asyncio.create_task(admit("high-second", (-1,))),
    ]
    await asyncio.sleep(0)
    held.release()
    await asyncio.gather(*waiters)
    assert order == ["high-first", "high-second", "low"]


# ---- bad input: exit 2, nothing dispatched, no file created --------------------


def bad_tasks(run: Run) -> list[str]:
    run.tasks.write_bytes(b'{"agent_ref": {"name": "sim"}}\n\n{bad json\n')
    return []


def unknown_agent_row(run: Run) -> list[str]:
    run.tasks.write_bytes(b'{"agent_ref": {"name": "sim"}}\n{"agent_ref": {"name": "nope"}}\n')
    return []


def unknown_default_agent(run: Run) -> list[str]:
    write_tasks(run.tasks, 2, agent=None)
    return ["--default-agent", "nope"]


def budget_without_bound(run: Run) -> list[str]:
    write_tasks(run.tasks, 2)
    return ["--concurrency", "unbounded", "--dispatch-budget-s", "10"]


def concurrency_zero(run: Run) -> list[str]:
    write_tasks(run.tasks, 2)
    return ["--concurrency", "0"]


def missing_input(run: Run) -> list[str]:
    return []


def unreadable_input(run: Run) -> list[str]:
    run.tasks.mkdir()  # a directory: root can't read it as a file either
    return []


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (bad_tasks, r"error: {tasks}:3: line is not valid JSON"),
        (unknown_agent_row, r"error: {tasks}:2: agent 'nope' is not configured"),
        (unknown_default_agent, r"error: config key 'default_agent' (from --default-agent)"),
        (budget_without_bound, r"error: config key 'dispatch_budget_s'"),
        (concurrency_zero, r"error: config key 'concurrency' (from --concurrency)"),
        (missing_input, r"error: {tasks}: input file not found"),
        (unreadable_input, r"error: {tasks}: cannot read input"),
    ],
)
async def test_bad_input_exits_2_before_anything(
    tmp_path: Path,
    fake_agent: AgentFactory,
    setup: Callable[[Run], list[str]],
    message: str,
) -> None:
    agent = await fake_agent()
    run = Run(tmp_path)
    extra = setup(run)
    result = await run_cli(*run.args(agent.url, *extra))
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith(message.format(tasks=run.tasks)), result.stderr
    assert names_in(run.dir) == []
    assert agent.seen == 0


async def test_an_output_directory_that_cannot_be_created(
    tmp_path: Path, fake_agent: AgentFactory
) -> None:
    agent = await fake_agent()
    tasks = write_tasks(tmp_path / "tasks.jsonl", 2)
    blocker = tmp_path / "somefile"
    blocker.write_text("a regular file, not a folder\n")
    output = blocker / "out.jsonl"
    result = await run_cli(*run_args(tasks, output, agent.url, *FAST))
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith(f"error: {blocker}: cannot create the output directory")
    assert blocker.read_text() == "a regular file, not a folder\n"
    assert names_in(tmp_path) == ["somefile", "tasks.jsonl"]
    assert agent.seen == 0


async def test_skip_invalid_rows_runs_the_valid_ones(
    tmp_path: Path, fake_agent: AgentFactory
) -> None:
    agent = await fake_agent()
    run = Run(tmp_path)
    good = b'{"agent_ref": {"name": "sim"}, "q": %d}\n'
    run.tasks.write_bytes(good % 0 + b"{bad\n[1]\n" + good % 1)
    result = await run_cli(*run.args(agent.url, "--skip-invalid-rows"))
    assert result.returncode == 0, result.stderr[-3000:]
    # Both valid rows ran; two rollouts in flight at once reach the agent in either order.
    assert sorted(b["q"] for b in agent.bodies) == [0, 1]
    assert sorted(keys_of(run.rows())) == [(0, 0), (1, 0)]
    skipped = [e for e in log_events(result.stderr) if e["event"] == "input_row_skipped"]
    assert [e["where"] for e in skipped] == [f"{run.tasks}:2", f"{run.tasks}:3"]


async def test_a_second_dispatcher_on_the_same_output_fails_at_once(
    tmp_path: Path, fake_agent: AgentFactory
) -> None:
    agent = await fake_agent(gated=True)
    run = Run(tmp_path, tasks=2)
    first = await spawn_cli(*run.args(agent.url))
    await wait_until(lambda: agent.seen == 2)
    second = await run_cli(*run.args(agent.url))
    assert second.returncode == 2, second.stderr[-3000:]
    assert second.stderr.startswith(f"error: {run.dir / 'x_run.lock'}: another dispatcher")
    assert str(first.proc.pid) in second.stderr
    agent.open()
    result = await first.wait()
    assert result.returncode == 0, result.stderr[-3000:]
    assert agent.seen == 2
    assert len(run.rows()) == 2


async def test_task_settings_reach_the_agent(tmp_path: Path, fake_agent: AgentFactory) -> None:
    agent = await fake_agent()
    run = Run(tmp_path)
    run.tasks.write_bytes(
        b'{"q": 0, "responses_create_params": {"model": "m", "temperature": 0.0}}\n'
        b'{"q": 1, "agent_ref": {"name": "other"}}\n'
        b'{"q": 2}\n'
    )
    result = await run_cli(
        *run.args(agent.url),
        "--agent",
        f"other={agent.url}",
        "--default-agent",
        "sim",
        "--num-repeats",
        '{"sim": 2, "_default": 1}',
        "--limit",
        "2",
        "--responses-create-params",
        '{"temperature": 1.0}',
    )
    assert result.returncode == 0, result.stderr[-3000:]
    sent = sorted(agent.bodies, key=lambda b: (b["_ng_task_index"], b["_ng_rollout_index"]))
    assert [(b["q"], b["agent_ref"]["name"]) for b in sent] == [
        (0, "sim"),
        (0, "sim"),
        (1, "other"),
    ]
    assert keys_of(sent) == [(0, 0), (0, 1), (1, 0)]
    assert sent[0]["responses_create_params"] == {"model": "m", "temperature": 1.0}
    assert sent[2]["responses_create_params"] == {"temperature": 1.0}
    rows = sorted(run.rows(), key=lambda r: (r["_ng_task_index"], r["_ng_rollout_index"]))
    assert [r["agent_ref"] for r in rows] == [{"name": "sim"}, {"name": "sim"}, {"name": "other"}]
    materialized = read_jsonl(run.dir / "x_materialized_inputs.jsonl")
    assert keys_of(materialized) == [(0, 0), (0, 1), (1, 0)]


async def test_a_null_failure_class_is_a_success(tmp_path: Path, fake_agent: AgentFactory) -> None:
    # Agents built on pydantic models send the key on every result.
    agent = await fake_agent(json_response({"reward": 1.0, "_ng_failure_class": None}))
    run = Run(tmp_path, tasks=2)
    result = await run_cli(*run.args(agent.url))
    assert result.returncode == 0, result.stderr[-3000:]
    assert run.failure_rows() == []
    assert sorted(keys_of(run.rows())) == [(0, 0), (1, 0)]
    assert all(row["reward"] == 1.0 for row in run.rows())
