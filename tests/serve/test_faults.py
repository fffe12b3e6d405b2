"""Service mode under damage (issue 19 items 4-7): corrupt state files, a job task
that dies, a full disk, an unexpected handler error, counts over a job's passes.

Through the real CLI and real sockets, as ``test_service_e2e.py``; agents are
gated by the test where ordering matters, no sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest
from aiohttp import web

from tests.helpers import FakeAgent, audit_outputs, read_jsonl, run_cli, spawn_cli, wait_until
from tests.serve.test_service_e2e import Serve, row_lines, rows

pytestmark = pytest.mark.timeout(180)

# A stream that should end but does not fails the test after this long.
STREAM_END_S = 30.0


async def ended(serve: Serve, job_id: str, **params: Any) -> list[dict[str, Any]]:
    """A ``wait=true`` stream read to its end line (a stream that hangs fails the test)."""
    return await asyncio.wait_for(serve.results(job_id, wait=True, **params), STREAM_END_S)


async def get(serve: Serve, path: str) -> tuple[int, Any]:
    async with serve.http.get(f"{serve.url}{path}") as r:
        return r.status, await _json(r)


async def post(serve: Serve, path: str, body: Any) -> tuple[int, Any]:
    async with serve.http.post(f"{serve.url}{path}", data=orjson.dumps(body)) as r:
        return r.status, await _json(r)


async def _json(response: Any) -> Any:
    """The body as JSON; an HTML error page fails the test, showing it."""
    text = await response.text()
    assert response.content_type == "application/json", text[:500]
    return orjson.loads(text)


def one_line_error(body: Any) -> str:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    message: str = body["error"]
    assert message and "\n" not in message, message
    return message


def job_dir(state: Path, job_id: str) -> Path:
    return state / "jobs" / job_id


# ---- policy.json ----------------------------------------------------------------------


CORRUPT_POLICIES = {
    "garbage": b"garbage",
    "empty": b"",
    "string": b'{"version": "abc"}',
    "negative": b'{"version": -1}',
    "float": b'{"version": 1.5}',
    "bool": b'{"version": true}',
    "list": b"[3]",
}


@pytest.mark.parametrize("content", CORRUPT_POLICIES.values(), ids=CORRUPT_POLICIES.keys())
async def test_a_corrupt_policy_json_is_exit_2_naming_the_file(
    tmp_path: Path, content: bytes
) -> None:
    state = tmp_path / "state"
    (state / "jobs").mkdir(parents=True)
    policy = state / "policy.json"
    policy.write_bytes(content)
    proc = await spawn_cli(
        "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state),
        "--agent", "sim=http://127.0.0.1:9",
    )  # fmt: skip
    try:
        result = await proc.wait(timeout_s=30)
    except TimeoutError:
        await proc.kill()
        pytest.fail("the daemon started on a corrupt policy.json")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert str(policy) in line and "fix or remove it to start at version 0" in line
    assert policy.read_bytes() == content


async def test_a_policy_version_counts_only_once_it_is_durable(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    state = tmp_path / "state"
    serve = await Serve.start(state, gated_agent.url, "--max-off-policy-steps", "0")
    try:
        for bad in (-1, "1", True, 1.5, None):
            status, body = await post(serve, "/v1/policy", {"version": bad})
            assert status == 400 and "version" in one_line_error(body), bad
        await serve.submit(job_id="step1", rows=rows(2), policy_version=1)
        await wait_until(serve.in_state("step1", "paced"))
        # policy.json cannot be replaced (a folder holds its name): the version must not move.
        blocker = state / "policy.json"
        blocker.mkdir()
        status, body = await post(serve, "/v1/policy", {"version": 1})
        assert status == 500 and str(blocker) in one_line_error(body)
        assert await get(serve, "/v1/policy") == (200, {"version": 0})
        assert (await serve.job("step1"))["state"] == "paced"
        assert gated_agent.seen == 0
        blocker.rmdir()
        assert await post(serve, "/v1/policy", {"version": 1}) == (200, {"version": 1})
        gated_agent.open()
        assert (await ended(serve, "step1"))[-1] == {"end": "done"}
    finally:
        assert await serve.stop() == 0
    assert orjson.loads((state / "policy.json").read_bytes()) == {"version": 1}
    assert gated_agent.seen == 2


# ---- one-line JSON errors ----------------------------------------------------------------


async def test_an_unexpected_handler_error_is_one_line_json(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    state = tmp_path / "state"
    (state / "jobs").mkdir(parents=True)
    serve = await Serve.start(state, gated_agent.url)
    # The folder of the journal a submission is committed to is a file: mkdir fails.
    (state / "journal").write_bytes(b"not a folder\n")
    try:
        status, body = await post(serve, "/v1/jobs", {"job_id": "j", "rows": rows(1)})
        assert status == 500
        assert str(state / "journal") in one_line_error(body)
        status, body = await get(serve, "/v1/nothing-here")
        assert status == 404 and one_line_error(body)
        # Not a write the disk refused: the daemon stays healthy.
        assert (await get(serve, "/healthz"))[0] == 200
    finally:
        assert await serve.stop() == 0
    logged = [e for e in serve.proc.events() if e["event"] == "api_error"]
    assert len(logged) == 1 and logged[0]["status"] == 500
    assert not (state / "jobs" / "j").exists()


# ---- a job task that dies ------------------------------------------------------------------


async def test_a_job_whose_task_dies_is_failed_final_and_its_streams_end_with_the_reason(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    state = tmp_path / "state"
    serve = await Serve.start(state, gated_agent.url)
    try:
        await serve.submit(job_id="j", rows=rows(2))
        await wait_until(lambda: gated_agent.holding == 2)
        # Its final record cannot be saved (a folder holds its name): the job's task
        # raises while settling.
        blocker = job_dir(state, "j") / "job.json"
        kept = blocker.rename(blocker.with_name("job.json.kept"))
        blocker.mkdir()
        gated_agent.open()
        streams = [await ended(serve, "j"), await ended(serve, "j", group=True)]
        status = await serve.job("j")
        listed = await get(serve, "/v1/jobs")
    finally:
        # Failed is not settled: the same command would resume it.
        assert await serve.stop() == 75
    for stream in streams:
        end = stream[-1]
        assert end["end"] == "failed" and set(end) == {"end", "error"}
        assert "job.json not saved" in end["error"] and "\n" not in end["error"]
    assert status["state"] == "failed" and status["final"] is True
    assert status["error"] == streams[0][-1]["error"]
    assert listed[1]["jobs"] == [status]

    # Once the record can be written, a restart finishes the job from its files.
    blocker.rmdir()
    kept.rename(blocker)
    again = await Serve.start(state, gated_agent.url)
    try:
        stream = await ended(again, "j")
    finally:
        assert await again.stop() == 0
    assert stream[-1] == {"end": "done"}
    assert len(row_lines(stream)) == 2
    assert gated_agent.seen == 2


# ---- corrupt job files -----------------------------------------------------------------------


def _edit_record(folder: Path, **changes: Any) -> None:
    record = orjson.loads((folder / "job.json").read_bytes())
    for key, value in changes.items():
        if key == "spec":
            record["spec"].update(value)
        else:
            record[key] = value
    (folder / "job.json").write_bytes(orjson.dumps(record))


def _damage(state: Path) -> None:
    """Damage each victim's files one way; add a stray file and an empty folder. The
    journal of submissions goes too: it would make whole again a record a kill cut,
    and this is damage to jobs whose lines it no longer holds."""
    shutil.rmtree(state / "journal")
    (job_dir(state, "notjson") / "job.json").write_bytes(b"{not json")
    (job_dir(state, "alist") / "job.json").write_bytes(b"[1, 2]")
    _edit_record(job_dir(state, "strseq"), submitted_seq="3")
    _edit_record(job_dir(state, "badspec"), spec={"num_repeats": 0, "colour": "red"})
    (job_dir(state, "norecord") / "job.json").unlink()
    manifest = job_dir(state, "manifestdir") / "rollouts_manifest.json"
    manifest.unlink(missing_ok=True)
    manifest.mkdir()
    (state / "jobs" / "notes.txt").write_bytes(b"a stray file\n")
    job_dir(state, "cut").mkdir()


VICTIMS = {
    "notjson": "not valid JSON",
    "alist": "not a JSON object",
    "strseq": "submitted_seq: must be an integer",
    "badspec": "spec: num_repeats:",
    "norecord": "job.json: missing",
    "manifestdir": "rollouts_manifest.json: not a regular file",
}


async def test_jobs_with_corrupt_files_are_failed_with_one_line_while_the_others_resume(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    state = tmp_path / "state"
    serve = await Serve.start(state, gated_agent.url, "--concurrency", "1")
    await serve.submit(job_id="good", rows=rows(3))
    for job_id in VICTIMS:
        await serve.submit(job_id=job_id, rows=rows(1))
    await wait_until(lambda: gated_agent.holding == 1)
    # Their folders are written after their answers, and their jobs make their run
    # files as they start: the damage is to written files. A folder of a job not
    # started yet holds only its rows, which without job.json is a submission a
    # kill cut (its id free), not a broken job.
    manifests = [job_dir(state, j) / "rollouts_manifest.json" for j in VICTIMS]
    await wait_until(lambda: all(m.exists() for m in manifests))
    assert await serve.stop(signal.SIGKILL) == -signal.SIGKILL
    _damage(state)
    gated_agent.open()

    again = await Serve.start(state, gated_agent.url, "--concurrency", "1")
    try:
        stream = await ended(again, "good")
        listed = {j["job_id"]: j for j in (await get(again, "/v1/jobs"))[1]["jobs"]}
        victims = {job_id: await again.job(job_id) for job_id in VICTIMS}
        broken_stream = await ended(again, "norecord")
        status, conflict = await post(again, "/v1/jobs", {"job_id": "norecord", "rows": rows(1)})
        # An empty folder (a submission a kill cut) holds nothing: its id is free.
        await again.submit(job_id="cut", rows=rows(1))
        assert (await ended(again, "cut"))[-1] == {"end": "done"}
        # Moved aside, a broken job's id can be submitted again.
        job_dir(state, "norecord").rename(tmp_path / "norecord.aside")
        await again.submit(job_id="norecord", rows=rows(1))
        assert (await ended(again, "norecord"))[-1] == {"end": "done"}
        files = await run_cli("status", str(state), "--json")
        text = await run_cli("status", str(state))
    finally:
        result_code = await again.stop()
    assert stream[-1] == {"end": "done"} and len(row_lines(stream)) == 3
    assert status == 409 and str(job_dir(state, "norecord")) in one_line_error(conflict)
    assert broken_stream[-1]["end"] == "failed" and "job.json" in broken_stream[-1]["error"]
    for job_id, reason in VICTIMS.items():
        job = victims[job_id]
        assert job["state"] == "failed" and job["final"] is True, job
        assert reason in job["error"] and "\n" not in job["error"], job
        assert listed[job_id]["state"] == "failed"
    assert "notes.txt" not in listed and listed["good"]["state"] == "done"
    # The broken jobs are not settled: exit 75, and `status` says why, one line each.
    assert result_code == 75
    assert files.returncode == 75, files.stderr
    standing = {j["job_id"]: j for j in orjson.loads(files.stdout)["jobs"]}
    for job_id, reason in VICTIMS.items():
        if job_id == "norecord":
            continue  # moved aside and submitted again
        assert standing[job_id]["state"] == "failed"
        assert reason in standing[job_id]["error"]
        assert f"{job_id}: " in text.stdout
    assert "jobs whose job.json cannot be read" in text.stdout
    for output in (again.proc.stderr, [files.stderr.encode(), text.stderr.encode()]):
        assert b"Traceback" not in b"".join(output)
    events = [e["event"] for e in again.proc.events()]
    assert "state_dir_stray_file" in events


# ---- groups.jsonl ----------------------------------------------------------------------------


async def test_a_damaged_groups_line_is_rebuilt_from_the_rows_and_counts_cover_every_pass(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    state = tmp_path / "state"
    serve = await Serve.start(state, gated_agent.url, "--concurrency", "1")
    groups = job_dir(state, "g") / "groups.jsonl"
    await serve.submit(job_id="g", rows=rows(4))
    for _ in range(2):
        await wait_until(lambda: gated_agent.holding == 1)
        gated_agent.release_next()
    await wait_until(lambda: groups.exists() and groups.read_bytes().count(b"\n") == 2)
    assert await serve.stop(signal.SIGKILL) == -signal.SIGKILL
    second = groups.read_bytes().splitlines(keepends=True)[1]
    groups.write_bytes(b'{"task_index": 0, "ro\x00garbage\n' + second)
    gated_agent.open()

    again = await Serve.start(state, gated_agent.url)
    try:
        stream = await ended(again, "g", group=True)
        status = await again.job("g")
    finally:
        assert await again.stop() == 0
    assert stream[-1] == {"end": "done"}
    complete = row_lines(stream)
    assert [g["_ng_seq"] for g in complete] == [1, 2, 3, 4]
    assert sorted(g["task_index"] for g in complete) == [0, 1, 2, 3]
    assert [orjson.loads(line)["task_index"] for line in groups.read_bytes().splitlines()] == [
        g["task_index"] for g in complete
    ]
    assert status["state"] == "done"
    # Two rows came from the first daemon (read from the files), two from this one.
    assert status["outcomes"] == {"success": 4}


async def test_groups_streamed_before_a_kill_keep_their_numbers_and_come_once_after_it(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    """With ``--fsync batch``: the groups a stream showed before a kill -9 are the same
    groups at the same ``_ng_seq`` after the restart (read back and fsynced before they
    are shown), and the rest follow, each once."""
    state = tmp_path / "state"
    serve = await Serve.start(state, gated_agent.url, "--concurrency", "1", "--fsync", "batch")
    await serve.submit(job_id="g", rows=rows(4))
    for _ in range(2):
        await wait_until(lambda: gated_agent.holding == 1)
        gated_agent.release_next()

    async def two_shown() -> bool:
        return len(row_lines(await serve.results("g", group=True))) == 2

    await wait_until(two_shown)
    before = row_lines(await serve.results("g", group=True))
    assert await serve.stop(signal.SIGKILL) == -signal.SIGKILL
    gated_agent.open()

    again = await Serve.start(state, gated_agent.url, "--fsync", "batch")
    try:
        stream = await ended(again, "g", group=True)
        tail = await ended(again, "g", group=True, after=2)
    finally:
        assert await again.stop() == 0
    complete = row_lines(stream)
    assert complete[:2] == before
    assert [g["_ng_seq"] for g in complete] == [1, 2, 3, 4]
    assert sorted(g["task_index"] for g in complete) == [0, 1, 2, 3]
    assert row_lines(tail) == complete[2:]


# ---- counts across passes ---------------------------------------------------------------------


async def test_a_jobs_outcomes_count_every_pass_live_after_a_restart_and_in_status(
    tmp_path: Path,
) -> None:
    def first_attempts_fail(body: dict[str, Any]) -> web.StreamResponse:
        if body.get("_ng_attempt_index", 0) == 0:
            return web.json_response({"error": "flaky"}, status=500)
        return web.json_response({"reward": 1.0})

    agent = FakeAgent(first_attempts_fail)
    await agent.start()
    state = tmp_path / "state"
    try:
        serve = await Serve.start(state, agent.url)
        try:
            await serve.submit(job_id="flaky", rows=rows(4))
            assert (await ended(serve, "flaky"))[-1] == {"end": "done"}
            live = (await serve.job("flaky"))["outcomes"]
        finally:
            assert await serve.stop() == 0
        again = await Serve.start(state, agent.url)
        try:
            restarted = (await again.job("flaky"))["outcomes"]
        finally:
            assert await again.stop() == 0
        files = await run_cli("status", str(state), "--json")
    finally:
        await agent.close()
    failures = read_jsonl(job_dir(state, "flaky") / "rollouts_failures.jsonl")
    assert len(failures) == 4
    [failure_class] = {row["_ng_failure_class"] for row in failures}
    assert live == {"success": 4, failure_class: 4}
    assert restarted == live
    [standing] = orjson.loads(files.stdout)["jobs"]
    assert standing["outcomes"] == live


# ---- a full disk ------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of 8 MiB: a real file system that runs out of space (ENOSPC)."""
    if os.geteuid() != 0:
        pytest.skip("a full disk is made with a small tmpfs mount, which needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> Path:
    """Take every free block of ``disk``; the file to delete to give them back."""
    filler = disk / "filler"
    chunk = b"\0" * 65536
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, chunk)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


async def test_a_full_disk_fails_the_job_with_the_reason_and_a_restart_resumes_it_exactly(
    small_disk: Path, gated_agent: FakeAgent
) -> None:
    state = small_disk / "state"
    serve = await Serve.start(state, gated_agent.url, "--concurrency", "1")
    try:
        await serve.submit(job_id="j", rows=rows(3))
        await wait_until(lambda: gated_agent.holding == 1)
        filler = fill(small_disk)
        gated_agent.open()
        stream = await ended(serve, "j")
        status = await serve.job("j")
        health = await get(serve, "/healthz")
        submitted = await post(serve, "/v1/jobs", {"job_id": "k", "rows": rows(1)})
        if submitted[0] == 201:
            await wait_until(serve.in_state("k", "failed"))
        submitted_k = submitted[0], (await serve.job("k") if submitted[0] == 201 else None)
        policy = await post(serve, "/v1/policy", {"version": 1})
        policy_now = await get(serve, "/v1/policy")
        filler.unlink()
        healthy_again = await get(serve, "/healthz")
        policy_after = await post(serve, "/v1/policy", {"version": 1})
    finally:
        assert await serve.stop() == 75
    end = stream[-1]
    assert end["end"] == "failed" and "No space left on device" in end["error"]
    assert status["state"] == "failed" and status["final"] is True
    assert status["error"] == end["error"] and "\n" not in end["error"]
    assert health[0] == 503 and health[1]["status"] == "state_dir_unwritable"
    assert "No space left on device" in health[1]["error"]
    # A submit refused (its journal line could not be written), or accepted (the line
    # fitted in its segment's last block) and failed as its folder could not be.
    assert submitted_k[0] in (201, 507), submitted_k
    assert "No space left on device" in (
        one_line_error(submitted[1]) if submitted[0] == 507 else submitted_k[1]["error"]
    )
    assert policy[0] == 507 and "No space left on device" in one_line_error(policy[1])
    assert policy_now == (200, {"version": 0})
    assert healthy_again == (200, {"status": "ok"})
    assert policy_after == (200, {"version": 1})
    # Named in one line each, never a traceback.
    assert b"Traceback" not in b"".join(serve.proc.stderr)

    again = await Serve.start(state, gated_agent.url)
    try:
        rest = await ended(again, "j")
    finally:
        assert await again.stop() == 0
    assert rest[-1] == {"end": "done"}
    audit = audit_outputs(
        job_dir(state, "j") / "rollouts.jsonl", {(t, 0) for t in range(3)}, max_attempts=3
    )
    assert len(audit.successes) == 3


# ---- too many open files ----------------------------------------------------------------


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_a_job_that_hits_emfile_when_it_starts_waits_and_starts_once_fds_are_back(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    # EMFILE is the dispatcher's own fault (contracts §11): the job stays pending
    # and starts again, where it was failed until a restart.
    serve = await Serve.start(tmp_path / "state", gated_agent.url)
    pid = serve.proc.proc.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    try:
        await serve.job("warm")  # the session's connection is open before the limit falls
        # Room for a request's files one at a time, not for a job's files at once.
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (open_fds(pid) + 2, hard))
        await serve.submit(job_id="j", rows=rows(2))
        await wait_until(lambda: serve.proc.saw("job_start_deferred"), timeout_s=30)
        waiting = await serve.job("j")
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        gated_agent.open()
        stream = await ended(serve, "j")
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        assert await serve.stop() == 0
    assert waiting["state"] in ("queued", "running") and not waiting["final"], waiting
    deferred = [e for e in serve.proc.events() if e["event"] == "job_start_deferred"]
    assert "Too many open files" in deferred[0]["error"]
    assert stream[-1] == {"end": "done"}
    assert len([line for line in stream if "_ng_seq" in line]) == 2


def fds_on(pid: int, path: Path) -> int:
    """The process's open file descriptors on ``path``."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            count += fd.readlink() == path
    return count


async def hang_up(url: str, job_id: str, after: int) -> None:
    """A results reader that goes away as soon as its request is sent."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    writer.write(
        f"GET /v1/jobs/{job_id}/results?after={after}&wait=true HTTP/1.1\r\n"
        f"Host: {parts.netloc}\r\n\r\n".encode()
    )
    if after % 2:
        await reader.readline()  # some go once the answer has started
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def test_readers_that_go_away_leave_no_descriptor_on_the_rows(tmp_path: Path) -> None:
    # Rows of an earlier daemon big enough to be read in a thread: a reader gone
    # while its read waited there left the file open (552 after 2,500 readers).
    agent = FakeAgent(lambda body: web.json_response({"reward": 1.0, "pad": "p" * 20_000}))
    await agent.start()
    state = tmp_path / "state"
    try:
        first = await Serve.start(state, agent.url)
        await first.submit(job_id="j", rows=rows(40))
        assert (await ended(first, "j"))[-1] == {"end": "done"}
        assert await first.stop() == 0
        serve = await Serve.start(state, agent.url, "--max-streams", "1024")
        pid = serve.proc.proc.pid
        try:
            for _ in range(5):
                await asyncio.gather(*(hang_up(serve.url, "j", n % 40) for n in range(100)))
            await wait_until(serve.streams_open(0), timeout_s=30)
            leaked = fds_on(pid, job_dir(state, "j").resolve() / "rollouts.jsonl")
        finally:
            assert await serve.stop() == 0
    finally:
        await agent.close()
    assert leaked == 0
