"""Crash-safe outputs, exact resume and graceful shutdown (contracts §4, §5, §10), via the real CLI.

A scripted agent on 127.0.0.1 answers each task the way a test asks: success,
HTTP 500, a malformed body, a kill-shaped answer, or a hold on a gate the test
opens. Successes can also be paced (``allow``) so a run is caught mid-way.
"""

from __future__ import annotations

import asyncio
import math
import resource
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from dispatcher.files.resume import rollout_key
from dispatcher.tasks.keys import materialized_key
from tests.helpers import (
    audit_outputs,
    count_lines,
    expected_keys,
    log_events,
    read_jsonl,
    run_args,
    run_cli,
    serve,
    spawn_cli,
    wait_until,
    write_tasks,
)

OK, FAIL_500, MALFORMED, KILL_SHAPED, HOLD = "ok", "500", "malformed", "kill_shaped", "hold"


class ScriptedAgent:
    """A fake agent server whose answer per task index the test decides."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.answers: dict[int, str] = {}
        self.gates: dict[int, asyncio.Event] = {}
        self.holding = 0
        self.allowed = math.inf
        self.answered = 0
        self._paced = asyncio.Condition()
        self.app = web.Application()
        self.app.router.add_post("/run", self._run)

    def hold(self, *tasks: int) -> None:
        for task in tasks:
            self.answers[task] = HOLD
            self.gates[task] = asyncio.Event()

    def release(self, task: int) -> None:
        self.gates[task].set()

    async def allow(self, successes: float) -> None:
        """Let this many successes be answered in total (``math.inf``: no pacing)."""
        async with self._paced:
            self.allowed = successes
            self._paced.notify_all()

    async def open_all(self) -> None:
        self.answers.clear()
        for gate in self.gates.values():
            gate.set()
        await self.allow(math.inf)

    def bodies_for(self, task: int) -> list[dict[str, Any]]:
        return [b for b in self.bodies if b["_ng_task_index"] == task]

    async def _run(self, request: web.Request) -> web.Response:
        body = await request.json(loads=orjson.loads)
        self.bodies.append(body)
        answer = self.answers.get(body["_ng_task_index"], OK)
        if answer == HOLD:
            self.holding += 1
            try:
                await self.gates[body["_ng_task_index"]].wait()
            finally:
                self.holding -= 1
            return _json({**body, "reward": 1.0})
        if answer == FAIL_500:
            return web.Response(status=500, text="agent error")
        if answer == MALFORMED:
            return web.Response(body=b"[1, 2]", content_type="application/json")
        if answer == KILL_SHAPED:
            return _json({"_ng_no_persist": True})
        async with self._paced:
            await self._paced.wait_for(lambda: self.answered < self.allowed)
            self.answered += 1
        return _json({**body, "reward": 1.0})


def _json(data: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


@pytest.fixture
async def agent() -> AsyncIterator[tuple[ScriptedAgent, str]]:
    scripted = ScriptedAgent()
    runner, url = await serve(scripted.app)
    yield scripted, url
    # Held handlers would otherwise keep the server's shutdown waiting.
    await scripted.open_all()
    await runner.cleanup()


def outputs(tmp_path: Path, tasks: int = 20) -> tuple[Path, Path]:
    return write_tasks(tmp_path / "tasks.jsonl", tasks), tmp_path / "out.jsonl"


def file_contents(folder: Path, pattern: str = "out*") -> dict[str, bytes]:
    """The files of a run by name, without the lock (its pid changes with each run)."""
    return {p.name: p.read_bytes() for p in folder.glob(pattern) if p.suffix != ".lock"}


def moved_aside(folder: Path) -> dict[str, dict[str, bytes]]:
    """The ``--fresh`` folders (``out_previous_<stamp>``) and their files."""
    return {d.name: file_contents(d, "*") for d in folder.glob("out_previous_*") if d.is_dir()}


def events_named(stderr: str, name: str) -> list[dict[str, Any]]:
    return [e for e in log_events(stderr) if e["event"] == name]


# ---- shutdown ------------------------------------------------------------------------


async def test_sigterm_lets_in_flight_finish_within_grace_then_cancels(
    tmp_path: Path, agent: tuple[ScriptedAgent, str]
) -> None:
    scripted, url = agent
    tasks, out = outputs(tmp_path, 40)
    scripted.hold(0, 1, 2)
    await scripted.allow(10)
    args = run_args(tasks, out, url, "--concurrency", "4", "--shutdown-grace-s", "1.5")
    proc = await spawn_cli(*args)
    await wait_until(lambda: count_lines(out) == 10 and scripted.holding == 3)
    # One more success is in flight, waiting for the pace: 4 rollouts in flight.
    await wait_until(lambda: len(scripted.bodies) == 14)

    proc.send_signal(signal.SIGTERM)
    await wait_until(lambda: proc.saw("shutdown_requested"))
    scripted.release(0)  # finishes within the grace period: written
    # The other three are held to the end: only the grace's end can stop the run.
    result = await proc.wait()

    assert result.returncode == 75, result.stderr
    # The grace's own clock: it gave them its whole 1.5 s, then cancelled them.
    [cancelled] = events_named(result.stderr, "rollouts_cancelled")
    assert cancelled["count"] == 3 and cancelled["waited_s"] >= 1.5
    assert len(scripted.bodies) == 14, "nothing new was started after SIGTERM"
    rows = read_jsonl(out)
    assert {r["_ng_task_index"] for r in rows} == {0, *range(3, 13)}
    (summary,) = events_named(result.stderr, "run_summary")
    assert summary["outcomes"] == {"success": 11, "cancelled": 3}
    assert summary["remaining"] == 29

    await scripted.open_all()
    rerun = await run_cli(*args)
    assert rerun.returncode == 0, rerun.stderr
    audit_outputs(out, expected_keys(40, 1), max_attempts=3)
    # Cancelled rollouts wrote nothing and spent no attempt; their agents had them,
    # so the rerun is a new attempt index (contracts §5: never reused).
    for task in (1, 2, 13):
        assert [b.get("_ng_attempt_index") for b in scripted.bodies_for(task)] == [None, 1]


async def test_second_sigint_exits_at_once_without_torn_or_duplicate_rows(
    tmp_path: Path, agent: tuple[ScriptedAgent, str]
) -> None:
    scripted, url = agent
    tasks, out = outputs(tmp_path, 400)
    scripted.hold(399)
    args = run_args(tasks, out, url, "--concurrency", "8", "--shutdown-grace-s", "60")
    proc = await spawn_cli(*args)
    await wait_until(lambda: scripted.holding == 1)
    proc.send_signal(signal.SIGINT)
    await wait_until(lambda: proc.saw("shutdown_requested"))
    signalled = time.monotonic()
    proc.send_signal(signal.SIGINT)
    result = await proc.wait()

    assert result.returncode == 75, result.stderr
    assert time.monotonic() - signalled < 10, "the second SIGINT did not exit at once"
    assert events_named(result.stderr, "exit_now")
    audit_outputs(out, expected_keys(400, 1), max_attempts=3, complete=False)

    await scripted.open_all()
    rerun = await run_cli(*args)
    assert rerun.returncode == 0, rerun.stderr
    audit_outputs(out, expected_keys(400, 1), max_attempts=3)


@pytest.mark.parametrize("signals", [["SIGTERM"], ["SIGINT", "SIGINT"]])
async def test_a_signal_during_startup_exits_75_without_dispatching(
    tmp_path: Path, agent: tuple[ScriptedAgent, str], signals: list[str]
) -> None:
    scripted, url = agent
    tasks, out = outputs(tmp_path, 200_000)
    args = run_args(tasks, out, url)
    proc = await spawn_cli(*args)
    # The materialized rows are being written: the run is still starting up.
    await wait_until(lambda: bool(file_contents(tmp_path, ".out_materialized_inputs.jsonl.*")))
    for sig in signals:
        proc.send_signal(signal.Signals[sig])
        await wait_until(lambda: proc.exited or proc.saw("shutdown_requested"))
    result = await proc.wait()

    assert result.returncode == 75, result.stderr
    last = "run_summary" if len(signals) == 1 else "exit_now"
    assert events_named(result.stderr, last)
    assert not scripted.bodies
    assert count_lines(out) == 0


# ---- run identity ----------------------------------------------------------------------


async def _partial_run(scripted: ScriptedAgent, args: list[str]) -> None:
    """A first run that leaves one rollout (task 0) to a rerun."""
    scripted.answers[0] = FAIL_500
    first = await run_cli(*args)
    assert first.returncode == 75, first.stderr
    scripted.answers.clear()


async def test_changed_task_file_is_refused(
    tmp_path: Path, agent: tuple[ScriptedAgent, str]
) -> None:
    scripted, url = agent
    tasks, out = outputs(tmp_path)
    args = run_args(tasks, out, url)
    await _partial_run(scripted, args)
    before = file_contents(tmp_path)
    write_tasks(tasks, 21)

    result = await run_cli(*args)

    assert result.returncode == 2
    assert "task file changed" in result.stderr
    assert "--fresh" in result.stderr
    assert file_contents(tmp_path) == before, "a refused run touched the output files"


@pytest.mark.parametrize(
    ("flags", "setting"),
    [
        (["--num-repeats", "2"], "num_repeats"),
        (["--limit", "5"], "limit"),
        (["--responses-create-params", '{"temperature": 0.5}'], "responses_create_params"),
    ],
)
async def test_changed_task_settings_are_refused(
    tmp_path: Path, agent: tuple[ScriptedAgent, str], flags: list[str], setting: str
) -> None:
    scripted, url = agent
    tasks, out = outputs(tmp_path)
    await _partial_run(scripted, run_args(tasks, out, url))

    result = await run_cli(*run_args(tasks, out, url, *flags))

    assert result.returncode == 2
    assert setting in result.stderr
    assert "--fresh" in result.stderr
    assert len(scripted.bodies) == 20


@pytest.mark.parametrize(
    "flags",
    [
        ["--concurrency", "3"],
        ["--rollout-timeout-s", "30", "--shutdown-grace-s", "5"],
        ["--dispatch-budget-s", "600", "--drain-margin-s", "1"],
        ["--fsync", "always", "--max-attempts", "5"],
        ["--log-format", "console", "--progress-interval-s", "5"],
    ],
)
async def test_settings_that_do_not_change_rollouts_never_block_resume(
    tmp_path: Path, agent: tuple[ScriptedAgent, str], flags: list[str]
) -> None:
    scripted, url = agent
    tasks, out = outputs(tmp_path)
    await _partial_run(scripted, run_args(tasks, out, url))

    result = await run_cli(*run_args(tasks, out, url, *flags))

    assert result.returncode == 0, result.stderr
    assert [b.get("_ng_attempt_index") for b in scripted.bodies_for(0)] == [None, 1]
    audit_outputs(out, expected_keys(20, 1), max_attempts=3)


async def test_changed_replica_urls_never_block_resume(
    tmp_path: Path, agent: tuple[ScriptedAgent, str]
) -> None:
    scripted, url = agent
    tasks, out = outputs(tmp_path)
    await _partial_run(scripted, run_args(tasks, out, url))
    same_server = url.replace("127.0.0.1", "localhost")

    result = await run_cli(*run_args(tasks, out, f"{url},{same_server}"))

    assert result.returncode == 0, result.stderr
    audit_outputs(out, expected_keys(20, 1), max_attempts=3)


async def test_fresh_moves_old_files_aside_and_starts_over(
    tmp_path: Path, agent: tuple[ScriptedAgent, str]
) -> None:
    scripted, url = agent
    tasks, out = outputs(tmp_path)
    await _partial_run(scripted, run_args(tasks, out, url))
    old = file_contents(tmp_path)
    old_run_id = orjson.loads(old["out_manifest.json"])["run_id"]
    write_tasks(tasks, 25)

    result = await run_cli(*run_args(tasks, out, url, "--fresh"))

    assert result.returncode == 0, result.stderr
    (moved,) = moved_aside(tmp_path).values()
    assert moved == old
    assert orjson.loads((tmp_path / "out_manifest.json").read_bytes())["run_id"] != old_run_id
    audit = audit_outputs(out, expected_keys(25, 1), max_attempts=3)
    assert not audit.failures


def materialized_identity(folder: Path) -> tuple[int, int]:
    stat = (folder / "out_materialized_inputs.jsonl").stat()
    return stat.st_ino, stat.st_mtime_ns


async def test_resume_reuses_the_materialized_rows_while_they_match_the_manifest(
    tmp_path: Path, agent: tuple[ScriptedAgent, str]
) -> None:
    scripted, url = agent
    tasks, out = outputs(tmp_path)
    args = run_args(tasks, out, url)
    await _partial_run(scripted, args)
    before = materialized_identity(tmp_path)
    (tmp_path / ".out_materialized_inputs.jsonl.4242.tmp").write_bytes(b"left by a kill")

    result = await run_cli(*args)

    assert result.returncode == 0, result.stderr
    assert materialized_identity(tmp_path) == before, "resume rewrote the materialized rows"
    assert not file_contents(tmp_path, ".out_materialized_inputs.jsonl.*.tmp")
    audit_outputs(out, expected_keys(20, 1), max_attempts=3)


async def test_a_damaged_materialized_file_is_rebuilt_on_resume(
    tmp_path: Path, agent: tuple[ScriptedAgent, str]
) -> None:
    scripted, url = agent
    tasks, out = outputs(tmp_path)
    args = run_args(tasks, out, url)
    await _partial_run(scripted, args)
    materialized = tmp_path / "out_materialized_inputs.jsonl"
    intact = materialized.read_bytes()
    materialized.write_bytes(intact[: len(intact) // 2])

    result = await run_cli(*args)

    assert result.returncode == 0, result.stderr
    assert materialized.read_bytes() == intact
    audit_outputs(out, expected_keys(20, 1), max_attempts=3)


T, R = "_ng_task_index", "_ng_rollout_index"


@pytest.mark.parametrize(
    "row",
    [
        {"q": 1, T: 3, R: 2},
        {T: 5, "q": f',"{T}":1,"{R}":1}}', R: 0},
        {"q": {T: 1, R: 1}, T: 7, R: 0},
        {T: 8, R: 4, "q": {T: 1, R: 1}},
        {"q": f'x,"{T}":1,"{R}":1}}', T: 10, R: 0},
        {R: 1, T: 9},
    ],
)
def test_materialized_key_matches_a_full_parse(row: dict[str, Any]) -> None:
    line = orjson.dumps(row) + b"\n"
    assert materialized_key(line) == rollout_key(row[T], row[R])


# ---- the run lock ----------------------------------------------------------------------


async def test_second_dispatcher_on_the_same_output_exits_2_at_once(
    tmp_path: Path, agent: tuple[ScriptedAgent, str]
) -> None:
    scripted, url = agent
    tasks, out = outputs(tmp_path)
    scripted.hold(5)
    args = run_args(tasks, out, url)
    first = await spawn_cli(*args)
    await wait_until(lambda: scripted.holding == 1)

    started = time.monotonic()
    second = await run_cli(*args, timeout_s=15)

    assert second.returncode == 2
    assert time.monotonic() - started < 10
    assert "another dispatcher" in second.stderr
    assert f"pid {first.proc.pid}" in second.stderr
    assert "out_run.lock" in second.stderr
    assert len(scripted.bodies) == 20, "the second dispatcher sent nothing"

    killed = await first.kill()
    assert killed.returncode == -signal.SIGKILL
    await scripted.open_all()
    third = await run_cli(*args)
    assert third.returncode == 0, third.stderr
    audit_outputs(out, expected_keys(20, 1), max_attempts=3)


# ---- torn tails ----------------------------------------------------------------------


@pytest.mark.parametrize("file", ["out.jsonl", "out_failures.jsonl"])
@pytest.mark.parametrize("cut", ["half_line", "newline_only"])
async def test_torn_tail_is_repaired_before_resume_appends(
    tmp_path: Path, agent: tuple[ScriptedAgent, str], cut: str, file: str
) -> None:
    scripted, url = agent
    tasks, out = outputs(tmp_path)
    args = run_args(tasks, out, url)
    await _partial_run(scripted, args)
    torn = tmp_path / file
    data = torn.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    last = orjson.loads(data[last_start:])
    if cut == "half_line":
        torn.write_bytes(data[: last_start + (len(data) - last_start) // 2])
    else:
        torn.write_bytes(data[:-1])

    result = await run_cli(*args)

    assert result.returncode == 0, result.stderr
    (repair,) = events_named(result.stderr, "torn_tail_repaired")
    assert repair["path"] == str(torn)
    assert repair["repair"] == ("dropped" if cut == "half_line" else "terminated")
    audit = audit_outputs(out, expected_keys(20, 1), max_attempts=3)
    sent = scripted.bodies_for(last["_ng_task_index"])
    if file == "out.jsonl":
        # A dropped success runs again; a terminated one stays done.
        assert len(sent) == (2 if cut == "half_line" else 1)
    else:
        # A dropped failed attempt was never counted, yet its index was reserved:
        # the rerun has the next one either way (contracts §5: never reused).
        assert [b.get("_ng_attempt_index") for b in sent] == [None, 1]
        assert len(audit.failures.get((0, 0), [])) == (0 if cut == "half_line" else 1)


# ---- attempts --------------------------------------------------------------------------


async def test_retryable_failure_is_retried_on_each_rerun_until_the_cap(
    tmp_path: Path, agent: tuple[ScriptedAgent, str]
) -> None:
    scripted, url = agent
    tasks, out = outputs(tmp_path, 5)
    scripted.answers[3] = FAIL_500
    args = run_args(tasks, out, url, "--max-attempts", "3")

    codes = [(await run_cli(*args)).returncode for _ in range(4)]

    assert codes == [75, 75, 0, 0]
    sent = scripted.bodies_for(3)
    assert [b.get("_ng_attempt_index") for b in sent] == [None, 1, 2]
    audit = audit_outputs(out, expected_keys(5, 1), max_attempts=3)
    failures = audit.failures[(3, 0)]
    assert [f["_ng_dispatch"]["rollout_id"] for f in failures] == ["3-0", "3-0-a1", "3-0-a2"]
    assert {f["_ng_failure_class"] for f in failures} == {"agent_run_error"}
    assert {f["_ng_failure_http_status"] for f in failures} == {500}
    assert audit.final_failures(3) == {(3, 0)}
    assert len(scripted.bodies) == 5 + 2


async def test_terminal_failure_is_never_retried(
    tmp_path: Path, agent: tuple[ScriptedAgent, str]
) -> None:
    scripted, url = agent
    tasks, out = outputs(tmp_path, 5)
    scripted.answers[2] = MALFORMED
    args = run_args(tasks, out, url)

    codes = [(await run_cli(*args)).returncode for _ in range(2)]

    assert codes == [0, 0]
    assert len(scripted.bodies_for(2)) == 1
    audit = audit_outputs(out, expected_keys(5, 1), max_attempts=3)
    (failure,) = audit.failures[(2, 0)]
    assert failure["_ng_failure_class"] == "protocol_violation"
    assert failure["_ng_failure_terminal"] is True


async def test_kill_shaped_and_drained_rollouts_run_again_without_spending_an_attempt(
    tmp_path: Path, agent: tuple[ScriptedAgent, str]
) -> None:
    scripted, url = agent
    tasks, out = outputs(tmp_path, 5)
    args = run_args(tasks, out, url)
    drained = await run_cli(*args, "--dispatch-budget-s", "0")
    assert drained.returncode == 75
    assert not scripted.bodies
    scripted.answers[1] = KILL_SHAPED
    kill_shaped = await run_cli(*args)
    assert kill_shaped.returncode == 75
    scripted.answers.clear()

    final = await run_cli(*args)

    assert final.returncode == 0, final.stderr
    # The drained hop sent nothing and reserved nothing; the kill-shaped attempt spent
    # none, yet its index was reserved before it was sent: never one twice (§5).
    assert [b.get("_ng_attempt_index") for b in scripted.bodies_for(1)] == [None, 1]
    audit = audit_outputs(out, expected_keys(5, 1), max_attempts=3)
    assert not audit.failures
    assert audit.successes[(1, 0)]["_ng_dispatch"]["rollout_id"] == "1-0-a1"


# ---- a failed write ---------------------------------------------------------------------


def _file_size_limit(max_bytes: int) -> Any:
    def limit() -> None:  # runs in the child between fork and exec
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return limit


async def test_failed_write_stops_dispatch_keeps_the_file_valid_and_exits_1(
    tmp_path: Path, agent: tuple[ScriptedAgent, str]
) -> None:
    scripted, url = agent
    tasks, out = outputs(tmp_path, 600)
    args = run_args(tasks, out, url, "--concurrency", "8")
    # A first run that starts nothing writes the materialized rows and the manifest,
    # whose sizes tell how large a file may grow before X.jsonl is cut off.
    assert (await run_cli(*args, "--dispatch-budget-s", "0")).returncode == 75
    materialized = (tmp_path / "out_materialized_inputs.jsonl").stat().st_size
    limit = materialized + 16_384

    proc = await spawn_cli(*args, preexec_fn=_file_size_limit(limit))
    result = await proc.wait()

    assert result.returncode == 1, result.stderr
    assert f"{out}: write failed" in result.stderr
    assert events_named(result.stderr, "output_write_failed")
    assert events_named(result.stderr, "run_summary")
    written = read_jsonl(out)
    assert sum(len(orjson.dumps(r)) + 1 for r in written) <= limit
    assert 0 < len(written) < 600
    assert len(scripted.bodies) < 600, "dispatch went on after the write failed"
    manifest = orjson.loads(file_contents(tmp_path)["out_manifest.json"])
    assert manifest["last_run"]["exit_code"] == 1

    rerun = await run_cli(*args)
    assert rerun.returncode == 0, rerun.stderr
    audit_outputs(out, expected_keys(600, 1), max_attempts=3)
