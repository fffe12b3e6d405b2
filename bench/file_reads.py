"""Reading a JSONL file from the event loop: batches in a worker thread vs aiofiles.

The dispatcher reads the materialized task file in batches through
``asyncio.to_thread`` (one thread hop per few thousand lines) and each
capture file with one ``to_thread`` call. aiofiles runs every file call in a
thread too, so it can only match that when used in the same batches, and
costs a thread hop per line when iterated line by line. This prints both,
against a plain blocking read of the same file as the floor.

    python bench/file_reads.py [--rows N] [--repeats K]

aiofiles is not a dependency: install it to run the comparison
(``pip install aiofiles``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import orjson

BATCH_LINES = 2048


def write_file(path: Path, rows: int) -> None:
    with path.open("wb") as f:
        for i in range(rows):
            row = {"responses_create_params": {"input": f"question {i} " * 8}}
            f.write(orjson.dumps({**row, "_ng_task_index": i, "_ng_rollout_index": 0}) + b"\n")


def blocking(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for line in f if orjson.loads(line))


def _batch(f: Any) -> list[bytes]:
    return [line for _ in range(BATCH_LINES) if (line := f.readline())]


async def thread_batches(path: Path) -> int:
    count = 0
    with path.open("rb") as f:
        while batch := await asyncio.to_thread(_batch, f):
            count += sum(1 for line in batch if orjson.loads(line))
    return count


async def aiofiles_lines(path: Path) -> int:
    import aiofiles

    count = 0
    async with aiofiles.open(path, "rb") as f:
        async for line in f:
            count += 1 if orjson.loads(line) else 0
    return count


async def aiofiles_batches(path: Path) -> int:
    import aiofiles

    count = 0
    async with aiofiles.open(path, "rb") as f:
        while batch := await f.readlines(BATCH_LINES * 200):
            count += sum(1 for line in batch if orjson.loads(line))
    return count


def median_s(run: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed(coro: Callable[[Path], Coroutine[Any, Any, int]], path: Path) -> Callable[[], int]:
    return lambda: asyncio.run(coro(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tasks.jsonl"
        write_file(path, args.rows)
        floor = median_s(lambda: blocking(path), args.repeats)
        print(f"{args.rows:,} rows, median of {args.repeats}")
        print(f"  blocking read (floor)           {floor:8.3f} s")
        batches = median_s(timed(thread_batches, path), args.repeats)
        print(f"  to_thread batches (dispatcher)  {batches:8.3f} s  ({batches / floor:.2f}x)")
        try:
            import aiofiles  # noqa: F401
        except ImportError:
            print("  aiofiles: not installed (pip install aiofiles to compare)")
            return
        variants = [("aiofiles batches", aiofiles_batches)]
        variants.append(("aiofiles line by line", aiofiles_lines))
        for name, coro in variants:
            took = median_s(timed(coro, path), args.repeats)
            print(f"  {name:<31} {took:8.3f} s  ({took / floor:.2f}x)")


if __name__ == "__main__":
    main()
