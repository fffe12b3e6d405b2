"""Observability of the whole daemon, through the real CLI (issue 5).

A real Prometheus scrapes a running `dispatcher run`; `/status`, `/healthz`,
the JSON log stream and the console progress line are read while agents hold
their answers on futures the test releases. Every figure is compared with the
output files at a moment the test has frozen: nothing here is timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from dispatcher.outcome import Outcome
from tests.helpers import (
    CliProcess,
    FakeAgent,
    cli_env,
    count_lines,
    read_jsonl,
    run_args,
    spawn_cli,
    wait_until,
    write_tasks,
)
from tests.prometheus_helpers import require_binary, running_prometheus

TASKS = 12
KILL_SHAPED_TASK = 1
# Outcomes that write no row anywhere (drained ones are never counted as attempts).
NO_ROW = ("cancelled", "kill_shaped")
ROWS_COUNTED = 'sum(dispatcher_rollouts_total{outcome!~"cancelled|kill_shaped"})'
REQUIRED_SERIES = {
    "dispatcher_rollouts_total",
    "dispatcher_rollouts_in_flight",
    "dispatcher_rollout_duration_seconds_bucket",
    "dispatcher_rollout_latency_quantile_seconds",
    "dispatcher_rollouts_per_hour",
    "dispatcher_drain_margin_seconds",
    "dispatcher_dispatch_budget_remaining_seconds",
    "dispatcher_rollouts_drained_total",
    "dispatcher_rollouts_remaining",
    "dispatcher_event_loop_lag_seconds_bucket",
    "dispatcher_capture_wait_seconds_bucket",
    "dispatcher_capture_gaps_total",
    "dispatcher_build_info",
}
# Every label the daemon may export: none of them can carry a rollout's identity.
# `replica` takes the configured replica URLs; `reason` and `kind` are fixed sets.
BOUNDED_LABELS = {
    "agent", "outcome", "quantile", "le", "code", "version", "python", "replica", "reason", "kind"
}  # fmt: skip
ROLLOUT_ID = re.compile(r"^\d+-\d+(-a\d+)?$")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def scripted(body: dict[str, Any]) -> web.StreamResponse:
    """By task: one kill-shaped answer, retryable 500s, terminal protocol violations."""
    task = body["_ng_task_index"]
    if task == KILL_SHAPED_TASK:
        return web.json_response({"_ng_no_persist": True})
    if task % 6 == 4:
        return web.Response(status=500, text="agent crashed")
    if task % 6 == 5:
        return web.json_response([1])
    return web.json_response({"reward": 1.0, "echo_task": task})


class GatedAgent(FakeAgent):
    """A `FakeAgent` that holds every answer and counts the ones the test let go."""

    def __init__(self) -> None:
        super().__init__(scripted, gated=True)
        self.released = 0

    @property
    def held(self) -> int:
        return self.seen - self.released

    def oldest_held_task(self) -> int | None:
        """Task index of the request `release_next` would answer (None when none is held)."""
        return self.bodies[self.released]["_ng_task_index"] if self.held else None

    async def release(self, count: int) -> None:
        """Let `count` answers go, oldest first, waiting for each request to arrive."""
        for _ in range(count):
            await wait_until(lambda: self.held > 0)
            self.release_next()
            self.released += 1


AgentFactory = Callable[[], Awaitable[GatedAgent]]


@pytest.fixture
async def gated_agent() -> AsyncIterator[AgentFactory]:
    agents: list[GatedAgent] = []

    async def start() -> GatedAgent:
        agent = GatedAgent()
        await agent.start()
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        await agent.close()


class Daemon:
    """One `dispatcher run` subprocess, its endpoints and its output files."""

    def __init__(self, proc: CliProcess, output: Path) -> None:
        self.proc = proc
        self.output = output
        self.failures = output.with_name(f"{output.stem}_failures.jsonl")
        self.url = ""

    def rows(self) -> int:
        """Rows written so far: successes plus failed attempts."""
        return count_lines(self.output) + count_lines(self.failures)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.proc.events() if e["event"] == name]

    async def finished(self, count: int) -> None:
        """Wait until `count` rollouts were recorded (the log line follows the metrics)."""
        await wait_until(lambda: len(self.events("rollout_finished")) == count)

    async def get(self, path: str) -> tuple[int, bytes]:
        async with aiohttp.ClientSession() as session, session.get(self.url + path) as response:
            return response.status, await response.read()

    async def status(self) -> dict[str, Any]:
        code, body = await self.get("/status")
        assert code == 200
        loaded: dict[str, Any] = orjson.loads(body)
        return loaded

    async def healthz(self) -> int:
        return (await self.get("/healthz"))[0]


@contextlib.asynccontextmanager
async def daemon(tmp_path: Path, agent_urls: str, *extra: str) -> AsyncIterator[Daemon]:
    """`dispatcher run` on TASKS tasks with its endpoints on a free port; killed on failure."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", TASKS)
    output = tmp_path / "out" / "x.jsonl"
    output.parent.mkdir()
    args = run_args(tasks, output, agent_urls, "--fsync", "never", *extra)
    # Port 0: the daemon binds a free port and logs its URL, so no port can be stolen.
    proc = await spawn_cli(*args, "--metrics-listen", "127.0.0.1:0")
    run = Daemon(proc, output)
    try:
        await wait_until(lambda: proc.saw("metrics_listening") or proc.exited, 30)
        assert not proc.exited, b"".join(proc.stderr).decode()[-3000:]
        [listening] = run.events("metrics_listening")
        run.url = listening["url"].removesuffix("/metrics")
        yield run
    finally:
        await proc.kill()


def outcome_of(row: dict[str, Any]) -> str:
    return str(row.get("_ng_failure_class", Outcome.SUCCESS.value))


def written_outcomes(run: Daemon) -> Counter[str]:
    return Counter(outcome_of(r) for r in read_jsonl(run.output) + read_jsonl(run.failures))


def final_rows(run: Daemon) -> int:
    """Rows that finish their rollout: successes and terminal failures (no attempt cap hit)."""
    terminal = [r for r in read_jsonl(run.failures) if r["_ng_failure_terminal"] is True]
    return count_lines(run.output) + len(terminal)


# ---- Prometheus --------------------------------------------------------------


async def test_prometheus_counts_the_rows_written_mid_run_and_at_the_end(
    prometheus: str, tmp_path: Path, gated_agent: AgentFactory
) -> None:
    agent = await gated_agent()
    grace = ("--concurrency", "4", "--shutdown-grace-s", "60")
    async with daemon(tmp_path, agent.url, *grace) as run:
        target = run.url.removeprefix("http://")
        async with running_prometheus(target, tmp_path / "prometheus") as prom:
            # Mid-run: six answered (one kill-shaped, which writes nothing), four held.
            await agent.release(6)
            await run.finished(6)
            assert run.rows() == 5
            await prom.wait_for_value(ROWS_COUNTED, run.rows())
            assert run.rows() == 5
            await prom.wait_for_value("sum(dispatcher_rollouts_in_flight)", 4)

            # The end: everything answered but the last rollout, which SIGTERM
            # leaves in its grace period with the endpoints still serving.
            await agent.release(TASKS - 1 - agent.released)
            await run.finished(TASKS - 1)
            run.proc.send_signal(signal.SIGTERM)
            await wait_until(lambda: run.proc.saw("shutdown_requested"))
            assert run.rows() == TASKS - 2
            await prom.wait_for_value(ROWS_COUNTED, run.rows())
            await prom.wait_for_value("sum(dispatcher_rollouts_in_flight)", 1)
            assert await prom.query_value("sum(dispatcher_rollouts_total)") == TASKS - 1
            assert run.rows() == TASKS - 2

        agent.open()
        result = await run.proc.wait()
    assert result.returncode == 75, result.stderr[-3000:]
    assert run.rows() == TASKS - 1
    assert agent.seen == TASKS


async def test_a_scrape_of_the_running_daemon_is_complete_bounded_and_promtool_clean(
    tmp_path: Path, gated_agent: AgentFactory
) -> None:
    promtool = require_binary("promtool")
    agent = await gated_agent()
    budget = ("--concurrency", "4", "--dispatch-budget-s", "3600")
    async with daemon(tmp_path, agent.url, *budget) as run:
        # Nine answers: six successes make the learned drain margin known.
        await agent.release(9)
        await run.finished(9)
        await wait_until(lambda: agent.seen == TASKS)

        scrape = ""

        async def complete() -> bool:
            nonlocal scrape
            code, body = await run.get("/metrics")
            scrape = body.decode()
            # Run-level figures are refreshed on the daemon's one-second tick.
            return code == 200 and sample_names(scrape) >= REQUIRED_SERIES

        await wait_until(complete, 10, step_s=0.1)
        check = await asyncio.create_subprocess_exec(
            promtool,
            "check",
            "metrics",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        report, _ = await check.communicate(scrape.encode())
        assert check.returncode == 0, report.decode()
        assert report.strip() == b""

        samples = [s for f in text_string_to_metric_families(scrape) for s in f.samples]
        for sample in samples:
            assert set(sample.labels) <= BOUNDED_LABELS, sample
            assert not any(ROLLOUT_ID.match(v) for v in sample.labels.values()), sample
        agents = {s.labels["agent"] for s in samples if "agent" in s.labels}
        assert agents == {"sim"}
        outcomes = {s.labels["outcome"] for s in samples if "outcome" in s.labels}
        assert outcomes <= {o.value for o in Outcome}
        totals = {
            s.labels["outcome"]: s.value for s in samples if s.name == "dispatcher_rollouts_total"
        }
        assert sum(v for o, v in totals.items() if o not in NO_ROW) == run.rows() == 8
        assert value_of(samples, "dispatcher_rollouts_in_flight") == agent.held == 3
        assert 0 < value_of(samples, "dispatcher_dispatch_budget_remaining_seconds") <= 3600
        assert value_of(samples, "dispatcher_rollouts_remaining") == TASKS - final_rows(run)

        agent.open()
        result = await run.proc.wait()
    assert result.returncode == 75, result.stderr[-3000:]


def sample_names(scrape: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(scrape) for s in f.samples}


def value_of(samples: list[Any], name: str) -> float:
    [value] = [s.value for s in samples if s.name == name]
    return float(value)


# ---- /status and /healthz ----------------------------------------------------


async def test_status_agrees_with_the_files_and_healthz_turns_503_on_sigterm(
    tmp_path: Path, gated_agent: AgentFactory
) -> None:
    a, b = await gated_agent(), await gated_agent()
    flags = (
        *("--concurrency", "4", "--dispatch-budget-s", "3600", "--drain-margin-s", "5"),
        *("--shutdown-grace-s", "60"),
    )
    async with daemon(tmp_path, f"{a.url},{b.url}", *flags) as run:
        assert await run.healthz() == 200
        # Answer tasks 0-5 in input order across both replicas, each freed slot
        # refilled before the next answer, then wait until all six are recorded.
        released = 6
        for _ in range(released):
            await wait_until(lambda: a.held + b.held == 4)
            await min((a, b), key=held_task_order).release(1)
        await wait_until(lambda: a.held + b.held == 4)
        await run.finished(released)

        status = await run.status()
        assert status["state"] == "running"
        outcomes = status["outcomes"]
        assert sum(outcomes.values()) == released
        assert {o: n for o, n in outcomes.items() if o not in NO_ROW} == written_outcomes(run)
        assert outcomes["kill_shaped"] == 1
        progress = status["progress"]
        assert progress["expected"] == TASKS
        assert progress["done"] == final_rows(run)
        assert progress["remaining"] == TASKS - progress["done"]
        assert progress["in_flight"] == a.held + b.held == 4
        assert status["in_flight_by_agent"] == {"sim": {a.url: a.held, b.url: b.held}}
        assert 0 < status["budget_remaining_s"] < 3600
        assert status["drain_margin_s"] == 5.0
        assert status["drained"] == 0
        assert status["rollouts_per_hour"] > 0
        assert status["eta_s"] > 0
        latency = status["latency_s"]
        assert 0 < latency["p50"] <= latency["p75"] <= latency["p95"]
        assert await run.healthz() == 200

        # SIGTERM with four rollouts held: they are in their grace period.
        run.proc.send_signal(signal.SIGTERM)
        await wait_until(lambda: run.proc.saw("shutdown_requested"))
        assert await run.healthz() == 503
        status = await run.status()
        assert status["state"] in ("draining", "shutting_down")
        assert status["progress"]["in_flight"] == 4

        a.open()
        b.open()
        result = await run.proc.wait()
    assert result.returncode == 75, result.stderr[-3000:]
    # The held four finished inside the grace period; nothing new was started.
    assert a.seen + b.seen == 4 + released
    assert sum(written_outcomes(run).values()) == a.seen + b.seen - 1


def held_task_order(agent: GatedAgent) -> int:
    task = agent.oldest_held_task()
    return TASKS if task is None else task


# ---- JSON logs -----------------------------------------------------------------


async def test_json_logs_carry_one_rollout_finished_per_attempt_progress_and_one_summary(
    tmp_path: Path, gated_agent: AgentFactory
) -> None:
    agent = await gated_agent()
    flags = ("--concurrency", "2", "--dispatch-budget-s", "3600", "--progress-interval-s", "0.2")
    async with daemon(tmp_path, agent.url, *flags) as run:
        # Nine answers, six of them successes: the drain margin becomes the p75.
        await agent.release(9)
        await run.finished(9)
        before = len(run.events("progress"))
        await wait_until(lambda: len(run.events("progress")) > before, 10)
        progress = run.events("progress")[-1]
        agent.open()
        result = await run.proc.wait()
    assert result.returncode == 75, result.stderr[-3000:]

    events = [orjson.loads(line) for line in result.stderr.splitlines() if line.strip()]
    assert all(isinstance(e, dict) and {"event", "level", "timestamp"} <= e.keys() for e in events)

    finished = [e for e in events if e["event"] == "rollout_finished"]
    assert len(finished) == agent.seen == TASKS
    ids = [e["rollout_id"] for e in finished]
    assert len(set(ids)) == len(ids)
    rows = read_jsonl(run.output) + read_jsonl(run.failures)
    written_ids = {r["_ng_dispatch"]["rollout_id"] for r in rows}
    assert set(ids) == written_ids | {f"{KILL_SHAPED_TASK}-0"}
    for event in finished:
        assert event["agent"] == "sim" and event["replica"] == agent.url
        assert event["rollout_id"] == f"{event['task_index']}-{event['rollout_index']}"
        assert event["attempt"] == 0 and event["duration_s"] > 0
    assert Counter(e["outcome"] for e in finished if e["outcome"] not in NO_ROW) == (
        written_outcomes(run)
    )

    assert progress["done"] >= 6 and progress["expected"] == TASKS
    assert progress["rollouts_per_hour"] > 0
    assert 0 < progress["p50_s"] <= progress["p75_s"] <= progress["p95_s"]
    assert progress["drain_margin_s"] == progress["p75_s"]
    assert 0 < progress["budget_remaining_s"] < 3600
    assert progress["eta_s"] > 0

    [summary] = [e for e in events if e["event"] == "run_summary"]
    assert events.index(summary) > max(events.index(e) for e in finished)
    assert summary["outcomes"] == dict(Counter(e["outcome"] for e in finished))
    assert summary["rollouts_per_hour"] > 0
    latency = summary["latency_s"]
    assert 0 < latency["p50"] <= latency["p75"] <= latency["p95"] <= latency["p99"]
    assert summary["drained"] == 0
    assert summary["remaining"] == TASKS - final_rows(run)


# ---- console progress line -----------------------------------------------------


async def test_console_mode_on_a_terminal_shows_a_live_progress_line(
    tmp_path: Path, gated_agent: AgentFactory
) -> None:
    agent = await gated_agent()
    tasks = write_tasks(tmp_path / "tasks.jsonl", 3)
    args = run_args(tasks, tmp_path / "x.jsonl", agent.url, "--log-format", "console")
    primary, secondary = pty.openpty()
    # A fresh pty reports zero columns; give it a real width.
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    screen = bytearray()

    def read_screen() -> None:
        try:
            screen.extend(os.read(primary, 65536))
        except OSError:  # EIO once the child closed its side
            loop.remove_reader(primary)

    loop = asyncio.get_running_loop()
    loop.add_reader(primary, read_screen)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "dispatcher",
        *args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=secondary,
        env=cli_env(),
    )
    os.close(secondary)
    live = re.compile(r"\r[^\r\n]*[\d.,]+ rollouts/h \| p50 \d\S* p75 \d\S* p95 \d\S*")

    def shows_progress() -> bool:
        return live.search(ANSI.sub("", screen.decode(errors="replace"))) is not None

    try:
        await agent.release(1)
        await wait_until(shows_progress, 20)
        agent.open()
        # Task 1 is kill-shaped: it writes nothing and runs again on resume.
        assert await asyncio.wait_for(proc.wait(), 30) == 75
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        loop.remove_reader(primary)
        os.close(primary)


async def test_rollouts_cancelled_at_the_end_of_the_grace_period_are_logged_once_each(
    tmp_path: Path, gated_agent: AgentFactory
) -> None:
    agent = await gated_agent()
    async with daemon(tmp_path, agent.url, "--concurrency", "4", "--shutdown-grace-s", "0") as run:
        await agent.release(2)
        await run.finished(2)
        await wait_until(lambda: agent.held == 4)
        run.proc.send_signal(signal.SIGTERM)
        result = await run.proc.wait()
    assert result.returncode == 75, result.stderr[-3000:]

    events = [orjson.loads(line) for line in result.stderr.splitlines() if line.strip()]
    finished = [e for e in events if e["event"] == "rollout_finished"]
    assert len(finished) == agent.seen == 6
    assert len({e["rollout_id"] for e in finished}) == 6
    outcomes = {"success": 1, "kill_shaped": 1, "cancelled": 4}
    assert Counter(e["outcome"] for e in finished) == outcomes
    [summary] = [e for e in events if e["event"] == "run_summary"]
    assert summary["outcomes"] == outcomes
    assert run.rows() == 1
