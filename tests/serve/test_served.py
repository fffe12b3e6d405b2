"""A served job's own figures (contracts §12): its ETA and its manifest's rate come
from its own start and completions, not the daemon's. The daemon runs in this
process on 127.0.0.1 (the jobs API over HTTP) with a clock the test moves."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from dispatcher.admission.history import TaskHistory, task_digest
from dispatcher.run import daemon as daemon_module
from dispatcher.serve import command as serve_module
from dispatcher.settings.serve import ServeLimits
from tests.helpers import FakeAgent, echo_result, serve_arguments, set_after, wait_until

pytestmark = pytest.mark.timeout(60)


class Clock:
    """``time`` for the daemon's module: its monotonic seconds are the test's to move."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class InProcessServe:
    """``dispatcher serve``'s own ``serve`` on the test's loop, and its daemon."""

    def __init__(self, task: asyncio.Task[Any], daemon: daemon_module.Daemon) -> None:
        self.task = task
        self.daemon = daemon
        assert daemon.metrics_endpoint is not None
        self.url = daemon.metrics_endpoint.url.removesuffix("/metrics")

    async def stop(self) -> int:
        self.daemon._handle_signal(signal.SIGTERM)
        return int(await asyncio.wait_for(self.task, 30))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(daemon_module, "time", fake)
    return fake


async def start_serve(
    tmp_path: Path, agent_url: str, monkeypatch: pytest.MonkeyPatch, **settings: Any
) -> InProcessServe:
    """The daemon of ``tmp_path/state`` in this process; ``settings`` over the defaults."""
    made: list[daemon_module.Daemon] = []

    class Recorded(daemon_module.Daemon):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(serve_module, "Daemon", Recorded)
    defaults, state_dir, access = serve_arguments(tmp_path, agent_url)
    settings = defaults.model_copy(update=settings)
    task = asyncio.create_task(
        serve_module.serve(settings, state_dir, None, None, access, ServeLimits())
    )
    await wait_until(lambda: bool(made and made[0].metrics_endpoint) or task.done())
    return InProcessServe(task, made[0])


async def test_a_job_submitted_an_hour_in_has_the_eta_and_rate_of_its_own_pace(
    tmp_path: Path, clock: Clock, gated_agent: FakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve = await start_serve(tmp_path, gated_agent.url, monkeypatch)
    async with aiohttp.ClientSession() as http:

        async def status() -> dict[str, Any]:
            async with http.get(f"{serve.url}/v1/jobs/j") as r:
                body: dict[str, Any] = await r.json()
                return body

        async def resumed() -> bool:  # until then, the API answers 503 "starting"
            async with http.get(f"{serve.url}/v1/jobs") as r:
                return r.status == 200

        await wait_until(resumed)
        clock.now += 3600.0  # the daemon has served for an hour
        rows = [{"agent_ref": {"name": "sim"}, "q": i} for i in range(4)]
        body = {"job_id": "j", "rows": rows}
        async with http.post(f"{serve.url}/v1/jobs", json=body) as r:
            assert r.status == 201, await r.text()
        await wait_until(lambda: gated_agent.holding == 4)
        gated_agent.release_next()
        gated_agent.release_next()
        await wait_until(lambda: _done(status, 2))
        clock.now += 10.0  # two rollouts in the job's first 10 s: two more take 10 s
        assert (await status())["eta_s"] == pytest.approx(10.0)
        gated_agent.open()
        await wait_until(lambda: _done(status, 4))
    assert await serve.stop() == 0
    manifest = orjson.loads((tmp_path / "state/jobs/j/rollouts_manifest.json").read_bytes())
    summary = manifest["last_run"]["summary"]
    assert summary["dispatch_s"] == pytest.approx(10.0)
    assert summary["rollouts_per_hour"] == pytest.approx(4 * 360.0)


async def _done(status: Any, count: int) -> bool:
    return bool((await status())["rows_durable"] == count)


async def test_the_task_history_orders_a_job_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """contracts §13, start order: the daemon's task history outlives it; a later job
    starts its unseen task first, then the longest expected first."""
    release: dict[int, asyncio.Event] = {}

    async def held(body: dict[str, Any]) -> Any:
        await release.setdefault(body["q"], asyncio.Event()).wait()
        return echo_result(body)

    agent = FakeAgent(held)
    await agent.start()
    rows = [{"agent_ref": {"name": "sim"}, "q": i} for i in range(4)]
    try:
        serve = await start_serve(tmp_path, agent.url, monkeypatch, concurrency=3)
        async with aiohttp.ClientSession() as http:
            await _submit(http, serve.url, "first", rows[:3])
            await wait_until(lambda: agent.seen == 3)
            # The later a task is answered, the longer it ran.
            for done, q in enumerate([2, 0, 1], start=1):
                release.setdefault(q, asyncio.Event()).set()
                await wait_until(lambda n=done: _durable(http, serve.url, "first", n))
            status = await _status(http, serve.url, "first")
            assert status["start_order"]["started_unseen"] == 3
        assert await serve.stop() == 0
        # Released 2, 0, 1, so 1 ran longest, unless the starts, on a loaded machine,
        # spread further apart than the releases: the order expected is the history's.
        history = TaskHistory.load(tmp_path / "state" / "task_history.jsonl")
        estimates = {q: history.estimate(task_digest(rows[q])) for q in range(3)}
        assert None not in estimates.values()
        longest_first = sorted(estimates, key=lambda q: -(estimates[q] or 0.0))
        agent.bodies.clear()
        serve = await start_serve(tmp_path, agent.url, monkeypatch, concurrency=1)
        async with aiohttp.ClientSession() as http:
            await _submit(http, serve.url, "second", rows)
            release[3] = asyncio.Event()
            release[3].set()
            await wait_until(lambda: _durable(http, serve.url, "second", 4))
        assert await serve.stop() == 0
    finally:
        await agent.close()
    assert [body["q"] for body in agent.bodies] == [3, *longest_first]


async def _submit(http: aiohttp.ClientSession, url: str, job_id: str, rows: list[Any]) -> None:
    async def resumed() -> bool:  # until then, the API answers 503 "starting"
        async with http.get(f"{url}/v1/jobs") as r:
            return r.status == 200

    await wait_until(resumed)
    async with http.post(f"{url}/v1/jobs", json={"job_id": job_id, "rows": rows}) as r:
        assert r.status == 201, await r.text()


async def _status(http: aiohttp.ClientSession, url: str, job_id: str) -> dict[str, Any]:
    async with http.get(f"{url}/v1/jobs/{job_id}") as r:
        body: dict[str, Any] = await r.json()
        return body


async def _durable(http: aiohttp.ClientSession, url: str, job_id: str, count: int) -> bool:
    return bool((await _status(http, url, job_id))["rows_durable"] >= count)


async def test_max_in_flight_refills_the_jobs_window_as_each_rollout_leaves_its_agent(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    """A window of resident tasks is one job: at most ``max_in_flight`` at agents, the
    next started as one answers (it was a job per freed slot, and the field a 400)."""
    from tests.serve.test_service_e2e import Serve, rows

    serve = await Serve.start(tmp_path / "state", gated_agent.url, "--concurrency", "64")
    try:
        await serve.submit(job_id="w", rows=rows(6), max_in_flight=2)
        for left in range(6, 0, -1):
            await wait_until(lambda: gated_agent.holding == min(2, left))  # noqa: B023
            gated_agent.release_next()
        stream = await serve.results("w", wait=True)
        assert stream[-1] == {"end": "done"} and len(stream) == 7
        assert gated_agent.max_in_flight == 2 and gated_agent.seen == 6
        refused = await serve.submit(400, job_id="x", rows=rows(1), max_in_flight=0)
        assert refused["error"].startswith("max_in_flight:"), refused
    finally:
        await serve.stop()


@contextlib.asynccontextmanager
async def serving_batch(tmp_path: Path, agent: FakeAgent) -> AsyncIterator[tuple[Any, Any]]:
    """``serve`` in this process with ``--fsync batch`` on ``agent``: its service and a
    client of its API."""
    from tests.serve.test_archive import Client

    settings, state, access = serve_arguments(tmp_path, agent.url)
    settings = settings.model_copy(update={"fsync": "batch"})
    async with (
        serve_module.serving(settings, state, None, None, access, ServeLimits()) as service,
        aiohttp.ClientSession() as http,
    ):
        yield service, Client(service, http)


async def test_a_served_jobs_first_rollout_is_sent_before_its_files_are_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's materialized rows and manifest are made durable beside its first
    rollout, and before its first row (they were fsynced before it was sent)."""
    import os

    synced: list[str] = []
    held, release = threading.Event(), threading.Event()
    real = os.fsync

    def fsync(fd: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if name.endswith("_manifest.json") and not held.is_set():
            held.set()
            release.wait(60)
        synced.append(name)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    agent = FakeAgent(gated=True)
    await agent.start()
    try:
        async with serving_batch(tmp_path, agent) as (service, api):
            assert await api.submit("first", count=1) == 201
            # Sent while the manifest's fsync is held.
            await wait_until(lambda: agent.holding == 1 and held.is_set())
            agent.open()
            release.set()
            await api.results("first", wait="true")
            assert (await api.status("first"))["rows_durable"] == 1
            service.daemon.stop_requested.set()
    finally:
        release.set()
        await agent.close()
    manifest = next(i for i, n in enumerate(synced) if n.endswith("rollouts_manifest.json"))
    rows = next(i for i, n in enumerate(synced) if n.endswith("/first/rollouts.jsonl"))
    assert manifest < rows


async def test_a_job_cancelled_before_it_starts_ends_cancelled_with_nothing_sent(
    tmp_path: Path, agent: FakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's hop is made as it starts (its folder written), not as it is accepted: a
    burst's answers wait for no hop. Until then its status is its first hop's before it
    opens, and a cancel ends it cancelled, nothing of it at an agent."""

    from dispatcher.serve.registry import JobRecord, Registry
    from dispatcher.serve.served import ServedJob
    from tests.serve.test_archive import daemon

    held, release = threading.Event(), threading.Event()
    real = Registry.write_job

    def held_write(self: Registry, record: JobRecord, rows: Any, *, durable: bool) -> None:
        if record.job_id == "x":
            held.set()
            release.wait(60)
        real(self, record, rows, durable=durable)

    monkeypatch.setattr(Registry, "write_job", held_write)
    async with daemon(tmp_path, agent, window=1000) as api:
        try:
            assert await api.submit("x") == 201
            await wait_until(held.is_set)
            served = api.service.jobs["x"]
            assert isinstance(served, ServedJob)
            assert served.job is None
            status = await api.status("x")
            assert status["state"] == "queued" and not status["final"]
            assert (status["expected"], status["done"], status["remaining"]) == (None, 0, 0)
            assert (status["eta_s"], status["outcomes"]) == (0.0, {})
            async with api.http.delete(f"{api.url}/x") as r:
                assert r.status == 200
        finally:
            release.set()
        end = orjson.loads((await api.results("x", wait="true")).splitlines()[-1])
        assert end["end"] == "cancelled"
        assert agent.seen == 0


async def test_the_threads_a_burst_of_submits_uses_run_before_the_daemon_listens(
    tmp_path: Path,
) -> None:
    """The journal's, the folders', the bodies', the index's and the loop's default
    executor's threads all run once ``serving`` yields: the first burst after a start
    waited for each thread it started (aio.start_threads)."""
    from concurrent.futures import ThreadPoolExecutor

    from dispatcher.aio import DEFAULT_EXECUTOR_THREADS

    def threads(executor: ThreadPoolExecutor) -> int:
        return len(executor._threads)

    loop = asyncio.get_running_loop()
    default = ThreadPoolExecutor(DEFAULT_EXECUTOR_THREADS)
    loop.set_default_executor(default)  # this test's own, not one earlier tests used
    agent = FakeAgent()
    await agent.start()
    try:
        settings, state, access = serve_arguments(tmp_path, agent.url)
        async with serve_module.serving(settings, state, None, None, access, ServeLimits()) as s:
            journal = s.journal
            assert [threads(journal._thread), threads(journal._folders)] == [1, 1]
            assert [threads(s._bodies_thread), threads(s._index_thread)] == [1, 1]
            assert threads(default) == DEFAULT_EXECUTOR_THREADS
            s.daemon.stop_requested.set()
    finally:
        await agent.close()


async def test_a_served_job_fsyncs_each_of_its_files_once_its_manifest_twice_its_folder_thrice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a served job makes durable, by file, beyond its journal line and the commits
    of its rows and its groups' lines. None of them is covered by another: at its start
    (beside its first rollouts, before its first row) the materialized rows, the
    manifest and the folder (the names of both and of the rows files: a durable row
    needs them, and its run's identity), and one reservation line and its file's name
    (before a rollout is sent; the folder's fsync at the start may come after it); at
    its end the files its hop wrote without fsync (manifest again, with ``last_run``;
    status; coverage), its rows file (its journal line goes after) and its final
    record (temporary file, then the folder: the renames of all four)."""
    import os
    from collections import Counter

    synced: Counter[str] = Counter()
    real = os.fsync
    lock = threading.Lock()
    folder = str(tmp_path / "state" / "jobs" / "j")

    def fsync(fd: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if name == folder or name.startswith(folder + "/"):
            # A temporary file of an atomic write, by the file it replaces.
            base = os.path.basename(name)
            if base.startswith("."):
                base = base[1:].rsplit(".", 2)[0]
            with lock:
                synced[base] += 1
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    agent = FakeAgent(respond=echo_result)
    await agent.start()
    try:
        async with serving_batch(tmp_path, agent) as (service, api):
            assert await api.submit("j", count=2) == 201
            await api.results("j", wait="true")
            assert (await api.status("j"))["state"] == "done"
            service.daemon.stop_requested.set()
    finally:
        await agent.close()
    # Its rows' group commits: one at least, each a batch of new rows; its groups' lines,
    # each streamed once an fsync covers it: one at most at a time, the lines written
    # while it runs covered by the next (its two groups: one fsync or two).
    assert synced.pop("rollouts.jsonl") >= 1
    assert 1 <= synced.pop("groups.jsonl") <= 2
    assert synced == {
        "rollouts_materialized_inputs.jsonl": 1,
        "rollouts_attempt_reservations.jsonl": 1,
        "rollouts_manifest.json": 2,
        "j": 3,
        "rollouts_status.json": 1,
        "rollouts_coverage.json": 1,
        "input.jsonl": 1,
        "job.json": 1,
    }, synced


def groups_fsync(monkeypatch: pytest.MonkeyPatch, job_id: str, then: Callable[[], None]) -> None:
    """``os.fsync`` of the job's ``groups.jsonl`` calls ``then`` first (to hold or fail it)."""
    import os

    real = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(f"/{job_id}/groups.jsonl"):
            then()
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def hops_closed(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once a hop's ``Job.close`` returned (its files closed)."""
    from dispatcher.run.job import Job

    return set_after(monkeypatch, Job, "close", threading.Event())


async def test_a_served_jobs_group_is_streamed_only_once_its_line_is_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``--fsync batch`` a complete group's line is written at once but streamed (its
    ``_ng_seq`` handed out) and counted only once an fsync of ``groups.jsonl`` covers it:
    a power cut cannot give its number to another group."""

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(60)

    groups_fsync(monkeypatch, "g", hold)
    agent = FakeAgent(respond=echo_result)
    await agent.start()
    try:
        async with serving_batch(tmp_path, agent) as (service, api):
            assert await api.submit("g", count=1) == 201
            await wait_until(held.is_set)
            path = tmp_path / "state" / "jobs" / "g" / "groups.jsonl"
            assert path.read_bytes().count(b"\n") == 1
            assert await api.results("g", group="true") == b""
            assert (await api.status("g"))["groups_complete"] == 0
            release.set()
            stream = (await api.results("g", group="true", wait="true")).splitlines()
            assert [orjson.loads(line).get("_ng_seq") for line in stream] == [1, None]
            service.daemon.stop_requested.set()
    finally:
        release.set()
        await agent.close()


def fail_eio() -> None:
    import errno
    import os

    raise OSError(errno.EIO, os.strerror(errno.EIO))


async def one_group_to_its_end(tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A job "g" of one group served (``--fsync batch``) to its end: its status and the
    end line of its stream."""
    agent = FakeAgent(respond=echo_result)
    await agent.start()
    try:
        async with serving_batch(tmp_path, agent) as (service, api):
            assert await api.submit("g", count=1) == 201
            end = orjson.loads((await api.results("g", wait="true")).splitlines()[-1])
            status = await api.status("g")
            service.daemon.stop_requested.set()
    finally:
        await agent.close()
    return status, end


async def test_a_served_job_whose_groups_fsync_fails_ends_failed_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    groups_fsync(monkeypatch, "g", fail_eio)
    status, end = await one_group_to_its_end(tmp_path)
    path = tmp_path / "state" / "jobs" / "g" / "groups.jsonl"
    assert status["state"] == "failed" and end["end"] == "failed"
    assert status["error"] == end["error"] == f"{path}: fsync failed: Input/output error"
    assert path.read_bytes() == b""


async def test_a_job_whose_last_group_reaches_its_target_ends_satisfied_however_late_its_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The groups' fsyncs are held until the hop's files are closed: the hop's end waits
    for its last groups to be told, so the job ends satisfied, as ``job.json`` says."""

    from tests.serve.test_archive import JSON
    from tests.serve.test_service_e2e import rows

    closed = hops_closed(monkeypatch)
    groups_fsync(monkeypatch, "s", lambda: closed.wait(60) and None)
    agent = FakeAgent(respond=echo_result)
    await agent.start()
    try:
        async with serving_batch(tmp_path, agent) as (service, api):
            body = orjson.dumps({"job_id": "s", "rows": rows(2), "target_groups": 2})
            async with api.http.post(api.url, data=body, headers=JSON) as r:
                assert r.status == 201, await r.text()
            stream = (await api.results("s", group="true", wait="true")).splitlines()
            await api.results("s", wait="true")  # to the job's end
            status = await api.status("s")
            service.daemon.stop_requested.set()
    finally:
        closed.set()
        await agent.close()
    assert orjson.loads(stream[-1]) == {"end": "satisfied"}
    assert status["state"] == "satisfied" and status["satisfied_seq"] == 2
    record = orjson.loads((tmp_path / "state" / "jobs" / "s" / "job.json").read_bytes())
    assert record["state"] == "satisfied" and record["step"]["satisfied_seq"] == 2


async def test_a_job_whose_last_groups_fsync_fails_after_its_hop_closed_ends_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group fsync the hop's end waits for fails once the hop's files are closed:
    the job ends failed, naming the file, not done with an error beside it."""
    closed = hops_closed(monkeypatch)

    def fail_once_closed() -> None:
        closed.wait(60)
        fail_eio()

    groups_fsync(monkeypatch, "g", fail_once_closed)
    try:
        status, end = await one_group_to_its_end(tmp_path)
    finally:
        closed.set()
    path = tmp_path / "state" / "jobs" / "g" / "groups.jsonl"
    assert status["state"] == "failed" and end["end"] == "failed"
    assert status["error"] == f"{path}: fsync failed: Input/output error"
