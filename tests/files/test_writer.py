"""The row writer's group commit (contracts §4): ``--fsync batch`` gathers rows for
its window, but not while no row can join the batch (nothing at an agent)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path

import pytest

from dispatcher.files import writer as writer_module
from dispatcher.files.atomic import write_fully
from dispatcher.files.writer import LineIndex, RowWriter


async def test_a_batch_is_written_at_once_when_no_row_is_coming(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    at_agents = [1]
    # A window of an hour: only the writer's quiet check can end it in this test.
    writer = RowWriter(path, "batch", interval_s=3600, quiet=lambda: at_agents[0] == 0)
    writer.open()
    try:
        first = asyncio.ensure_future(writer.append_line(b'{"n": 1}\n'))
        for _ in range(20):
            await asyncio.sleep(0)
        # A rollout is still at its agent: its row may join the batch.
        assert not first.done() and path.read_bytes() == b""
        at_agents[0] = 0
        await asyncio.wait_for(asyncio.gather(first, writer.append_line(b'{"n": 2}\n')), 30)
        assert path.read_bytes() == b'{"n": 1}\n{"n": 2}\n'
    finally:
        await writer.close()


async def test_a_full_batch_ends_the_window_without_a_wake_per_row(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    writer = RowWriter(path, "batch", interval_s=3600, max_rows=3)
    writer.open()
    wakes = 0
    set_wakeup = writer._wakeup.set

    def counted() -> None:
        nonlocal wakes
        wakes += 1
        set_wakeup()

    writer._wakeup.set = counted  # type: ignore[method-assign]
    try:
        rows = [writer.submit(b'{"n": %d}\n' % n) for n in range(3)]
        # The batch's first row and the row that fills it; not the one between.
        assert wakes == 2
        assert await asyncio.wait_for(asyncio.gather(*rows), 30) == [None] * 3
        assert path.read_bytes() == b'{"n": 0}\n{"n": 1}\n{"n": 2}\n'
    finally:
        await writer.close()


async def test_a_shielded_row_is_counted_by_a_task_cancelled_while_it_is_written(
    tmp_path: Path,
) -> None:
    path = tmp_path / "rows.jsonl"
    writer = RowWriter(path, "batch", interval_s=3600, max_rows=2)
    writer.open()
    try:
        written = writer.submit(b'{"n": 1}\n', shielded=True)
        outcome: list[str] = []

        async def commit() -> None:
            try:
                await written
            except asyncio.CancelledError:
                outcome.append(f"cancelled, done={written.done()}")
                raise

        task = asyncio.create_task(commit())
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0)
        # The cancel waits for the row: the future refused it.
        assert not written.cancelled() and not task.done()
        writer.submit(b'{"n": 2}\n')  # fills the batch: it is written now
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
        assert outcome == ["cancelled, done=True"] and written.result() is None
        assert path.read_bytes() == b'{"n": 1}\n{"n": 2}\n'
    finally:
        await writer.close()


async def test_a_hurried_writer_writes_what_it_holds_and_each_row_after_at_once(
    tmp_path: Path,
) -> None:
    """A caller waits on the rows (a job whose next start waits for its caller to take
    them): the batch gathering stops, and rows that come meanwhile are not held."""
    path = tmp_path / "rows.jsonl"
    writer = RowWriter(path, "batch", interval_s=3600, quiet=lambda: False)
    writer.open()
    try:
        first = asyncio.ensure_future(writer.append_line(b'{"n": 1}\n'))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not first.done() and path.read_bytes() == b""
        writer.hurry(True)
        await asyncio.wait_for(first, 30)
        await asyncio.wait_for(writer.append_line(b'{"n": 2}\n'), 30)
        assert path.read_bytes() == b'{"n": 1}\n{"n": 2}\n'
        writer.hurry(False)  # gathers again
        third = asyncio.ensure_future(writer.append_line(b'{"n": 3}\n'))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not third.done()
        third.cancel()
    finally:
        await writer.close()


def writing_threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The thread of each write the row writer makes, in order (the writes still made)."""
    threads: list[int] = []

    def recorded(fd: int, data: bytes) -> None:
        threads.append(threading.get_ident())
        write_fully(fd, data)

    monkeypatch.setattr(writer_module, "write_fully", recorded)
    return threads


async def test_without_fsync_a_small_batch_is_written_on_the_loop_and_a_big_one_in_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread hop costs a row milliseconds on a busy machine, on its way to a caller
    waiting for it; a small write into the page cache, microseconds."""
    path = tmp_path / "rows.jsonl"
    threads = writing_threads(monkeypatch)
    writer = RowWriter(path, "never", index=LineIndex())
    writer.open()
    try:
        assert await asyncio.wait_for(writer.append_line(b'{"n": 1}\n'), 30) == 1
        big = b'{"n": "%s"}\n' % (b"x" * writer_module.ON_LOOP_BYTES)
        assert await asyncio.wait_for(writer.append_line(big), 30) == 2
        assert path.read_bytes() == b'{"n": 1}\n' + big
        loop_thread = threading.get_ident()
        assert threads[0] == loop_thread and threads[1] != loop_thread
    finally:
        await writer.close()


async def test_a_fsynced_batch_is_written_in_a_thread_however_small(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rows.jsonl"
    threads = writing_threads(monkeypatch)
    writer = RowWriter(path, "always")
    writer.open()
    try:
        await asyncio.wait_for(writer.append_line(b'{"n": 1}\n'), 30)
        assert threads and threads[0] != threading.get_ident()
    finally:
        await writer.close()
