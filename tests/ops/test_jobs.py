"""`dispatcher jobs` through the real CLI against a real `dispatcher serve` process:
each action, a token-protected daemon, an https one, a daemon that is not there, a
job that is not, a follow across a restart of the daemon, and the example of
docs/service.md as written.

Agents are the sim agent, or a ``FakeAgent`` the test gates where the order of
rows matters; the tests wait on events (a line printed, a request held), never
on time.
"""

from __future__ import annotations

import asyncio
import re
import signal
from pathlib import Path
from typing import Any

import orjson
import pytest

from dispatcher.client.wire import JobStatus
from dispatcher.errors import ConfigError
from dispatcher.lifecycle import JobState
from dispatcher.ops.jobs import read_rows
from dispatcher.ops.jobs_view import end_exit_code, progress_line, render_job
from tests.conftest import SimAgentFactory
from tests.helpers import (
    CliResult,
    FakeAgent,
    free_port,
    run_cli,
    self_signed,
    spawn_cli,
    wait_until,
    write_tasks,
)
from tests.serve.test_auth import TOKEN, start_serve, stop, token_file
from tests.serve.test_service_e2e import Serve
from tests.test_readme_commands import example, run_shell, tasks_for

pytestmark = pytest.mark.timeout(180)


async def jobs(url: str, *args: str, **env: str) -> CliResult:
    """``dispatcher jobs ARGS`` with the daemon's address from ``DISPATCHER_URL``."""
    return await run_cli("jobs", *args, env={"DISPATCHER_URL": url, **env})


def ndjson(text: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in text.splitlines()]


def table_row(out: str, job_id: str) -> list[str]:
    """The cells of a job's line of the `jobs list` table."""
    [line] = [line for line in out.splitlines() if line.split()[:1] == [job_id]]
    return line.split()


def said_once(result: CliResult, *phrases: str) -> None:
    """A refusal: exit 2, one line on stderr holding each phrase, no traceback."""
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr


async def test_submit_wait_list_show_tail_and_policy(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    agent_url, _ = await sim_agent()
    rows = write_tasks(tmp_path / "rows.jsonl", 3)
    daemon = await Serve.start(tmp_path / "state", agent_url, "--input-root", str(tmp_path))
    try:
        url = daemon.url
        done = await jobs(
            url, "submit", "--rows", str(rows), "--job-id", "a", "--num-repeats", "2",
            "--priority", "5", "--policy-version", "0", "--metadata", '{"step": 0}', "--wait",
        )  # fmt: skip
        assert done.returncode == 0, done
        assert done.stdout.splitlines()[-1] == "job a: done"

        listed = await jobs(url, "list")
        assert listed.stdout.startswith(f"daemon at {url}: policy version 0, ")
        assert table_row(listed.stdout, "a") == ["a", "done", "5", "0", "6", "6", "0", "0"]
        [job] = orjson.loads((await jobs(url, "list", "--json")).stdout)["jobs"]
        assert (job["job_id"], job["state"], job["outcomes"]) == ("a", "done", {"success": 6})
        assert orjson.loads((await jobs(url, "list", "--state", "running", "--json")).stdout) == {
            "jobs": []
        }

        shown = (await jobs(url, "show", "a")).stdout.splitlines()
        assert shown[0] == "job a: done"
        assert "  rollouts         expected 6, succeeded 6, failed 0, left 0" in shown
        assert '  metadata         {"step":0}' in shown
        assert orjson.loads((await jobs(url, "show", "a", "--json")).stdout)["rows_durable"] == 6

        ended = await jobs(url, "cancel", "a")
        assert ended.stdout == "job a: done (it had ended: nothing to cancel)\n"
        await check_tail(url)
        await check_input_and_policy(url)
    finally:
        assert await daemon.stop() == 0


async def check_tail(url: str) -> None:
    """A final job's rows, from a seq, grouped, and followed to its end."""
    lines = ndjson((await jobs(url, "tail", "a")).stdout)
    assert [line["_ng_seq"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert {line["_ng_task_index"] for line in lines} == {0, 1, 2}
    after = ndjson((await jobs(url, "tail", "a", "--after", "4")).stdout)
    assert [line["_ng_seq"] for line in after] == [5, 6]
    groups = ndjson((await jobs(url, "tail", "a", "--group")).stdout)
    assert sorted(g["task_index"] for g in groups) == [0, 1, 2]
    assert all(len(g["rows"]) == 2 for g in groups)
    followed = await jobs(url, "tail", "a", "--follow")
    assert followed.returncode == 0 and len(ndjson(followed.stdout)) == 6


async def check_input_and_policy(url: str) -> None:
    """A task file on the daemon's side, submitted twice: the same job; the policy version."""
    for _ in range(2):
        answer = await jobs(url, "submit", "--input", "rows.jsonl", "--job-id", "b", "--json")
        assert answer.returncode == 0, answer
        assert orjson.loads(answer.stdout)["job_id"] == "b"
    again = await jobs(url, "submit", "--input", "rows.jsonl", "--job-id", "b", "--wait")
    assert (again.returncode, again.stdout.splitlines()[-1]) == (0, "job b: done")
    assert (await jobs(url, "policy")).stdout == "0\n"
    assert (await jobs(url, "policy", "3")).stdout == "3\n"
    assert (await jobs(url, "policy")).stdout == "3\n"
    conflict = await jobs(
        url, "submit", "--input", "rows.jsonl", "--job-id", "b", "--priority", "1"
    )
    said_once(conflict, f"the daemon at {url} refused it: 409")
    for action in (["show", "nope"], ["cancel", "nope"], ["tail", "nope", "--follow"]):
        said_once(await jobs(url, *action), "no job 'nope'", url)


async def test_pause_holds_a_job_that_cancel_ends(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    agent_url, stats = await sim_agent()
    rows = write_tasks(tmp_path / "rows.jsonl", 3)
    daemon = await Serve.start(tmp_path / "state", agent_url)
    try:
        url = daemon.url
        paused = await jobs(url, "pause", "--ttl-s", "600", "--reason", "weight update")
        assert paused.stdout.startswith("admission paused (reason 'weight update', ends by itself")
        waiting = await spawn_cli(
            "jobs", "submit", "--rows", str(rows), "--job-id", "held", "--wait",
            env={"DISPATCHER_URL": url},
        )  # fmt: skip
        try:
            await wait_until(lambda: b"job held: " in b"".join(waiting.stdout), timeout_s=30)
            # Running (its rollouts counted), none started: the pause holds them.
            await wait_until(daemon.in_state("held", "running"), timeout_s=30)
            listed = (await jobs(url, "list")).stdout
            assert "admission paused (reason 'weight update'" in listed
            assert table_row(listed, "held")[4:] == ["3", "0", "0", "3"]
            await check_interrupted_tail(daemon)

            cancelled = await jobs(url, "cancel", "held")
            assert (cancelled.returncode, cancelled.stdout) == (0, "job held: cancelled\n")
            ended = await waiting.wait()
        finally:
            await waiting.kill()
        assert (ended.returncode, ended.stdout.splitlines()[-1]) == (1, "job held: cancelled")
        assert (await jobs(url, "resume")).stdout == "admission open; 0 rollouts in flight\n"
        assert stats.requests == 0  # paused, then cancelled: nothing reached the agent
    finally:
        assert await daemon.stop() == 0


async def check_interrupted_tail(daemon: Serve) -> None:
    """Ctrl-C on a `tail --follow` of a held job: exit 75, nothing printed, the job goes on."""
    follow = await spawn_cli("jobs", "tail", "held", "--follow", env={"DISPATCHER_URL": daemon.url})
    try:

        async def streaming() -> bool:
            async with daemon.http.get(f"{daemon.url}/status") as answer:
                return bool((await answer.json())["streams_open"] == 1)

        await wait_until(streaming, timeout_s=30)
        follow.send_signal(signal.SIGINT)
        result = await follow.wait()
    finally:
        await follow.kill()
    assert (result.returncode, result.stdout, result.stderr) == (75, "", "")
    assert (await daemon.job("held"))["state"] == "running"


async def test_tail_follow_prints_each_row_as_it_becomes_durable(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    rows = write_tasks(tmp_path / "rows.jsonl", 3)
    daemon = await Serve.start(tmp_path / "state", gated_agent.url)
    try:
        url = daemon.url
        assert (await jobs(url, "submit", "--rows", str(rows), "--job-id", "f")).returncode == 0
        follow = await spawn_cli("jobs", "tail", "f", "--follow", env={"DISPATCHER_URL": url})
        try:
            await wait_until(lambda: gated_agent.holding == 3, timeout_s=30)
            gated_agent.release_next()
            await wait_until(lambda: len(follow.stdout) == 1, timeout_s=30)
            assert not follow.exited  # the job runs on: the stream waits for it
            gated_agent.open()
            result = await follow.wait()
        finally:
            await follow.kill()
        assert result.returncode == 0, result.stderr
        assert [line["_ng_seq"] for line in ndjson(result.stdout)] == [1, 2, 3]
    finally:
        assert await daemon.stop() == 0


async def test_tail_follow_waits_out_a_restart_of_the_daemon(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    rows = write_tasks(tmp_path / "rows.jsonl", 3)
    # The same address both times, as a daemon restarted by its supervisor has.
    listen = ("--listen", f"127.0.0.1:{free_port()}")
    first = await Serve.start(tmp_path / "state", gated_agent.url, *listen)
    url = first.url
    assert (await jobs(url, "submit", "--rows", str(rows), "--job-id", "r")).returncode == 0
    follow = await spawn_cli("jobs", "tail", "r", "--follow", env={"DISPATCHER_URL": url})
    try:
        await wait_until(lambda: gated_agent.holding == 3, timeout_s=30)
        gated_agent.release_next()
        await wait_until(lambda: len(follow.stdout) == 1, timeout_s=30)
        assert await first.stop(signal.SIGKILL) == -signal.SIGKILL
        gated_agent.open()  # the rollouts the restarted daemon resumes answer at once
        again = await Serve.start(tmp_path / "state", gated_agent.url, *listen)
        try:
            result = await follow.wait()
        finally:
            assert await again.stop() == 0
    finally:
        await follow.kill()
    assert result.returncode == 0, result.stderr
    assert [line["_ng_seq"] for line in ndjson(result.stdout)] == [1, 2, 3]


async def test_tail_into_a_reader_that_leaves_early(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    # Rows of 64 KiB: more than a pipe holds, so `head` leaves while tail writes.
    agent_url, _ = await sim_agent(row_bytes=1 << 16)
    rows = write_tasks(tmp_path / "rows.jsonl", 4)
    daemon = await Serve.start(tmp_path / "state", agent_url)
    try:
        submitted = await jobs(daemon.url, "submit", "--rows", str(rows), "--job-id", "big",
                               "--num-repeats", "2", "--wait")  # fmt: skip
        assert submitted.returncode == 0, submitted
        script = (
            f"export DISPATCHER_URL={daemon.url}\n"
            "dispatcher jobs tail big 2>tail.err | head -n 1 | jq -c ._ng_seq\n"
            "echo ${PIPESTATUS[0]}; cat tail.err\n"
        )
        out = await run_shell(script, tmp_path)
    finally:
        assert await daemon.stop() == 0
    assert out == "1\n0\n"  # its first row, tail's exit code, and nothing on its stderr


async def test_a_token_protected_daemon(tmp_path: Path, sim_agent: SimAgentFactory) -> None:
    agent_url, _ = await sim_agent()
    daemon = await start_serve(
        tmp_path / "state", agent_url, "--api-token-file", str(token_file(tmp_path))
    )
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token-31337\n")
    url = daemon.url
    try:
        said_once(await jobs(url, "list"), "wants an API token and none was given",
                  "--api-token-file", "DISPATCHER_API_TOKEN")  # fmt: skip
        from_file = await jobs(url, "list", "--api-token-file", str(wrong))
        said_once(from_file, f"refused the API token of --api-token-file {wrong}")
        from_env = await jobs(url, "policy", "2", DISPATCHER_API_TOKEN="not-the-token-31337")
        said_once(from_env, "refused the API token of DISPATCHER_API_TOKEN")
        right = [
            await jobs(url, "policy", "2", "--api-token-file", str(tmp_path / "api-token")),
            await jobs(url, "list", DISPATCHER_API_TOKEN=TOKEN),
        ]
        assert [r.returncode for r in right] == [0, 0]
        assert right[0].stdout == "2\n" and "policy version 2" in right[1].stdout
        empty = tmp_path / "empty"
        empty.write_text("\n")
        said_once(await jobs(url, "list", "--api-token-file", str(empty)), "is empty")
        for result in (from_file, from_env, *right):
            assert "31337" not in result.stdout + result.stderr
            assert TOKEN not in result.stdout + result.stderr
    finally:
        code, _ = await stop(daemon)
        assert code == 0


async def test_an_https_daemon_with_a_self_signed_certificate(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    cert, key = self_signed(tmp_path)
    agent_url, _ = await sim_agent()
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    daemon = await Serve.start(tmp_path / "state", agent_url, *tls)
    url = daemon.url
    try:
        assert url.startswith("https://")
        said_once(await jobs(url, "list"), "a certificate this command does not trust",
                  "--tls-ca-file FILE")  # fmt: skip
        trusted = await jobs(url, "policy", "4", "--tls-ca-file", str(cert))
        assert (trusted.returncode, trusted.stdout) == (0, "4\n")
        not_pem = await jobs(url, "list", "--tls-ca-file", str(key.with_name("nothing.pem")))
        said_once(not_pem, "--tls-ca-file", "nothing.pem: not a PEM certificate file")
    finally:
        assert await daemon.stop() == 0


async def test_a_daemon_that_is_not_there_is_said_within_seconds(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    rows = write_tasks(tmp_path / "rows.jsonl", 1)
    actions = [["list"], ["show", "a"], ["tail", "a", "--follow"], ["pause"], ["policy", "1"],
               ["submit", "--rows", str(rows), "--wait"]]  # fmt: skip
    loop = asyncio.get_running_loop()
    started = loop.time()
    results = await asyncio.gather(*(jobs(url, *action) for action in actions))
    # The retries of one call last 5 s; a loaded machine takes longer to start the CLI.
    assert loop.time() - started < 30
    for result in results:
        said_once(result, f"no answer from a daemon at {url}",
                  "is `dispatcher serve` running there?", "DISPATCHER_URL")  # fmt: skip
    said_once(await jobs("127.0.0.1:8080", "list"), "DISPATCHER_URL: '127.0.0.1:8080' is not")


JOBS_EXAMPLE = "dispatcher jobs submit --input tasks.jsonl --job-id step-0"


async def test_the_jobs_example_runs_as_written(tmp_path: Path, sim_agent: SimAgentFactory) -> None:
    """docs/service.md's `dispatcher jobs` example, with the variables it says are set,
    against a daemon whose --input-root (its working directory) holds tasks.jsonl."""
    agent_url, _ = await sim_agent()
    (tmp_path / "tasks.jsonl").write_text(tasks_for("math_agent", 6))
    (tmp_path / "step-1.jsonl").write_text(tasks_for("math_agent", 2))
    token = "jobs-example-token"
    daemon = await spawn_cli(
        "serve", "--listen", "127.0.0.1:0", "--state-dir", "state", "--agent",
        f"math_agent={agent_url}", "--fsync", "never", "--log-format", "json",
        cwd=tmp_path, env={"DISPATCHER_API_TOKEN": token},
    )  # fmt: skip
    try:
        await wait_until(lambda: bool(daemon.stdout) or daemon.exited, timeout_s=30)
        url = daemon.stdout[0].decode().split()[-1]
        variables = f"export DISPATCHER_URL={url} DISPATCHER_API_TOKEN={token}\n"
        out = await run_shell(variables + example(JOBS_EXAMPLE), tmp_path)
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert (await daemon.wait()).returncode == 0
    lines = out.splitlines()
    assert lines[0] in ("job step-0: queued", "job step-0: running"), out
    groups = [orjson.loads(line) for line in lines if line.startswith("{")]
    assert sorted(g["task_index"] for g in groups) == list(range(6))
    assert all(len(g["rewards"]) == 8 for g in groups)
    # What the page shows `list` printing is what it printed.
    assert example("daemon at http://rollouts:8080").replace("http://rollouts:8080", url) in out
    assert "job step-0: done" in lines
    assert any(line.startswith("admission paused (reason 'weight update 0'") for line in lines)
    # `policy 1`, then step-1 from submitted to done.
    assert lines[-3] == "1" and lines[-1] == "job step-1: done", out


# -- pure pieces: what a person reads, the rows of --rows ------------------------------


def test_a_step_jobs_status_shows_its_figures_and_its_tails_command() -> None:
    job = JobStatus.from_json(
        {"job_id": "rl-step-3", "state": "satisfied", "final": True, "priority": 0,
         "policy_version": 3, "expected": 64, "remaining": 20, "done": 44,
         "outcomes": {"success": 40, "timeout": 4}, "target_groups": 8, "groups_kept": 8,
         "groups_filtered": 2, "groups_open": 1, "satisfied_at": "2026-12-04T10:00:00Z",
         "satisfied_seq": 10, "timeline": {"first_group_s": 1.5, "p50_s": 3.0, "p90_s": None}}
    )  # fmt: skip
    shown = render_job(job).splitlines()
    assert shown[0] == "job rl-step-3: satisfied"
    fields = {line.split("  ")[1]: line.split("  ", 2)[2].strip() for line in shown[1:]}
    assert fields["rollouts"] == "expected 64, succeeded 40, failed 4, left 20"
    assert fields["outcomes"] == "success 40, timeout 4"
    assert fields["target groups"] == "8 (kept 8, filtered 2, open 1)"
    assert fields["satisfied"].endswith("dispatcher jobs tail rl-step-3 --group --after 10")
    assert fields["timeline"] == "first_group_s 1.5, p50_s 3.0"
    assert "in flight" not in fields  # a final job has none


def test_the_progress_line_of_a_running_step() -> None:
    job = JobStatus.from_json(
        {"job_id": "s", "state": "running", "final": False, "expected": 64, "remaining": 24,
         "in_flight": 12, "target_groups": 8, "groups_kept": 3, "eta_s": 41.6}
    )  # fmt: skip
    assert progress_line(job) == (
        "job s: running, 40/64 rollouts final, 12 in flight, 3/8 groups kept, eta 42 s"
    )


@pytest.mark.parametrize(
    ("state", "code"),
    [("done", 0), ("satisfied", 0), ("incomplete", 75), ("failed", 1), ("cancelled", 1)],
)
def test_a_jobs_end_gives_the_exit_code(state: str, code: int) -> None:
    assert end_exit_code(JobState(state)) == code


def test_rows_are_read_with_the_line_of_a_bad_one_named(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"a": 1}\n\n{"b": 123456789012345678901234567890}\n')
    assert read_rows(good) == [{"a": 1}, {"b": 123456789012345678901234567890}]
    bad = {
        '{"a": 1}\nnope\n': "bad.jsonl:2: not JSON",
        "[1]\n": "bad.jsonl:1: not a JSON object",
        "\n": "no rows",
    }
    for text, error in bad.items():
        (tmp_path / "bad.jsonl").write_text(text)
        with pytest.raises(ConfigError, match=re.escape(error)):
            read_rows(tmp_path / "bad.jsonl")
    with pytest.raises(ConfigError, match=re.escape("missing.jsonl: cannot read it")):
        read_rows(tmp_path / "missing.jsonl")
