"""Attempt indices reserved on disk before a rollout is sent (contracts §5).

A rollout's ``_ng_attempt_index`` is never reused: a hop killed while an
agent held the rollout wrote no row for that attempt, yet the agent may have
run it (and its model calls were captured under ``-aN``). So before the
first rollout of a batch read is sent, the hop appends one line to
``X_attempt_reservations.jsonl`` naming the materialized lines it may send,
``{"hop": TOKEN, "lines": [[START, END], ...]}`` (byte offsets of
``X_materialized_inputs.jsonl``), and fsyncs it. A rollout's next index is
then at least the number of earlier hops that reserved its line.

One line per batch read (up to 512 rollouts), not per rollout: a hop may
reserve a line it never sends (drained or stopped part way through a batch),
which leaves a gap in the indices, never a repeat. A hop that sends nothing
reserves nothing. A torn last line was never fsynced, so nothing it
named was sent: it is dropped. The hop that creates the file fsyncs its folder
too, before its first rollout is sent: the file's name is durable with its line.
"""

from __future__ import annotations

import bisect
import os
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import orjson

from dispatcher.files.atomic import fsync_dir
from dispatcher.files.resume import repair_torn_tail


class Reservations:
    """The reservations of earlier hops (read once) and this hop's own (appended)."""

    def __init__(
        self, path: Path, earlier: dict[str, list[tuple[int, int]]], *, named: bool = False
    ) -> None:
        self.path = path
        self.hop = os.urandom(4).hex()
        self._starts, self._counts = _coverage(earlier)
        # Whether the file's name is durable in its folder (an earlier hop's file).
        self._named = named

    @classmethod
    def load(cls, path: Path) -> Reservations:
        """Read the earlier hops' reservations (blocking: run it in a thread)."""
        repair_torn_tail(path)
        earlier: dict[str, list[tuple[int, int]]] = defaultdict(list)
        try:
            data, named = path.read_bytes(), True
        except FileNotFoundError:
            data, named = b"", False
        for line in data.splitlines():
            if line.strip():
                entry = orjson.loads(line)
                earlier[str(entry["hop"])].extend((int(a), int(b)) for a, b in entry["lines"])
        return cls(path, earlier, named=named)

    def earlier(self, offset: int) -> int:
        """How many earlier hops reserved the materialized line at ``offset``."""
        at = bisect.bisect_right(self._starts, offset) - 1
        return self._counts[at] if at >= 0 else 0

    def reserve(self, spans: Iterable[tuple[int, int]]) -> None:
        """Make this hop's reservation of ``spans`` durable (blocking)."""
        lines = [[a, b] for a, b in spans]
        if not lines:
            return
        entry = orjson.dumps({"hop": self.hop, "lines": lines}) + b"\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, entry)
            os.fsync(fd)
        finally:
            os.close(fd)
        if not self._named:
            fsync_dir(self.path.parent)
            self._named = True


def _coverage(hops: dict[str, list[tuple[int, int]]]) -> tuple[list[int], list[int]]:
    """Offsets where the count of covering hops changes, and the count from each on.
    A hop's own spans are merged first: it counts once however often it named a line."""
    delta: dict[int, int] = defaultdict(int)
    for spans in hops.values():
        for start, end in _merged(spans):
            delta[start] += 1
            delta[end] -= 1
    starts, counts, running = [], [], 0
    for offset in sorted(delta):
        running += delta[offset]
        starts.append(offset)
        counts.append(running)
    return starts, counts


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
