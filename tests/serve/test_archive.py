"""Settled jobs folded into archives (contracts §12): ``jobs/`` bounded by
``--retain-settled-jobs``, archived jobs answering their status and results
exactly as before, a restart holding none of them, and a fold cut at any step
losing and repeating nothing.

The service runs in this process with its API on a real socket and an agent on
127.0.0.1 that answers at once; a fold is cut by raising at one of its steps
(``Archive.commit``'s hook), which leaves the disk as a kill there would: the
fold cleans nothing up, the next start does.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from dispatcher.errors import ConfigError
from dispatcher.lifecycle import JobState
from dispatcher.serve.archive import STEPS, Archive, Folded
from dispatcher.serve.command import serving
from dispatcher.serve.final import FinalJob
from dispatcher.serve.jobs import Service
from dispatcher.serve.registry import JobRecord, Registry
from dispatcher.settings.serve import ServeLimits
from tests.helpers import FakeAgent, echo_result, serve_arguments, wait_until
from tests.serve.test_service_e2e import rows

pytestmark = pytest.mark.timeout(120)

JSON = {"Content-Type": "application/json"}


@contextlib.asynccontextmanager
async def daemon(tmp_path: Path, agent: FakeAgent, window: int) -> AsyncIterator[Client]:
    """``dispatcher serve --retain-settled-jobs window`` on ``tmp_path/state`` in this
    process, and a client of it, until the block ends."""
    settings, state, access = serve_arguments(tmp_path, agent.url)
    limits = ServeLimits(retain_settled_jobs=window)
    async with serving(settings, state, None, None, access, limits) as service:
        async with aiohttp.ClientSession() as http:
            yield Client(service, http)
        service.daemon.stop_requested.set()


class Client:
    def __init__(self, service: Service, http: aiohttp.ClientSession) -> None:
        self.service = service
        self.http = http
        endpoint = service.daemon.metrics_endpoint
        assert endpoint is not None
        self.url = endpoint.url.removesuffix("/metrics") + "/v1/jobs"

    async def submit(self, job_id: str, count: int = 3) -> int:
        body = orjson.dumps({"job_id": job_id, "rows": rows(count)})
        async with self.http.post(self.url, data=body, headers=JSON) as r:
            return r.status

    async def status(self, job_id: str) -> dict[str, Any]:
        async with self.http.get(f"{self.url}/{job_id}") as r:
            assert r.status == 200, await r.text()
            data: dict[str, Any] = await r.json()
            return data

    async def results(self, job_id: str, **params: str) -> bytes:
        async with self.http.get(f"{self.url}/{job_id}/results", params=params) as r:
            assert r.status == 200, await r.text()
            return await r.read()

    async def listed(self) -> set[str]:
        async with self.http.get(self.url) as r:
            return {job["job_id"] for job in (await r.json())["jobs"]}

    async def run(self, job_ids: list[str]) -> dict[str, bytes]:
        """Each job submitted and read to its end: its whole stream, by id."""
        streams = {}
        for job_id in job_ids:
            assert await self.submit(job_id) == 201
            streams[job_id] = await self.results(job_id, wait="true")
        return streams


def entries(state: Path) -> tuple[list[str], list[str]]:
    return (
        sorted(p.name for p in (state / "jobs").iterdir()),
        sorted(p.name for p in (state / "archive").iterdir()),
    )


async def test_every_n_settled_jobs_fold_into_one_archive_and_still_answer(
    tmp_path: Path, agent: FakeAgent
) -> None:
    ids = [f"j{n}" for n in range(7)]
    async with daemon(tmp_path, agent, window=3) as api:
        streams = await api.run(ids)
        await wait_until(lambda: api.service.compaction.archived == 6)  # type: ignore[union-attr]
        folders, archives = entries(tmp_path / "state")
        # jobs/ holds the one settled job of the next window; an archive per window.
        assert folders == ["j6"]
        assert archives == ["000001.tar", "000002.tar", "index.sqlite"]
        assert await api.listed() == {"j6"}
        for job_id in ids:
            # The stream as it was before the fold, byte for byte.
            assert await api.results(job_id, wait="true") == streams[job_id]
            status = await api.status(job_id)
            assert (status["state"], status["rows_durable"], status["final"]) == ("done", 3, True)
        # after= resumes exactly; group=true walks the archived groups.
        tail = (await api.results("j0", after="1")).splitlines()
        assert [orjson.loads(line)["_ng_seq"] for line in tail] == [2, 3]
        grouped = (await api.results("j0", group="true")).splitlines()
        groups = [orjson.loads(line) for line in grouped]
        assert [len(group["rows"]) for group in groups] == [1, 1, 1]
        # The same body again is the same job; another body a conflict.
        assert await api.submit("j0") == 200
        assert await api.submit("j0", count=4) == 409
        assert await api.submit("j7") == 201
    # A restart holds none of the archived jobs and they still answer.
    async with daemon(tmp_path, agent, window=3) as api:
        held = {job_id for job_id, job in api.service.jobs.items() if isinstance(job, FinalJob)}
        assert held <= {"j6", "j7"}
        assert await api.results("j1", wait="true") == streams["j1"]
        assert (await api.status("j1"))["state"] == "done"
        async with api.http.get(f"{api.url}/nope") as r:
            assert r.status == 404


async def test_a_fold_a_stream_held_back_runs_when_that_stream_ends(
    tmp_path: Path, agent: FakeAgent
) -> None:
    # The window filled while a stream read one of its jobs: the fold waited for the
    # next job to settle, and a daemon that ran its last job kept the window for good.
    async with daemon(tmp_path, agent, window=3) as api:
        compaction = api.service.compaction
        assert compaction is not None
        await api.run(["j0", "j1"])
        job = api.service.jobs["j0"]
        assert isinstance(job, FinalJob)
        source = await job.source()  # a stream reading j0's folder
        await api.run(["j2"])
        await wait_until(lambda: compaction._task is not None and compaction._task.done())
        assert compaction.archived == 0
        del source  # the stream ends; no job settles after it
        await wait_until(lambda: compaction.archived == 3)
        assert entries(tmp_path / "state")[0] == []


async def settled_state(tmp_path: Path, agent: FakeAgent, count: int) -> dict[str, bytes]:
    """``count`` settled jobs in ``tmp_path/state``, none folded: their streams."""
    async with daemon(tmp_path, agent, window=1000) as api:
        return await api.run([f"j{n}" for n in range(count)])


class Cut(Exception):
    """A fold stopped here, as by a kill."""


def cut_fold(state: Path, count: int, at: str | None) -> None:
    """Fold the first ``count`` jobs, stopping after step ``at`` (None: after the first
    folder of step 3 is removed)."""
    archive = Archive(Registry(state))
    jobs = settled_folds(state, count)

    def stop(step: str) -> None:
        if step == at:
            raise Cut(step)

    try:
        archive.commit(jobs, stop)
        archive.remove(jobs[:1])
    except Cut:
        pass
    archive.close()


@pytest.mark.parametrize("at", [*STEPS, None])
async def test_a_fold_cut_at_any_step_loses_and_repeats_nothing(
    tmp_path: Path, agent: FakeAgent, at: str | None
) -> None:
    streams = await settled_state(tmp_path, agent, 4)
    cut_fold(tmp_path / "state", 3, at)
    async with daemon(tmp_path, agent, window=1000) as api:
        folders, archives = entries(tmp_path / "state")
        if at == STEPS[0]:
            # Not committed: the tar is gone, every folder is whole.
            assert (folders, archives) == (["j0", "j1", "j2", "j3"], ["index.sqlite"])
        else:
            # Committed: the folders the kill left are gone, one copy of each job.
            assert (folders, archives) == (["j3"], ["000001.tar", "index.sqlite"])
        for job_id, stream in streams.items():
            assert await api.results(job_id, wait="true") == stream
            assert (await api.status(job_id))["rows_durable"] == 3
    # The next fold takes up where it is.
    async with daemon(tmp_path, agent, window=2) as api:
        streams.update(await api.run(["j4", "j5"]))
        # j3 and j4 at least, with j0..j2 when the cut fold had not committed them.
        await wait_until(lambda: not (tmp_path / "state/jobs/j4").exists())
        for job_id, stream in streams.items():
            assert await api.results(job_id, wait="true") == stream


def settled_folds(state: Path, count: int) -> list[Folded]:
    """The first ``count`` settled jobs of a state directory, as a fold takes them."""
    registry = Registry(state)
    jobs = []
    for n in range(count):
        record = registry.read(registry.job_dir(f"j{n}"))
        assert isinstance(record, JobRecord) and record.state is not None
        jobs.append(Folded(record.job_id, record.submitted_seq, record.digest, record.state,
                           None, None))  # fmt: skip
    return jobs


async def test_a_fold_leaves_nothing_for_the_cyclic_collector(
    tmp_path: Path, agent: FakeAgent
) -> None:
    # The daemon walks its old generation about once every two billion allocations
    # (aio.tune_gc): what a fold leaves in a reference cycle stays for the daemon's life.
    # A tar writer's members pointed back at it: every fold kept each file's TarInfo
    # (~11 per job, ~7 KB of resident memory per archived job).
    await settled_state(tmp_path, agent, 4)
    jobs = settled_folds(tmp_path / "state", 4)
    archive = Archive(Registry(tmp_path / "state"))
    gc.collect()
    gc.disable()
    try:
        archive.commit(jobs)
        archive.remove(jobs)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        kept = sorted({type(o).__name__ for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        archive.close()
    assert kept == []


# Events of the audit hook that are system calls a removal makes (``open``: os.open).
_REMOVAL_CALLS = frozenset({"os.remove", "os.rmdir", "os.scandir", "os.listdir", "open"})
# The threads whose calls are counted now, and their counts.
_counted: dict[int, Counter[str]] = {}


def _count_call(event: str, _: tuple[Any, ...]) -> None:
    if _counted and event in _REMOVAL_CALLS and (calls := _counted.get(threading.get_ident())):
        calls[event] += 1


_audit_hook_added = False


def removal_calls(remove: Callable[[], None]) -> Counter[str]:
    """The system calls (as audit events) this thread makes while ``remove`` runs."""
    global _audit_hook_added
    if not _audit_hook_added:
        sys.addaudithook(_count_call)  # for the process's life: counts only when asked
        _audit_hook_added = True
    calls: Counter[str] = Counter({"": 0})
    _counted[threading.get_ident()] = calls
    try:
        remove()
    finally:
        del _counted[threading.get_ident()]
    del calls[""]
    return calls


def job_folders(state: Path, count: int) -> list[Folded]:
    """``count`` settled jobs' folders of ten files and a subfolder, as a fold takes them."""
    jobs = []
    for n in range(count):
        folder = state / "jobs" / f"j{n}"
        (folder / "sub").mkdir(parents=True)
        for name in [*(f"f{k}" for k in range(9)), "sub/g"]:
            (folder / name).write_bytes(b"x")
        jobs.append(Folded(f"j{n}", n + 1, "d" * 64, JobState.DONE, None, None))
    return jobs


def test_a_folds_folders_go_in_a_few_system_calls_not_a_few_a_file(tmp_path: Path) -> None:
    # Each system call of the fold's thread gives the interpreter's lock to the loop and
    # waits to take it back. shutil.rmtree's few a file (~17,000 files a fold of 1,000
    # jobs) made the folds of bench/many_jobs.py fall behind the jobs settling: the
    # jobs waiting for a fold, and the daemon's resident memory, grew without bound.
    jobs = job_folders(tmp_path / "state", 20)
    archive = Archive(Registry(tmp_path / "state"))
    try:
        calls = removal_calls(lambda: archive.remove(jobs))
    finally:
        archive.close()
    assert sorted((tmp_path / "state/jobs").iterdir()) == []
    # A few opens (``rm``'s /dev/null, the fsync of jobs/): not 20 x 12 and more.
    assert sum(calls.values()) <= 5, calls


def test_a_folds_folders_go_without_rm_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = job_folders(tmp_path / "state", 3)
    archive = Archive(Registry(tmp_path / "state"))
    monkeypatch.setenv("PATH", str(tmp_path / "no-programs"))
    try:
        archive.remove(jobs)
    finally:
        archive.close()
    assert sorted((tmp_path / "state/jobs").iterdir()) == []


def test_the_index_holds_a_bounded_page_cache(tmp_path: Path) -> None:
    # sqlite's default (2 MB) filled with the index over the first ~5,000 jobs: the
    # daemon's resident memory grew with the jobs it archived.
    (tmp_path / "state/jobs").mkdir(parents=True)
    archive = Archive(Registry(tmp_path / "state"))
    try:
        ((kib,),) = archive._query("PRAGMA cache_size")
    finally:
        archive.close()
    assert -kib <= 256


async def test_an_archive_index_that_cannot_be_read_stops_the_daemon_naming_it(
    tmp_path: Path, agent: FakeAgent
) -> None:
    (tmp_path / "state/archive").mkdir(parents=True)
    (tmp_path / "state/archive/index.sqlite").write_bytes(b"not a database" * 100)
    with pytest.raises(ConfigError, match=r"index\.sqlite: not an archive index"):
        async with daemon(tmp_path, agent, window=3):
            pass


def fails_task_0(body: dict[str, Any]) -> web.StreamResponse:
    """Task 0's every attempt fails (HTTP 500); the others succeed."""
    if body.get("_ng_task_index") == 0:
        return web.json_response({"detail": "boom"}, status=500)
    return echo_result(body)


async def test_an_archived_jobs_failure_lines_are_the_ones_it_streamed_before_the_fold(
    tmp_path: Path,
) -> None:
    agent = FakeAgent(fails_task_0)
    await agent.start()
    try:
        async with daemon(tmp_path, agent, window=2) as api:
            before = {}
            for job_id in ("f0", "f1"):
                assert await api.submit(job_id) == 201
                await api.results(job_id, wait="true")
                before[job_id] = await api.results(job_id, failures="true")
            await wait_until(lambda: api.service.compaction.archived == 2)  # type: ignore[union-attr]
            for job_id, stream in before.items():
                assert await api.results(job_id, failures="true") == stream
                lines = [orjson.loads(line) for line in stream.splitlines()]
                # Only the rollout's final failure is a failure line, under the job's cap.
                assert [
                    line["failure"]["_ng_task_index"] for line in lines if "failure" in line
                ] == [0]
    finally:
        await agent.close()
