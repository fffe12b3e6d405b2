"""The rollouts a job still has to start: the task file's, then what our own faults put back.

``Pending`` reads the materialized rows in batches off the event loop,
skipping those the output files already make final (the resume contract of
``files/resume.py``), and clears each batch's old capture files before its
rollouts start. A rollout put back after a fault of ours (contracts §11) is
started again before the next new one.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import BinaryIO

from dispatcher import jsonx
from dispatcher.files.resume import RunState
from dispatcher.rows.capture import clear_rollout_captures
from dispatcher.tasks.keys import materialized_key
from dispatcher.tasks.materialize import Rollout

READ_BATCH_ROWS = 512


class Pending:
    """The rollouts left to start, in input order, put-back ones first."""

    def __init__(
        self,
        materialized: Path,
        state: RunState,
        capture_dir: Path | None,
        capture_token: str | None,
    ) -> None:
        self._materialized = materialized
        self._state = state
        self._capture_dir = capture_dir
        self._capture_token = capture_token
        self._requeued: deque[Rollout] = deque()
        self._wake = asyncio.Event()

    def put_back(self, rollout: Rollout) -> None:
        self._requeued.append(rollout)
        self._wake.set()

    def wake(self) -> None:
        """Look again: the last flight landed (the iteration may end)."""
        self._wake.set()

    async def each(self, in_flight: Callable[[], bool]) -> AsyncIterator[Rollout]:
        """Every rollout to start; ends once the file is read and, with nothing
        ``in_flight`` any more, nothing was put back."""
        async for rollout in self._from_file():
            while self._requeued:
                yield await self._take_requeued()
            yield rollout
        while True:
            while self._requeued:
                yield await self._take_requeued()
            if not in_flight():
                return
            self._wake.clear()
            await self._wake.wait()

    async def _take_requeued(self) -> Rollout:
        rollout = self._requeued.popleft()
        # Whatever the faulted try left in the capture dir is not this attempt's.
        await self._clear_captures([rollout])
        return rollout

    async def _from_file(self) -> AsyncIterator[Rollout]:
        with self._materialized.open("rb") as f:
            while True:
                batch = await asyncio.to_thread(_read_batch, f, self._state, self._capture_token)
                if batch is None:
                    return
                await self._clear_captures(batch)
                for rollout in batch:
                    yield rollout

    async def _clear_captures(self, batch: list[Rollout]) -> None:
        if self._capture_dir is None or not batch:
            return
        await clear_rollout_captures(self._capture_dir, [r.rollout_id for r in batch])


def _read_batch(
    f: BinaryIO, state: RunState, capture_token: str | None = None
) -> list[Rollout] | None:
    """Up to READ_BATCH_ROWS rollouts not yet final (in a thread); None at the end."""
    batch: list[Rollout] = []
    for _ in range(READ_BATCH_ROWS * 8):
        line = f.readline()
        if not line:
            return batch or None
        # Most rows are final on a late resume: find their key without parsing them.
        key = materialized_key(line)
        if state.is_final(key):
            continue
        row = jsonx.loads(line)
        batch.append(Rollout.from_materialized(row, state.attempt_index(key), capture_token))
        if len(batch) >= READ_BATCH_ROWS:
            break
    return batch
