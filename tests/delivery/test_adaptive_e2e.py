"""Adaptive concurrency and hard caps through the real CLI and real agents on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dispatcher.delivery.adaptive import StartRateLimiter
from dispatcher.files.resume import OutputPaths
from tests.conftest import SimAgentFactory
from tests.helpers import log_events, read_jsonl, run_args, run_cli, write_tasks


def summary_of(stderr: str) -> dict[str, Any]:
    [summary] = [e for e in log_events(stderr) if e["event"] == "run_summary"]
    return summary


def files(tmp_path: Path, tasks: int) -> tuple[Path, Path]:
    return write_tasks(tmp_path / "tasks.jsonl", tasks), tmp_path / "out" / "x.jsonl"


async def test_agent_and_start_rate_caps_hold_in_auto_mode(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, stats = await sim_agent(latency_s=0.05)
    tasks, output = files(tmp_path, 200)
    caps = ("--agent-concurrency", "sim=6", "--max-starts-per-s", "40")

    result = await run_cli(*run_args(tasks, output, url, "--concurrency", "auto", *caps))

    assert result.returncode == 0, result.stderr[-3000:]
    assert len(read_jsonl(output)) == 200
    assert stats.max_in_flight <= 6
    # Starts leave at least 1.02/40 s apart, never in bursts (the unit tests of
    # StartRateLimiter hold that exactly, on a clock they move). Here, that the
    # cap governs the run: its 200 starts cannot be let go in less than 199
    # spacings of the dispatcher's own clock, however loaded the machine (a
    # load only stretches them). Uncapped they take ~1.7 s (~120 a second);
    # counted per second at the agent, its own scheduling blurred them (43 seen).
    summary = summary_of(result.stderr)
    assert summary["dispatch_s"] >= 199 * StartRateLimiter.STRETCH / 40 - 0.001  # rounded
    view = summary["concurrency"]["sim"]
    assert view["mode"] == "auto" and view["cap"] == 6 and view["limit"] <= 6


async def test_the_replica_cap_holds_with_a_fixed_concurrency(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    one, one_stats = await sim_agent(latency_s=0.02)
    two, two_stats = await sim_agent(latency_s=0.02)
    tasks, output = files(tmp_path, 300)
    args = run_args(tasks, output, f"{one},{two}", "--concurrency", "50")

    result = await run_cli(*args, "--replica-concurrency", "4")

    assert result.returncode == 0, result.stderr[-3000:]
    assert len(read_jsonl(output)) == 300
    assert one_stats.max_in_flight <= 4 and two_stats.max_in_flight <= 4
    assert one_stats.max_in_flight + two_stats.max_in_flight > 4  # both were used


async def test_auto_finds_the_knee_without_429s_piling_up(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    # Past 12 in flight the agent slows down; past 15 it answers 429. How far the
    # limit climbs first depends on how the machine schedules the agent's answers
    # (the latency guard reads them): the climb and the cuts are pinned on a fake
    # clock in test_adaptive.py. Through real sockets: the controller acts, ends
    # within the agent's reach, and few calls are refused on the way.
    url, stats = await sim_agent(latency_s=0.2, capacity=12)
    tasks, output = files(tmp_path, 600)

    result = await run_cli(*run_args(tasks, output, url, "--concurrency", "auto"))

    assert result.returncode == 0, result.stderr[-3000:]
    assert len(read_jsonl(output)) == 600
    assert read_jsonl(OutputPaths.for_output(output).failures) == []
    summary = summary_of(result.stderr)
    limits = [e["limit"] for e in log_events(result.stderr) if e["event"] == "concurrency_changed"]
    assert limits  # it moved its limit
    assert 1 <= summary["concurrency"]["sim"]["limit"] <= 24  # and ended within the knee's reach
    refused = summary["retries"].get("sim", {}).get("http_429", 0)
    assert refused < 0.05 * stats.requests
