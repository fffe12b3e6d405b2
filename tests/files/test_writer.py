"""The row writer's group commit (contracts §4): ``--fsync batch`` gathers rows for
its window, but not while no row can join the batch (nothing at an agent)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from dispatcher.files.writer import RowWriter


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
