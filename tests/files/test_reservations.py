"""Attempt indices reserved on disk before a rollout is sent, never reused (contracts §5)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from dispatcher.files import reservations
from dispatcher.files.reservations import Reservations
from tests.helpers import (
    FakeAgent,
    read_jsonl,
    run_args,
    run_cli,
    spawn_cli,
    wait_until,
    write_tasks,
)


def test_each_earlier_hop_counts_once_per_line(tmp_path: Path) -> None:
    path = tmp_path / "x_attempt_reservations.jsonl"
    first = Reservations.load(path)
    first.reserve([(0, 10), (10, 20)])
    first.reserve([(5, 15)])  # the same hop naming a line again
    second = Reservations.load(path)
    assert [second.earlier(o) for o in (0, 12, 19, 20)] == [1, 1, 1, 0]
    second.reserve([(10, 30)])
    third = Reservations.load(path)
    assert [third.earlier(o) for o in (0, 12, 25, 30)] == [1, 2, 1, 0]


def test_a_torn_last_line_reserved_nothing(tmp_path: Path) -> None:
    path = tmp_path / "x_attempt_reservations.jsonl"
    path.write_bytes(orjson.dumps({"hop": "a", "lines": [[0, 5]]}) + b'\n{"hop": "b", "li')
    reserved = Reservations.load(path)
    assert reserved.earlier(0) == 1
    reserved.reserve([(5, 9)])
    assert Reservations.load(path).earlier(6) == 1


async def _killed_while_held(agent: FakeAgent, args: list[str]) -> None:
    """Run until the agent holds the rollout, then SIGKILL the dispatcher."""
    held = agent.seen + 1
    proc = await spawn_cli(*args)
    await wait_until(lambda: (agent.seen >= held and agent.holding >= 1) or proc.exited, 60)
    assert not proc.exited, b"".join(proc.stderr).decode()[-2000:]
    await proc.kill()


async def test_sigkill_while_an_agent_holds_the_rollout_then_resume_sends_a_fresh_index(
    tmp_path: Path,
) -> None:
    # Failed before: the index was the number of failure rows, and a killed
    # attempt writes none, so every rerun went out as attempt 0 again ("0-0").
    agent = FakeAgent(gated=True)
    url = await agent.start()
    try:
        tasks = write_tasks(tmp_path / "tasks.jsonl", 1)
        out = tmp_path / "out.jsonl"
        args = run_args(tasks, out, url, "--capture-dir", str(tmp_path / "capture"))
        await _killed_while_held(agent, args)
        await _killed_while_held(agent, args)
        assert not out.exists() or not out.read_bytes()
        agent.open()
        result = await run_cli(*args)
        assert result.returncode == 0, result.stderr[-3000:]
        sent = [body.get("_ng_attempt_index", 0) for body in agent.bodies]
        assert sent == [0, 1, 2], sent
        assert agent.bodies[2]["_ng_capture_id"].startswith("0-0-a2.")
        [row] = read_jsonl(out)
        assert row["_ng_attempt_index"] == 2
        assert row["_ng_dispatch"]["rollout_id"] == "0-0-a2"
    finally:
        await agent.close()


def test_the_hop_that_creates_the_file_makes_its_name_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reservation fsynced in a file whose name a power cut takes away reserved
    # nothing: the next hop would send the same attempt index again.
    synced: list[Path] = []
    monkeypatch.setattr(reservations, "fsync_dir", synced.append)
    path = tmp_path / "out_attempt_reservations.jsonl"
    first = Reservations.load(path)
    first.reserve([(0, 10)])
    first.reserve([(10, 20)])
    assert synced == [tmp_path]
    Reservations.load(path).reserve([(0, 10)])
    assert synced == [tmp_path]
