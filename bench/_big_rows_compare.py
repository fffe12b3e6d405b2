"""The side comparisons of ``big_rows.py``, each a small sitting of its own: the
big-answer work in thread pools against process pools (``--offload-compare``), the
loop's largest stall while a rollout's captures merge, and write(2) against
writev(2) for a row of megabytes (``--write-compare``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import LoopLag, median

MB = 1_000_000


def _big_answer(row_bytes: int) -> bytes:
    from dispatcher.sim.agent import TOKENS_KEY, token_logprobs_json

    head = orjson.dumps({"agent_ref": {"name": "sim"}, "_ng_task_index": 1, "reward": 1.0})
    return head[:-1] + b',"' + TOKENS_KEY.encode() + b'":' + token_logprobs_json(row_bytes) + b"}"


def answer_to_line(raw: bytes) -> int:
    """The work handed to a worker: split, merge our keys, serialize; returns the line's size."""
    from dispatcher.rows.wire import classify_big, row_line

    _, result, _ = classify_big(200, raw)
    assert result is not None
    return len(row_line({**result, "_ng_rollout_index": 0, "_ng_dispatch": {"replica": "x"}}))


async def _offload(pool: concurrent.futures.Executor, bodies: list[bytes]) -> tuple[float, float]:
    """Wall time for the bodies in ``pool`` and the loop's largest stall meanwhile."""
    loop = asyncio.get_running_loop()
    async with LoopLag(0.001) as lag:
        started = time.perf_counter()
        await asyncio.gather(*(loop.run_in_executor(pool, answer_to_line, b) for b in bodies))
        wall = time.perf_counter() - started
    return wall, lag.max


def offload_compare(row_bytes: int, count: int) -> None:
    raw = _big_answer(row_bytes)
    bodies = [raw] * count
    pools: dict[str, Callable[[], concurrent.futures.Executor]] = {
        "1 thread": lambda: concurrent.futures.ThreadPoolExecutor(1),
        "2 threads": lambda: concurrent.futures.ThreadPoolExecutor(2),
        "1 process": lambda: concurrent.futures.ProcessPoolExecutor(1),
        "2 processes": lambda: concurrent.futures.ProcessPoolExecutor(2),
    }
    print(f"offload of {count} answers of {len(raw) / MB:.1f} MB (split, merge, serialize)")
    for name, make in pools.items():
        with make() as pool:
            # Warm the pool (process start, imports) outside the timing.
            asyncio.run(_offload(pool, bodies[:2]))
            wall, worst = asyncio.run(_offload(pool, bodies))
        print(f"  {name:11s} {count / wall:7.1f} answers/s   "
              f"largest loop stall {worst * 1000:6.1f} ms")  # fmt: skip


def _capture_lines(calls: int, call_bytes: int) -> list[bytes]:
    from dispatcher.capture.records import Exchange, encode_record

    lines = []
    for n in range(calls):
        exchange = Exchange("r", "chat", "/v1/chat/completions")
        exchange.request_body = orjson.dumps({"model": "m", "messages": []})
        exchange.on_headers(200, "application/json", "")
        message = {"role": "assistant", "content": "x" * call_bytes}
        usage = {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}
        answer = {"id": f"id-{n}", "model": "m", "choices": [{"index": 0, "message": message}]}
        exchange.on_chunk(orjson.dumps({**answer, "usage": usage}))
        lines.append(encode_record(exchange))
    return lines


async def _stall_while(work: Callable[[], Any]) -> float:
    """The largest stall a 1 ms ticker on the loop sees while ``work()`` is awaited."""
    async with LoopLag(0.001) as lag:
        await asyncio.sleep(0.01)
        await work()
    return lag.max


def capture_compare(work: Path, calls: int = 50, call_bytes: int = 200_000) -> None:
    """A rollout with many big captured calls: its merge on the loop and in the worker."""
    from dispatcher.capture.store import capture_path
    from dispatcher.rows import finalize as finalizer
    from dispatcher.rows.capture import attach_capture
    from dispatcher.rows.offload import off_loop
    from dispatcher.rows.wire import row_line

    capture_path(work, "0-0").write_bytes(b"".join(_capture_lines(calls, call_bytes)))

    payloads = False

    def merge(row: dict[str, Any]) -> Any:
        return attach_capture(
            row, capture_dir=work, rollout_id="0-0", task_id=0, agent_result=row,
            total_latency_ms=1.0, include_payloads=payloads,
        )  # fmt: skip

    async def on_loop() -> None:
        row: dict[str, Any] = {"reward": 1.0}
        await merge(row)
        row_line(row)

    async def in_worker() -> None:
        row: dict[str, Any] = {"reward": 1.0}
        await off_loop(finalizer._merge_in_worker, lambda: merge(row), row)

    print(f"capture merge of {calls} calls x {call_bytes // 1000} KB, largest loop stall")
    for payloads in (False, True):
        for name, how in (("on the loop", on_loop), ("in the worker", in_worker)):
            stalls = sorted(asyncio.run(_stall_while(how)) for _ in range(5))
            label = f"{name}, {'with' if payloads else 'without'} payloads"
            print(f"  {label:32s} {stalls[2] * 1000:6.1f} ms (median of 5)")


def write_compare(work: Path, row_bytes: int = 2 * MB, rows: int = 600) -> None:
    """Appending big rows: one write(2) per row against one writev(2) per batch of 8."""
    import os
    import resource

    lines = [os.urandom(16) * (row_bytes // 16) for _ in range(8)]
    print(f"appending {rows} rows of {row_bytes / MB:g} MB, CPU seconds (median of 3)")
    for name in ("write per row", "writev per 8 rows"):
        spent = []
        for _ in range(3):
            path = work / "write-compare.bin"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
            before = resource.getrusage(resource.RUSAGE_SELF)
            for _ in range(rows // len(lines)):
                if name == "write per row":
                    for line in lines:
                        os.write(fd, line)
                else:
                    os.writev(fd, lines)
            after = resource.getrusage(resource.RUSAGE_SELF)
            os.close(fd)
            path.unlink()
            spent.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        print(f"  {name:18s} {median(spent):5.2f} s")
