"""The submissions' group commit (contracts §12): submits waiting at once share one
fsync of the journal and are answered only once durable; a kill at any instant
leaves each job whole or absent, and every job answered 2xx whole.

The service runs in this process (as in ``test_archive.py``) where a commit is
held or cut at its step; the real CLI is killed with SIGKILL in the middle of
many concurrent submits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from dispatcher.files import atomic
from dispatcher.serve import journal as journal_module
from dispatcher.serve.journal import APPENDED, JOURNAL_DIR, Journal
from dispatcher.serve.registry import JobRecord, Registry, now_iso
from dispatcher.serve.spec import STORED, JobSpec
from tests.helpers import FakeAgent, wait_until
from tests.serve.test_archive import daemon
from tests.serve.test_service_e2e import Serve, api_session, rows

pytestmark = pytest.mark.timeout(180)

JSON = {"Content-Type": "application/json"}


def body(job_id: str, count: int = 2) -> bytes:
    return orjson.dumps({"job_id": job_id, "rows": rows(count)})


def fsyncs_by_thread(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count every fsync of this process by the name of the thread that made it."""
    counts: dict[str, int] = {}
    real = os.fsync

    def counted(fd: Any) -> None:
        name = threading.current_thread().name.rsplit("_", 1)[0]
        counts[name] = counts.get(name, 0) + 1
        real(fd)

    monkeypatch.setattr(os, "fsync", counted)
    return counts


async def test_submits_waiting_at_once_share_one_fsync_and_answer_once_durable(
    tmp_path: Path, agent: FakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    fsyncs = fsyncs_by_thread(monkeypatch)
    held, release = threading.Event(), threading.Event()

    def hold_first(step: str) -> None:
        if not held.is_set():
            held.set()
            release.wait(60)

    async with daemon(tmp_path, agent, window=1000) as api:
        api.service.journal.step = hold_first
        first = asyncio.create_task(api.submit("first"))
        await wait_until(held.is_set)
        # The first job's line is durable, its answer held: 20 more come meanwhile.
        others = [asyncio.create_task(api.submit(f"j{n}")) for n in range(20)]
        await wait_until(lambda: len(api.service.journal._waiting) == 20)
        assert not first.done() and not any(task.done() for task in others)
        release.set()
        assert await first == 201
        assert await asyncio.gather(*others) == [201] * 20
        journal = api.service.journal
        assert (journal.batches, journal.largest_batch) == (2, 20)
        # Every job was durable when answered: its line is in the journal.
        lines = b"".join(p.read_bytes() for p in (tmp_path / "state" / JOURNAL_DIR).iterdir())
        assert len(lines.splitlines()) == 21
        for n in range(20):
            assert (await api.status(f"j{n}"))["job_id"] == f"j{n}"
    # 21 submits, two commits: the journal's fsync each, its folder's and the state
    # directory's once (the folder is new); jobs/ once a commit, after its answers, by
    # the folders' thread; none by the bodies' thread (the check of a body writes
    # nothing durable).
    submit_fsyncs = {k: v for k, v in fsyncs.items() if k.startswith("serve-")}
    assert submit_fsyncs == {"serve-journal": 4, "serve-folders": 2}, fsyncs


class Cut(Exception):
    """A commit stopped here, as by a kill."""


async def test_a_commit_cut_after_its_lines_are_durable_is_whole_after_a_restart(
    tmp_path: Path, agent: FakeAgent
) -> None:
    def cut(step: str) -> None:
        assert step == APPENDED
        raise Cut(step)

    async with daemon(tmp_path, agent, window=1000) as api:
        api.service.journal.step = cut
        # Not answered 2xx: such a job may exist after a restart, whole.
        assert await api.submit("cut", count=3) == 500
        folder = tmp_path / "state" / "jobs" / "cut"
        assert not (folder / "job.json").exists()
    async with daemon(tmp_path, agent, window=1000) as api:
        stream = await api.results("cut", wait="true")
        assert (await api.status("cut"))["state"] == "done"
        assert len([line for line in stream.splitlines() if b"_ng_seq" in line]) == 3
        # The same body is the same job; the journal made it whole.
        assert await api.submit("cut", count=3) == 200


async def test_files_a_power_cut_loses_are_made_whole_from_the_journal(
    tmp_path: Path, agent: FakeAgent
) -> None:
    agent.gated = True
    async with daemon(tmp_path, agent, window=1000) as api:
        for job_id in ("a", "b", "c"):
            assert await api.submit(job_id, count=2) == 201
    jobs = tmp_path / "state" / "jobs"
    registry = Registry(tmp_path / "state")
    before = {j: registry.read(jobs / j) for j in "abc"}
    # Never fsynced, these files may be gone or empty after a power cut.
    (jobs / "a" / "job.json").unlink()
    (jobs / "b" / "input.jsonl").write_bytes(b"")
    (jobs / "c" / "job.json").write_bytes(b"")
    agent.gated = False
    async with daemon(tmp_path, agent, window=1000) as api:
        for job_id in "abc":
            await api.results(job_id, wait="true")
            assert (await api.status(job_id))["state"] == "done"
            after = registry.read(jobs / job_id)
            assert isinstance(after, JobRecord) and isinstance(before[job_id], JobRecord)
            assert after.digest == before[job_id].digest  # type: ignore[union-attr]
        assert await api.listed() == {"a", "b", "c"}
    # Every job final: their journal segment is gone.
    assert list((tmp_path / "state" / JOURNAL_DIR).iterdir()) == []


async def test_a_kill_during_many_concurrent_submits_keeps_every_job_answered(
    tmp_path: Path, agent: FakeAgent
) -> None:
    agent.gated = True
    state = tmp_path / "state"
    serve = await Serve.start(state, agent.url)
    answered: list[str] = []

    async def submit(n: int) -> None:
        async with serve.http.post(f"{serve.url}/v1/jobs", data=body(f"k{n}")) as r:
            if r.status == 201:
                answered.append(f"k{n}")

    tasks = [asyncio.create_task(submit(n)) for n in range(200)]
    await wait_until(lambda: len(answered) >= 20)
    assert await serve.stop(signal.SIGKILL) == -signal.SIGKILL
    await asyncio.gather(*tasks, return_exceptions=True)
    agent.gated = False
    again = await Serve.start(state, agent.url)
    try:
        async with api_session() as http, http.get(f"{again.url}/v1/jobs") as r:
            listed = {job["job_id"]: job for job in (await r.json())["jobs"]}
        for job_id in answered:
            assert listed[job_id]["state"] != "failed", listed[job_id]
        # Every job there, answered or not, is whole: it runs to its end.
        for job_id in listed:
            stream = await again.results(job_id, wait=True)
            assert stream[-1] == {"end": "done"} and len(stream) == 3, (job_id, stream)
    finally:
        await again.stop()


async def test_a_journal_that_cannot_be_read_is_exit_2_naming_it(tmp_path: Path) -> None:
    """It was an unexpected error with a stack of frames."""
    from tests.helpers import run_cli

    state = tmp_path / "state"
    state.mkdir()
    (state / JOURNAL_DIR).write_bytes(b"not a folder\n")
    result = await run_cli(
        "serve", "--state-dir", str(state), "--agent", "a=http://127.0.0.1:9",
        "--listen", "127.0.0.1:0",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-1000:]
    assert str(state / JOURNAL_DIR) in result.stderr and "Traceback" not in result.stderr


async def test_submits_of_one_turn_of_the_loop_are_one_commit(tmp_path: Path) -> None:
    # Bodies checked meanwhile come back to the loop together: the first of them
    # does not go alone to disk, leaving the others to wait for a second fsync.
    async with open_journal(tmp_path) as journal:
        accepted: list[str] = []
        entries = [journal.submit(record(f"j{n}", n + 1), None, lambda r: accepted.append(r.job_id))
                   for n in range(5)]  # fmt: skip
        await asyncio.gather(*(entry.answer for entry in entries))
        assert (journal.batches, journal.largest_batch) == (1, 5)
        assert accepted == [f"j{n}" for n in range(5)]


@contextlib.asynccontextmanager
async def open_journal(tmp_path: Path) -> AsyncIterator[Journal]:
    """A locked registry and its journal, closed and unlocked at the end."""
    registry = Registry(tmp_path / "state")
    registry.lock()
    journal = Journal(registry)
    try:
        yield journal
    finally:
        await journal.close()
        registry.unlock()


def record(job_id: str, seq: int) -> JobRecord:
    spec = JobSpec(job_id=job_id, input="tasks.jsonl")
    fields = {"spec": spec, "digest": job_id, "submitted_seq": seq,
              "submitted_at": now_iso(), "rows_file": None}  # fmt: skip
    return JobRecord.model_validate(fields, context=STORED)


async def test_a_submit_after_the_journals_thread_stopped_is_refused_and_close_ends(
    tmp_path: Path,
) -> None:
    registry = Registry(tmp_path / "state")
    registry.lock()
    journal = Journal(registry)
    try:
        journal._thread.shutdown()
        entry = journal.submit(record("late", 1), None, lambda r: None)
        with pytest.raises(RuntimeError):
            await entry.answer
        await asyncio.wait_for(journal.close(), 10)
    finally:
        registry.unlock()


async def test_a_batch_gathered_meanwhile_is_committed_while_the_loop_is_busy(
    tmp_path: Path,
) -> None:
    # The journal's thread takes the next batch itself as the last one ends: a loop
    # busy elsewhere delays the submitters' answers, never their commit.
    async with open_journal(tmp_path) as journal:
        held, release, second = threading.Event(), threading.Event(), threading.Event()

        def step(_: str) -> None:
            if not held.is_set():
                held.set()
                release.wait(60)
            else:
                second.set()

        journal.step = step
        first = journal.submit(record("first", 1), None, lambda r: None)
        await wait_until(held.is_set)
        later = [journal.submit(record(f"j{n}", n + 2), None, lambda r: None) for n in range(3)]
        release.set()
        # The loop's thread blocks here: no callback of the loop runs meanwhile.
        assert second.wait(30)
        await asyncio.gather(first.answer, *(entry.answer for entry in later))
        assert (journal.batches, journal.largest_batch) == (2, 3)


async def test_a_full_segment_goes_once_its_jobs_are_final_the_one_appended_to_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_module, "SEGMENT_JOBS", 2)
    async with open_journal(tmp_path) as journal:

        def segments() -> list[str]:
            return sorted(path.name for path in (tmp_path / "state" / JOURNAL_DIR).iterdir())

        for n in range(5):
            await journal.submit(record(f"j{n}", n + 1), None, lambda r: None).answer
        assert segments() == ["000001.jsonl", "000002.jsonl", "000003.jsonl"]
        for n in (0, 1, 2):
            journal.final_saved(f"j{n}")
        await wait_until(lambda: segments() == ["000002.jsonl", "000003.jsonl"])
        journal.final_saved("j4")
        journal.final_saved("j3")
        await wait_until(lambda: segments() == ["000003.jsonl"])


async def test_a_submit_is_answered_once_durable_without_waiting_for_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The folder is written after the answer, in a thread of its own: neither the
    # submitter nor the next batch waits for it, and the job starts once it is there.
    registry = Registry(tmp_path / "state")
    registry.lock()
    journal = Journal(registry)
    held, release = threading.Event(), threading.Event()
    real = registry.write_job

    def held_write(record: JobRecord, rows: Any, *, durable: bool) -> None:
        if record.job_id == "first":
            held.set()
            release.wait(60)
        real(record, rows, durable=durable)

    monkeypatch.setattr(registry, "write_job", held_write)
    written: list[tuple[str, OSError | None]] = []

    def on_written(r: JobRecord, error: OSError | None) -> None:
        written.append((r.job_id, error))

    try:
        first = journal.submit(record("first", 1), None, lambda r: None)
        first.written = on_written
        await wait_until(held.is_set)
        await wait_until(first.answer.done)
        second = journal.submit(record("second", 2), None, lambda r: None)
        second.written = on_written
        await wait_until(second.answer.done)
        assert written == [] and not (registry.job_dir("first") / "job.json").exists()
        release.set()
        await wait_until(lambda: len(written) == 2)
        # In commit order, each once its files are there.
        assert written == [("first", None), ("second", None)]
        assert all(isinstance(registry.read(registry.job_dir(j)), JobRecord)
                   for j in ("first", "second"))  # fmt: skip
    finally:
        release.set()
        await journal.close()
        registry.unlock()


async def test_a_job_whose_folder_cannot_be_written_is_answered_and_whole_after_a_restart(
    tmp_path: Path, agent: FakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = Registry.write_job

    def full_disk(self: Registry, record: JobRecord, rows: Any, *, durable: bool) -> None:
        if record.job_id == "x":
            raise OSError(28, "No space left on device")
        real(self, record, rows, durable=durable)

    with monkeypatch.context() as patch:
        patch.setattr(Registry, "write_job", full_disk)
        async with daemon(tmp_path, agent, window=1000) as api:
            # Durable in the journal when answered, whatever becomes of its folder.
            assert await api.submit("x", count=3) == 201
            end = orjson.loads((await api.results("x", wait="true")).splitlines()[-1])
            assert end["end"] == "failed" and "No space left on device" in end["error"]
    segments = list((tmp_path / "state" / JOURNAL_DIR).iterdir())
    assert len(segments) == 1 and b'"x"' in segments[0].read_bytes()
    async with daemon(tmp_path, agent, window=1000) as api:
        stream = await api.results("x", wait="true")
        assert len([line for line in stream.splitlines() if b"_ng_seq" in line]) == 3
        assert (await api.status("x"))["state"] == "done"


async def test_after_a_line_the_disk_took_part_of_the_next_lines_are_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_journal(tmp_path) as journal:
        real = journal_module.write_fully
        torn: list[bytes] = []

        def full_disk_once(fd: int, data: bytes) -> None:
            if not torn:
                torn.append(data)
                real(fd, data[: len(data) // 2])
                raise OSError(28, "No space left on device")
            real(fd, data)

        monkeypatch.setattr(journal_module, "write_fully", full_disk_once)
        with pytest.raises(OSError):
            await journal.submit(record("refused", 1), None, lambda r: None).answer
        await journal.submit(record("answered", 2), None, lambda r: None).answer
        lines = [
            r.job_id
            for segment in journal._segments()
            for r, _ in journal_module._entries(journal.segment_path(segment))
        ]
        # The torn line is skipped, never the answered one after it.
        assert lines == ["answered"]


async def test_a_job_whose_folder_is_written_once_the_daemon_stops_is_left_for_the_next_start(
    tmp_path: Path, agent: FakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The service's close waits for the tasks of the jobs it holds: one started after
    # it took them would be left running, never waited for.
    held, release = threading.Event(), threading.Event()
    real = Registry.write_job

    def held_write(self: Registry, record: JobRecord, rows: Any, *, durable: bool) -> None:
        if record.job_id == "late":
            held.set()
            release.wait(60)
        real(self, record, rows, durable=durable)

    with monkeypatch.context() as patch:
        patch.setattr(Registry, "write_job", held_write)
        async with daemon(tmp_path, agent, window=1000) as api:
            assert await api.submit("late", count=2) == 201
            await wait_until(held.is_set)
            api.service.daemon.stop_requested.set()
            release.set()
            await api.service.journal._quiet.wait()
            late = api.service.jobs["late"]
            assert late.task is None
    async with daemon(tmp_path, agent, window=1000) as api:
        await api.results("late", wait="true")
        assert (await api.status("late"))["state"] == "done"


async def test_a_batchs_folders_are_written_after_its_submitters_are_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The GIL is the loop's while it answers a burst: the folders' thread, whose
    # writes would take it, is handed the batch only once its answers have run.
    async with open_journal(tmp_path) as journal:
        answered: list[str] = []
        handed: list[list[str]] = []
        real = journal._folders.submit

        def noted(*args: Any) -> Any:
            handed.append(list(answered))
            return real(*args)

        monkeypatch.setattr(journal._folders, "submit", noted)

        async def submitter(job_id: str, seq: int) -> None:
            await journal.submit(record(job_id, seq), None, lambda r: None).answer
            answered.append(job_id)

        ids = [f"j{n}" for n in range(3)]
        tasks = [asyncio.create_task(submitter(job_id, n + 1)) for n, job_id in enumerate(ids)]
        # A turn for the submits to be made, one for the batch to be handed over.
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        # The loop held until the journal's thread is done with the batch (its one
        # thread runs this after): a hand-over from there would come before any answer.
        journal._thread.submit(lambda: None).result(30)
        await asyncio.gather(*tasks)
        await wait_until(lambda: len(handed) == 1)
        assert handed == [ids]


async def test_the_journals_folder_made_at_the_first_commit_is_durable_in_the_state_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A power cut after the first answer must not lose the folder the journal's
    # first segment is in: its entry in the state directory is synced too.
    synced: list[Path] = []
    monkeypatch.setattr(journal_module, "fsync_dir", synced.append)
    monkeypatch.setattr(atomic, "fsync_dir", synced.append)
    async with open_journal(tmp_path) as journal:
        assert not journal.root.exists()
        synced.clear()
        await journal.submit(record("first", 1), None, lambda r: None).answer
        assert synced[:2] == [journal.root.parent, journal.root]


async def test_a_jobs_folder_name_is_durable_before_the_job_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A folder claimed in jobs/ and never synced there may be gone after a power
    # cut with the rows its job made durable in it: the next start would make it
    # anew from the journal and run them again.
    synced: list[Path] = []
    monkeypatch.setattr(journal_module, "fsync_dir", synced.append)
    async with open_journal(tmp_path) as journal:
        written: list[tuple[str, bool]] = []

        def noted(record: JobRecord, error: OSError | None) -> None:
            written.append((record.job_id, journal.registry.jobs_dir in synced))

        await journal.submit(record("first", 1), None, lambda r: None, noted).answer
        await wait_until(lambda: len(written) == 1)
        assert written == [("first", True)]
