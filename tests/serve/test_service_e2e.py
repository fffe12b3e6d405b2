"""Service mode (contracts §12) through the real CLI: `dispatcher serve` in a subprocess,
real agents on 127.0.0.1, the jobs API over HTTP.

Agents are gated by the test where ordering matters (``FakeAgent``); no sleeps.
"""

from __future__ import annotations

import signal
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from tests.conftest import SimAgentFactory
from tests.helpers import (
    CliProcess,
    FakeAgent,
    listening_url,
    read_jsonl,
    run_cli,
    spawn_cli,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)


def api_session() -> aiohttp.ClientSession:
    """A session whose bodies say they are JSON: the jobs API refuses the types a
    browser sends unasked (text/plain, a form)."""
    return aiohttp.ClientSession(headers={"Content-Type": "application/json"})


class Serve:
    """A running ``dispatcher serve`` and an HTTP session to it."""

    def __init__(self, proc: CliProcess, url: str, session: aiohttp.ClientSession) -> None:
        self.proc = proc
        self.url = url
        self.http = session

    @classmethod
    async def start(cls, state_dir: Path, agent_url: str, *flags: str) -> Serve:
        return await cls.spawn(
            "--listen", "127.0.0.1:0", "--state-dir", str(state_dir),
            "--agent", f"sim={agent_url}", "--log-format", "json", "--fsync", "never", *flags,
        )  # fmt: skip

    @classmethod
    async def spawn(cls, *args: str, env: dict[str, str] | None = None) -> Serve:
        """``dispatcher serve ARGS``, once it says it listens."""
        proc = await spawn_cli("serve", *args, env=env)
        return cls(proc, await listening_url(proc), api_session())

    async def submit(self, expect: int = 201, **body: Any) -> dict[str, Any]:
        async with self.http.post(f"{self.url}/v1/jobs", data=orjson.dumps(body)) as r:
            data: dict[str, Any] = await r.json()
            assert r.status == expect, data
            return data

    async def job(self, job_id: str) -> dict[str, Any]:
        async with self.http.get(f"{self.url}/v1/jobs/{job_id}") as r:
            data: dict[str, Any] = await r.json()
            return data

    async def results(self, job_id: str, **params: Any) -> list[dict[str, Any]]:
        """Every line of a results stream, read to its end."""
        query = {k: str(v).lower() for k, v in params.items()}
        async with self.http.get(f"{self.url}/v1/jobs/{job_id}/results", params=query) as r:
            assert r.status == 200
            assert r.headers["Content-Type"] == "application/x-ndjson"
            return [orjson.loads(line) async for line in r.content if line.strip()]

    def slot_waiters(self, count: int) -> Any:
        """A condition: ``count`` jobs wait for a slot of the pool (from /status)."""

        async def check() -> bool:
            async with self.http.get(f"{self.url}/status") as r:
                return bool((await r.json())["slot_waiters"] == count)

        return check

    def streams_open(self, count: int) -> Any:
        """A condition: ``count`` results streams are open (from /status)."""

        async def check() -> bool:
            async with self.http.get(f"{self.url}/status") as r:
                return bool((await r.json())["streams_open"] == count)

        return check

    async def metrics(self) -> str:
        async with self.http.get(f"{self.url}/metrics") as r:
            return await r.text()

    def in_state(self, job_id: str, state: str) -> Any:
        """A condition: the job's status says ``state``."""

        async def check() -> bool:
            return bool((await self.job(job_id))["state"] == state)

        return check

    async def set_policy(self, version: int) -> None:
        async with self.http.post(f"{self.url}/v1/policy", json={"version": version}) as r:
            assert r.status == 200

    async def stop(self, sig: int = signal.SIGTERM) -> int:
        await self.http.close()
        if sig == signal.SIGKILL:
            return (await self.proc.kill()).returncode
        self.proc.send_signal(sig)
        result = await self.proc.wait()
        if result.returncode != 0:
            print(result.stderr[-3000:])
        return result.returncode


def lint_metrics(promtool: str, text: str) -> None:
    """``promtool check metrics`` finds nothing to say about the scrape."""
    lint = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


def log_events(proc: CliProcess) -> list[dict[str, Any]]:
    """The JSON log events a daemon wrote to stderr."""
    lines = b"".join(proc.stderr).splitlines()
    return [orjson.loads(line) for line in lines if line.startswith(b"{")]


def rows(count: int, **extra: Any) -> list[dict[str, Any]]:
    return [{"agent_ref": {"name": "sim"}, "question": i, **extra} for i in range(count)]


def keys(lines: list[dict[str, Any]]) -> list[tuple[int, int]]:
    return [(row["_ng_task_index"], row["_ng_rollout_index"]) for row in lines]


def row_lines(stream: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in stream if "end" not in line]


async def test_three_jobs_by_priority_every_row_streamed_once_in_groups(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    serve = await Serve.start(tmp_path / "state", gated_agent.url, "--concurrency", "1")
    try:
        # One slot, held: the order in which the agent sees the rest shows who won it.
        await serve.submit(job_id="first", rows=rows(1, job="first"))
        await wait_until(lambda: gated_agent.holding == 1)
        for job_id, priority in (("low", 0), ("high", 5), ("mid", 2)):
            await serve.submit(job_id=job_id, rows=rows(2, job=job_id), num_repeats=2,
                               priority=priority)  # fmt: skip
        await wait_until(serve.slot_waiters(3))
        gated_agent.open()
        streams = {j: await serve.results(j, wait=True) for j in ("first", "low", "high", "mid")}
        groups = {j: await serve.results(j, wait=True, group=True) for j in ("low", "high", "mid")}
    finally:
        assert await serve.stop() == 0
    # The slot went by priority: high's 4 rollouts, then mid's, then low's.
    order = [body["job"] for body in gated_agent.bodies]
    assert order == ["first"] + ["high"] * 4 + ["mid"] * 4 + ["low"] * 4
    for job_id, stream in streams.items():
        lines = row_lines(stream)
        assert stream[-1] == {"end": "done"}
        assert [line["_ng_seq"] for line in lines] == list(range(1, len(lines) + 1))
        assert len(set(keys(lines))) == len(lines) == (1 if job_id == "first" else 4)
    for stream in groups.values():
        complete = row_lines(stream)
        assert [g["_ng_seq"] for g in complete] == [1, 2]
        assert sorted(g["task_index"] for g in complete) == [0, 1]
        for group in complete:
            assert group["failures"] == 0
            assert {r["_ng_task_index"] for r in group["rows"]} == {group["task_index"]}
            assert sorted(r["_ng_rollout_index"] for r in group["rows"]) == [0, 1]
    # A job's rollouts all run in one context, copied once: each event still
    # names its own job and run.
    finished = [e for e in log_events(serve.proc) if e["event"] == "rollout_finished"]
    assert Counter(e["job_id"] for e in finished) == {"first": 1, "high": 4, "mid": 4, "low": 4}
    assert all(e["run_id"] for e in finished)


async def test_a_consumer_that_reconnects_with_after_misses_and_repeats_nothing(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    serve = await Serve.start(tmp_path / "state", gated_agent.url, "--concurrency", "4")
    got: list[dict[str, Any]] = []
    try:
        await serve.submit(job_id="j", rows=rows(10))
        url = f"{serve.url}/v1/jobs/j/results"
        async with serve.http.get(url, params={"wait": "true"}) as r:
            for _ in range(3):
                await wait_until(lambda: gated_agent.holding > 0)
                gated_agent.release_next()
                got.append(orjson.loads(await r.content.readline()))
        # The connection is gone; rows keep coming while nobody reads.
        for _ in range(4):
            await wait_until(lambda: gated_agent.holding > 0)
            gated_agent.release_next()
        await wait_until(lambda: _durable(tmp_path, "j") >= 7)
        gated_agent.open()
        got += await serve.results("j", after=got[-1]["_ng_seq"], wait=True)
    finally:
        assert await serve.stop() == 0
    assert got[-1] == {"end": "done"}
    lines = row_lines(got)
    assert [line["_ng_seq"] for line in lines] == list(range(1, 11))
    assert sorted(keys(lines)) == [(i, 0) for i in range(10)]


def _durable(tmp_path: Path, job_id: str) -> int:
    output = tmp_path / "state" / "jobs" / job_id / "rollouts.jsonl"
    return output.read_bytes().count(b"\n") if output.exists() else 0


async def test_delete_cancels_a_job_and_its_in_flight_rollouts_write_nothing(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    serve = await Serve.start(tmp_path / "state", gated_agent.url, "--concurrency", "3")
    try:
        await serve.submit(job_id="doomed", rows=rows(20))
        await wait_until(lambda: gated_agent.holding == 3)
        gated_agent.release_next()
        # One row written, and its freed slot taken by a fourth rollout.
        await wait_until(lambda: _durable(tmp_path, "doomed") == 1 and gated_agent.holding == 3)
        async with serve.http.delete(f"{serve.url}/v1/jobs/doomed") as r:
            assert r.status == 200
        stream = await serve.results("doomed", wait=True)
        status = await serve.job("doomed")
        await wait_until(lambda: gated_agent.disconnects == 3)
    finally:
        assert await serve.stop() == 0
    assert stream[-1] == {"end": "cancelled"}
    assert len(row_lines(stream)) == 1
    assert status["state"] == "cancelled" and status["final"] is True
    folder = tmp_path / "state" / "jobs" / "doomed"
    assert len(read_jsonl(folder / "rollouts.jsonl")) == 1
    assert read_jsonl(folder / "rollouts_failures.jsonl") == []
    assert gated_agent.seen == 4  # nothing started after the cancel


async def test_kill_9_mid_job_then_the_same_command_finishes_every_job_exactly_once(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, _ = await sim_agent(latency_s=0.05)
    state = tmp_path / "state"
    serve = await Serve.start(state, url, "--concurrency", "8")
    await serve.submit(job_id="a", rows=rows(40), num_repeats=2)
    await serve.submit(job_id="b", rows=rows(30), priority=1)
    await wait_until(lambda: _durable(tmp_path, "a") + _durable(tmp_path, "b") >= 10)
    assert await serve.stop(signal.SIGKILL) == -signal.SIGKILL
    # What the same command will resume, read from the files alone.
    crashed = await run_cli("status", str(state), "--json")
    assert crashed.returncode == 75, crashed.stderr
    standing = orjson.loads(crashed.stdout)
    assert standing["running"] is False
    assert [(j["job_id"], j["state"]) for j in standing["jobs"]] == [
        ("a", "unfinished"), ("b", "unfinished")
    ]  # fmt: skip

    again = await Serve.start(state, url, "--concurrency", "8")
    try:
        streams = {j: await again.results(j, wait=True) for j in ("a", "b")}
        listing = await again.http.get(f"{again.url}/v1/jobs")
        jobs = {j["job_id"]: j for j in (await listing.json())["jobs"]}
        live = await run_cli("status", str(state))
    finally:
        assert await again.stop() == 0
    assert live.returncode == 0, live.stderr
    assert "dispatcher serve running (pid" in live.stdout
    table = [line.split() for line in live.stdout.splitlines()[2:]]
    assert table == [
        ["job", "state", "priority", "policy", "expected", "succeeded", "failed", "left"],
        ["a", "done", "0", "-", "80", "80", "0", "0"],
        ["b", "done", "1", "-", "30", "30", "0", "0"],
    ]
    for job_id, expected in (("a", 80), ("b", 30)):
        assert streams[job_id][-1] == {"end": "done"}
        lines = row_lines(streams[job_id])
        assert len(lines) == expected
        assert len(set(keys(lines))) == expected
        assert jobs[job_id]["state"] == "done"
        output = read_jsonl(state / "jobs" / job_id / "rollouts.jsonl")
        assert Counter(keys(output)).most_common(1)[0][1] == 1


async def test_off_policy_pacing_starts_step_p_only_once_v_reaches_p_minus_k(
    promtool: str, tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, stats = await sim_agent(latency_s=0.0)
    serve = await Serve.start(tmp_path / "state", url, "--max-off-policy-steps", "1")
    try:
        for step in range(4):
            await serve.submit(job_id=f"step{step}", rows=rows(5), policy_version=step)
        for step in (0, 1):
            assert (await serve.results(f"step{step}", wait=True))[-1] == {"end": "done"}
        # V = 0: steps 2 and 3 are more than one step ahead and start nothing.
        await wait_until(serve.in_state("step2", "paced"))
        await wait_until(serve.in_state("step3", "paced"))
        assert stats.requests == 10
        metrics = await serve.metrics()
        assert 'dispatcher_jobs{state="paced"} 2.0' in metrics
        assert 'dispatcher_jobs{state="done"} 2.0' in metrics
        assert "dispatcher_policy_version 0.0" in metrics
        lint_metrics(promtool, metrics)
        await serve.set_policy(1)
        assert (await serve.results("step2", wait=True))[-1] == {"end": "done"}
        assert (await serve.job("step3"))["state"] == "paced"
        assert stats.requests == 15
        await serve.set_policy(2)
        step3 = await serve.results("step3", wait=True)
        all_rows = {s: row_lines(await serve.results(f"step{s}")) for s in range(4)}
    finally:
        assert await serve.stop() == 0
    assert step3[-1] == {"end": "done"}
    for step, lines in all_rows.items():
        assert len(lines) == 5
        for row in lines:
            assert row["_ng_policy_version_start"] >= step - 1
            assert row["_ng_policy_version_end"] >= row["_ng_policy_version_start"]


async def test_bad_job_bodies_are_400_naming_the_field_and_create_nothing(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, _ = await sim_agent()
    state = tmp_path / "state"
    serve = await Serve.start(state, url)
    bad = {
        b"{not json": "body: not valid JSON",
        b"[]": "body: must be a JSON object",
        orjson.dumps({"rows": rows(1), "input": "x.jsonl"}): "give exactly one of rows or input",
        orjson.dumps({}): "give exactly one of rows or input",
        orjson.dumps({"rows": rows(1), "job_id": "../up"}): "job_id:",
        orjson.dumps({"rows": rows(1), "default_agent": "nope"}): "default_agent: unknown agent",
        orjson.dumps({"rows": [{"agent_ref": {"name": "nope"}}]}): "rows[0]:",
        orjson.dumps({"rows": [*rows(2), {"_ng_no_persist": True}]}): "rows[2]:",
        orjson.dumps({"rows": rows(1), "num_repeats": 0}): "num_repeats:",
        orjson.dumps({"rows": rows(1), "colour": "red"}): "colour: not a job field",
        orjson.dumps({"rows": rows(1), "max_attempts": 0}): "max_attempts:",
        orjson.dumps({"rows": rows(1), "max_attempts": "1"}): "max_attempts:",
        orjson.dumps({"input": str(tmp_path / "absent.jsonl")}): "input:",
    }
    try:
        for body, message in bad.items():
            async with serve.http.post(f"{serve.url}/v1/jobs", data=body) as r:
                error = (await r.json())["error"]
                assert r.status == 400, (body, error)
                assert message in error and "\n" not in error, (body, error)
        assert sorted(p.name for p in (state / "jobs").iterdir()) == []
        await serve.submit(job_id="once", rows=rows(1))
        again = await serve.submit(expect=200, job_id="once", rows=rows(1))
        assert again["job_id"] == "once"
        async with serve.http.post(
            f"{serve.url}/v1/jobs", data=orjson.dumps({"job_id": "once", "rows": rows(2)})
        ) as r:
            assert r.status == 409
            assert "different body" in (await r.json())["error"]
        async with serve.http.get(f"{serve.url}/v1/jobs/nobody/results") as r:
            assert r.status == 404
        async with serve.http.get(f"{serve.url}/v1/jobs/once/results?after=-1") as r:
            assert r.status == 400
        # A second daemon on the same state directory: exit 2, naming it.
        second = await spawn_cli(
            "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state), "--agent", f"sim={url}"
        )
        result = await second.wait()
        assert result.returncode == 2
        assert "--state-dir" in result.stderr and "another dispatcher serve" in result.stderr
        # Its one job ends before the stop: exit 0 says every job is final (else 75).
        assert (await serve.results("once", wait=True))[-1] == {"end": "done"}
    finally:
        assert await serve.stop() == 0


async def test_a_job_folder_that_exists_without_its_record_is_a_failed_job_and_a_conflict(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, _ = await sim_agent()
    state = tmp_path / "state"
    (state / "jobs" / "taken").mkdir(parents=True)
    (state / "jobs" / "taken" / "rollouts.jsonl").write_bytes(b'{"other": 1}\n')
    serve = await Serve.start(state, url)
    try:
        status = await serve.job("taken")
        async with serve.http.post(
            f"{serve.url}/v1/jobs", data=orjson.dumps({"job_id": "taken", "rows": rows(1)})
        ) as r:
            assert r.status == 409
            conflict = (await r.json())["error"]
    finally:
        # The job is failed, not settled: the daemon says so with its exit code.
        assert await serve.stop() == 75
    assert status["state"] == "failed" and status["final"] is True
    assert "job.json: missing" in status["error"]
    assert str(state / "jobs" / "taken") in conflict and "move" in conflict
    assert (state / "jobs" / "taken" / "rollouts.jsonl").read_bytes() == b'{"other": 1}\n'


async def test_failed_attempts_run_again_in_a_next_hop_within_the_daemon(tmp_path: Path) -> None:
    def first_attempts_fail(body: dict[str, Any]) -> web.StreamResponse:
        if body.get("_ng_attempt_index", 0) == 0 and body["question"] % 2 == 0:
            return web.json_response({"error": "flaky"}, status=500)
        return web.json_response({"reward": 1.0})

    agent = FakeAgent(first_attempts_fail)
    await agent.start()
    serve = await Serve.start(tmp_path / "state", agent.url)
    try:
        await serve.submit(job_id="flaky", rows=rows(6))
        stream = await serve.results("flaky", wait=True, group=True)
        status = await serve.job("flaky")
    finally:
        assert await serve.stop() == 0
        await agent.close()
    assert stream[-1] == {"end": "done"}
    groups = row_lines(stream)
    assert sorted(g["task_index"] for g in groups) == list(range(6))
    assert all(len(g["rows"]) == 1 and g["failures"] == 0 for g in groups)
    assert status["state"] == "done"
    folder = tmp_path / "state" / "jobs" / "flaky"
    assert len(read_jsonl(folder / "rollouts_failures.jsonl")) == 3
    assert orjson.loads((folder / "rollouts_manifest.json").read_bytes())["hops"] == 2


async def test_a_job_with_max_attempts_1_runs_no_attempt_again(tmp_path: Path) -> None:
    """The caller retries itself: the job's cap, not the daemon's --max-attempts 3."""

    def first_attempts_fail(body: dict[str, Any]) -> web.StreamResponse:
        if body.get("_ng_attempt_index", 0) == 0 and body["question"] % 2 == 0:
            return web.json_response({"error": "flaky"}, status=500)
        return web.json_response({"reward": 1.0})

    agent = FakeAgent(first_attempts_fail)
    await agent.start()
    serve = await Serve.start(tmp_path / "state", agent.url, "--max-attempts", "3")
    try:
        await serve.submit(job_id="once", rows=rows(6), max_attempts=1)
        stream = await serve.results("once", wait=True)
        # The same body again is the same job; another cap is another body.
        await serve.submit(expect=200, job_id="once", rows=rows(6), max_attempts=1)
        await serve.submit(expect=409, job_id="once", rows=rows(6), max_attempts=2)
        await serve.submit(job_id="thrice", rows=rows(6))
        again = await serve.results("thrice", wait=True)
        # Final failures come on a stream that asks for them, resumable on their own seq.
        failed = await serve.results("once", wait=True, failures=True)
        tail = await serve.results("once", failures=True, failures_after=2)
        # Failed attempts a later one made good are not final: no failure line.
        retried = await serve.results("thrice", wait=True, failures=True)
        for query in ("failures=true&group=true", "failures_after=1", "failures=maybe"):
            async with serve.http.get(f"{serve.url}/v1/jobs/once/results?{query}") as r:
                assert r.status == 400, query
                assert "failures" in (await r.json())["error"]
    finally:
        assert await serve.stop() == 0
        await agent.close()
    assert stream[-1] == {"end": "done"}
    assert sorted(r["_ng_task_index"] for r in row_lines(stream)) == [1, 3, 5]
    folder = tmp_path / "state" / "jobs" / "once"
    assert len(read_jsonl(folder / "rollouts_failures.jsonl")) == 3
    assert orjson.loads((folder / "rollouts_manifest.json").read_bytes())["hops"] == 1
    assert len(row_lines(again)) == 6
    assert all("failure" not in line for line in stream)  # not asked for: as before
    failures = [line for line in failed if "failure" in line]
    assert [line["_ng_failure_seq"] for line in failures] == [1, 2, 3]
    assert sorted(line["failure"]["_ng_task_index"] for line in failures) == [0, 2, 4]
    assert {line["failure"]["_ng_failure_http_status"] for line in failures} == {500}
    assert len(row_lines(failed)) == 6 and failed[-1] == {"end": "done"}
    assert [line["_ng_failure_seq"] for line in tail if "failure" in line] == [3]
    assert len(row_lines(retried)) == 6 and all("failure" not in line for line in retried)


async def test_a_bad_listen_address_is_exit_2_naming_the_flag(tmp_path: Path) -> None:
    proc = await spawn_cli(
        "serve", "--listen", "nope", "--state-dir", str(tmp_path / "state"),
        "--agent", "sim=http://127.0.0.1:9",
    )  # fmt: skip
    result = await proc.wait()
    assert result.returncode == 2
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line == "error: --listen 'nope': expected HOST:PORT for the address, got 'nope'"
    assert not (tmp_path / "state").exists()


async def test_an_agent_result_cannot_set_the_streams_seq_or_the_policy_versions(
    tmp_path: Path,
) -> None:
    # A line with two ``_ng_seq`` reads as the agent's in every JSON parser: a
    # client resuming with ``after=`` would skip or repeat rows (contracts §12).
    forged = {"reward": 1.0, "_ng_seq": 1000, "_ng_policy_version_start": 99,
              "_ng_policy_version_end": 99}  # fmt: skip
    agent = FakeAgent(lambda body: web.json_response(forged))
    await agent.start()
    serve = await Serve.start(tmp_path / "state", agent.url)
    try:
        await serve.set_policy(3)
        await serve.submit(job_id="j", rows=rows(3))
        url = f"{serve.url}/v1/jobs/j/results"
        async with serve.http.get(url, params={"wait": "true"}) as r:
            lines = [line async for line in r.content if line.strip()]
        resumed = await serve.results("j", after=1)
    finally:
        assert await serve.stop() == 0
        await agent.close()
    assert orjson.loads(lines[-1]) == {"end": "done"}
    for seq, line in enumerate(lines[:-1], 1):
        for key in forged:
            assert line.count(b'"%s":' % key.encode()) == 1, (key, line)
        row = orjson.loads(line)
        assert row["_ng_seq"] == seq and row["reward"] == 1.0
        assert row["_ng_policy_version_start"] == row["_ng_policy_version_end"] == 3
        dropped = sorted(set(forged) - {"reward"})
        assert row["_ng_dispatch"]["reserved_keys_dropped"] == dropped
    assert [row["_ng_seq"] for row in resumed] == [2, 3]


async def test_serve_takes_its_own_settings_from_the_config_file_and_the_environment(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    # TOML < DISPATCHER_* < flags, as for `run` (contracts §12); the trainer's own
    # DISPATCHER_URL (the docs export it) is not a setting of the daemon.
    agent_url, _ = await sim_agent()
    state_dir = tmp_path / "state"
    config = tmp_path / "dispatcher.toml"
    config.write_text(f'state_dir = "{state_dir}"\nmax_job_rollouts = 2\nfsync = "never"\n')
    env = {
        "DISPATCHER_LISTEN": "127.0.0.1:0",
        "DISPATCHER_MAX_JOB_ROLLOUTS": "3",
        "DISPATCHER_URL": "http://127.0.0.1:8080",
    }
    serve = await Serve.spawn("--config", str(config), "--agent", f"sim={agent_url}", env=env)
    try:
        await serve.submit(job_id="three", rows=rows(3))
        refused = await serve.submit(expect=400, job_id="four", rows=rows(4))
        streamed = await serve.results("three", wait=True)
    finally:
        assert await serve.stop() == 0
    assert "--max-job-rollouts" in refused["error"]
    assert streamed[-1] == {"end": "done"} and len(row_lines(streamed)) == 3
    assert (state_dir / "jobs" / "three" / "rollouts.jsonl").exists()
