"""The results stream's reads: small chunks on the loop, big ones in a thread."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pytest

from dispatcher.aio import cancel_and_wait
from dispatcher.files.writer import LineIndex
from dispatcher.serve import results


def job_files(tmp_path: Path, rows: list[dict[str, Any]], live: bool = False) -> results.Source:
    """A finished job of ``rows``, one group per row: written by an earlier daemon, or
    ``live``, by this one just now."""
    lines = [orjson.dumps(row) + b"\n" for row in rows]
    output = tmp_path / "rows.jsonl"
    output.write_bytes(b"".join(lines))
    groups = [orjson.dumps({"task_index": n, "rows": [n + 1], "failures": 0}) + b"\n"
              for n in range(len(rows))]  # fmt: skip
    groups_path = tmp_path / "groups.jsonl"
    groups_path.write_bytes(b"".join(groups))
    if live:
        index, group_index = LineIndex(), LineIndex()
        index.add(0, [len(line) for line in lines])
        group_index.add(0, [len(line) for line in groups])
    else:
        index, group_index = LineIndex.scan(output), LineIndex.scan(groups_path)
    return results.Source(
        output, index, groups_path, group_index, lambda: "done", lambda task: None
    )


async def streamed(source: results.Source, group: bool) -> list[dict[str, Any]]:
    chunks = [
        chunk.data
        async for chunk in results.stream(source, 0, group, wait=True, chunk_bytes=1 << 20)
    ]
    return [orjson.loads(line) for line in b"".join(chunks).splitlines()]


@pytest.fixture
def thread_hops(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    hops: list[str] = []

    class Counted(ThreadPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            hops.append(getattr(fn, "func", fn).__name__)
            return super().submit(fn, *args, **kwargs)

    monkeypatch.setattr(results, "_READERS", Counted(max_workers=1))
    return hops


@pytest.mark.parametrize("group", [False, True])
async def test_small_rows_are_read_on_the_loop(
    tmp_path: Path, thread_hops: list[str], group: bool
) -> None:
    source = job_files(tmp_path, [{"reward": n} for n in range(100)])
    items = await streamed(source, group)
    assert thread_hops == []
    assert items[-1] == {"end": "done"}
    seqs = [item["_ng_seq"] for item in items[:-1]]
    assert seqs == list(range(1, 101))


@pytest.mark.parametrize("group", [False, True])
async def test_big_rows_are_read_in_a_thread(
    tmp_path: Path, thread_hops: list[str], group: bool
) -> None:
    big = "x" * (results.READ_ON_LOOP_BYTES + 1)
    source = job_files(tmp_path, [{"text": big, "n": n} for n in range(3)])
    items = await streamed(source, group)
    assert thread_hops == ["_groups_chunk" if group else "_rows_chunk"]
    rows = [item["rows"][0] if group else item for item in items[:-1]]
    assert [(row["_ng_seq"], row["n"], row["text"] == big) for row in rows] == [
        (1, 0, True), (2, 1, True), (3, 2, True)
    ]  # fmt: skip


@pytest.mark.parametrize("group", [False, True])
async def test_a_live_jobs_new_lines_are_read_on_the_loop_whatever_their_size(
    tmp_path: Path, thread_hops: list[str], group: bool
) -> None:
    # Just written, so in the page cache: a thread hop would only wait for the GIL
    # and the loop, which held group deliveries for hundreds of ms at 10,000 in flight.
    big = "x" * (results.READ_ON_LOOP_BYTES + 1)
    source = job_files(tmp_path, [{"text": big, "n": n} for n in range(3)], live=True)
    items = await streamed(source, group)
    assert thread_hops == []
    assert len(items) == 4 and items[-1] == {"end": "done"}


@pytest.mark.parametrize("group", [False, True])
async def test_a_waiting_stream_has_a_new_line_one_turn_of_the_loop_after_it_is_indexed(
    tmp_path: Path, group: bool
) -> None:
    # At 10,000 in flight a turn of the loop is tens of ms: every turn between a
    # group's line and its delivery is felt by the trainer. The stream waits on the
    # index's Wakeup, which once woke it in three turns (a task inside wait_for).
    source = dataclasses.replace(job_files(tmp_path, [], live=True), final_state=lambda: None)
    got: list[bytes] = []

    async def consume() -> None:
        async for chunk in results.stream(source, 0, group, wait=True, chunk_bytes=1 << 20):
            if chunk.data:  # not the empty one before it waits (the headers)
                got.append(chunk.data)

    reader = asyncio.create_task(consume())
    try:
        for _ in range(3):
            await asyncio.sleep(0)  # the stream is waiting
        row = orjson.dumps({"reward": 1}) + b"\n"
        line = orjson.dumps({"task_index": 0, "rows": [1], "failures": 0}) + b"\n"
        source.output.write_bytes(row)
        source.groups_path.write_bytes(line)
        source.rows.add(0, [len(row)])
        source.groups.add(0, [len(line)])
        await asyncio.sleep(0)
        assert len(got) == 1
        assert orjson.loads(got[0])["_ng_seq"] == 1
    finally:
        await cancel_and_wait(reader)


def fds_on(path: Path) -> int:
    """This process's open file descriptors on ``path``."""
    count = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            count += fd.readlink() == path
        except OSError:  # the listing's own descriptor, closed by now
            continue
    return count


class Gated(ThreadPoolExecutor):
    """Reads that start only once the test lets them (after their reader has gone)."""

    def __init__(self) -> None:
        super().__init__(max_workers=32)
        self.started = asyncio.Event()
        self.release = threading.Event()
        self.loop = asyncio.get_running_loop()

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        def gated() -> Any:
            self.loop.call_soon_threadsafe(self.started.set)
            self.release.wait()
            return fn(*args, **kwargs)

        return super().submit(gated)


@pytest.mark.parametrize("group", [False, True])
async def test_a_reader_gone_while_its_read_waits_for_a_thread_leaves_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: bool
) -> None:
    # A client that goes away cancels its stream while the stream's first read is
    # queued in a thread: the file was opened there after the stream had closed it,
    # and stayed open (552 descriptors after 2,500 readers, then EMFILE).
    gated = Gated()
    monkeypatch.setattr(results, "_READERS", gated)
    big = "x" * (results.READ_ON_LOOP_BYTES + 1)
    source = job_files(tmp_path, [{"text": big, "n": n} for n in range(3)])
    readers = []
    for _ in range(20):
        gated.started.clear()
        readers.append(asyncio.create_task(streamed(source, group)))
        await gated.started.wait()
        await cancel_and_wait(readers[-1], reraise=False)
    gated.release.set()
    await asyncio.to_thread(gated.shutdown, wait=True)
    assert fds_on(source.output) == 0
    assert fds_on(source.groups_path) == 0


@pytest.mark.parametrize("group", [False, True])
async def test_what_is_ready_at_once_is_one_chunk_with_the_end_line(
    tmp_path: Path, group: bool
) -> None:
    # One write to the peer for all of it: a job of one group was four.
    source = job_files(tmp_path, [{"reward": n} for n in range(3)])
    chunks = [c async for c in results.stream(source, 0, group, wait=True, chunk_bytes=1 << 20)]
    assert len(chunks) == 1 and chunks[0].last
    lines = [orjson.loads(line) for line in chunks[0].data.splitlines()]
    assert [line.get("_ng_seq") for line in lines] == [1, 2, 3, None]
    assert lines[-1] == {"end": "done"}


async def test_joined_chunks_keep_the_chunk_bound(tmp_path: Path) -> None:
    rows = [{"text": "x" * 100, "n": n} for n in range(10, 50)]
    source = job_files(tmp_path, rows)
    row_bytes = len(orjson.dumps(rows[0])) + 1
    chunks = [c async for c in results.stream(source, 0, False, wait=True, chunk_bytes=1000)]
    # At most 1000 bytes of rows a chunk (each row is sent with its _ng_seq).
    assert all(c.data.count(b"\n") * row_bytes <= 1000 for c in chunks[:-1])
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    lines = [orjson.loads(line) for c in chunks for line in c.data.splitlines()]
    assert [line.get("n") for line in lines] == [*range(10, 50), None]


async def test_a_waiting_stream_sends_an_empty_chunk_before_it_first_waits(
    tmp_path: Path,
) -> None:
    source = dataclasses.replace(job_files(tmp_path, [], live=True), final_state=lambda: None)
    lines = results.stream(source, 0, True, wait=True, chunk_bytes=1 << 20)
    try:
        first = await anext(lines)
        assert first == results.Chunk(b"", [])
    finally:
        await lines.aclose()
