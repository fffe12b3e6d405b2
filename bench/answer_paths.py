"""A 2xx answer's two paths, in instructions: parsed whole or kept as bytes.

``AnswerClassifier`` parses a body of at most ``offload_bytes`` on the loop
(``classify_here``); a bigger one is validated and split (``wire.classify_big``)
and its line written from the body's pieces. A path here is one answer's class,
row and line, as ``dispatcher run`` makes them (``Finalizer.finalize_now`` does
in place what ``finalize`` does with a worker-thread hop for a big one), on a
body of the sim agent's (``sim-agent --row-bytes N``): the task echoed back plus
a list of ``{token_id, logprob}`` objects, about N bytes in all.

``--path``: small (all on the loop); big (thread worker kind); big-split
(``classify_big`` alone: the worker thread's); big-row (big-split, then the row and
its facts: the loop's share is the difference); parent (the process kind's own
share: the child's answer unpickled, then as big); child (the worker process's:
``answer_for``, pickled); hop (an ``off_loop`` round trip: two per big answer).

Instructions come from valgrind, set-up subtracted (the same run, ``--count 0``)::

    valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/dev/null \\
        python bench/answer_paths.py --path big --size 65536 --count 128

``--table`` runs those pairs for ``--sizes``; ``--time`` times the parse and the
split in one process, in turn (instructions are not time); ``--smoke`` checks the
paths' rows agree.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from dispatcher.delivery.answers import Attempt, Classified, classify_here, classify_object
from dispatcher.files.writer import Line, Pieces
from dispatcher.rows.finalize import Finalizer
from dispatcher.rows.jsonworker import answer_for
from dispatcher.rows.offload import off_loop
from dispatcher.rows.wire import Split, classify_big, wire_result
from dispatcher.settings.config import RunSettings
from dispatcher.sim.agent import TOKENS_KEY, token_logprobs_json
from dispatcher.tasks.materialize import Rollout

KIB = 1024
SIZES = (1 * KIB, 4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1024 * KIB)
PATHS = ("small", "big", "big-split", "big-row", "parent", "child", "hop")
# A task row as ``dispatcher run`` sends it; the sim agent echoes it back.
REQUEST = {
    "agent_ref": {"name": "sim"},
    "responses_create_params": {"input": [{"role": "user", "content": "Solve 7."}]},
    "expected_answer": "7",
    "_ng_task_index": 7,
    "_ng_rollout_index": 0,
}


def sim_body(size: int) -> bytes:
    """The sim agent's answer to ``REQUEST``, about ``size`` bytes in all."""
    echo = {**REQUEST, "response": {"id": "sim-7", "output_text": "42"}, "reward": 1.0}
    head = orjson.dumps({**echo, "model_calls_made": 0})[:-1] + b',"' + TOKENS_KEY.encode() + b'":'
    return head + token_logprobs_json(max(2, size - len(head) - 1)) + b"}"


def finalizer() -> Finalizer:
    settings = RunSettings(input=Path("tasks.jsonl"), output=Path("out.jsonl"))
    made = Finalizer(settings, None, count_tokens=True)  # type: ignore[arg-type]
    made.run_id = "run"
    return made


def line_of(fin: Finalizer, rollout: Rollout, classified: Classified, raw: bytes) -> Line:
    """The row and its line for a classified answer, as the finalizer makes them."""
    outcome, result, failure = classified
    attempt = Attempt(outcome, "http://agent", 0.0, 0.25, result, failure, body_bytes=len(raw))
    line, _, _ = fin.finalize_now(rollout, attempt)
    assert line is not None
    return line


def row_of(fin: Finalizer, rollout: Rollout, classified: Classified, raw: bytes) -> object:
    """What ``finalize`` does on the loop for a big answer: the row and its facts."""
    outcome, result, failure = classified
    attempt = Attempt(outcome, "http://agent", 0.0, 0.25, result, failure, body_bytes=len(raw))
    row = fin._row(rollout, attempt, None)
    assert row is not None
    return fin._facts(attempt, row)


def path_work(path: str, raw: bytes) -> Callable[[], object]:
    """One answer's work on ``path`` (its set-up done here, outside the call)."""
    fin, rollout = finalizer(), Rollout.from_materialized(dict(REQUEST), 0)
    if path == "small":
        return lambda: line_of(fin, rollout, classify_here(200, raw), raw)
    if path == "big":
        return lambda: line_of(fin, rollout, classify_big(200, raw), raw)
    if path == "big-split":
        return lambda: classify_big(200, raw)
    if path == "big-row":
        return lambda: row_of(fin, rollout, classify_big(200, raw), raw)
    if path == "child":
        return lambda: pickle.dumps(answer_for(raw), protocol=pickle.HIGHEST_PROTOCOL)
    sent = pickle.dumps(answer_for(raw), protocol=pickle.HIGHEST_PROTOCOL)

    def parent() -> Line:
        kind, split = pickle.loads(sent)
        assert kind == "split" and isinstance(split, Split)
        return line_of(fin, rollout, classify_object(200, raw, wire_result(raw, split)), raw)

    return parent


async def hops(count: int) -> None:
    """``count`` worker-thread round trips, after one that starts the thread."""
    for _ in range(count + 1):
        await off_loop(int)


def instructions(path: str, size: int, count: int) -> int:
    """The instructions valgrind counts for one run of this script."""
    command = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"]
    command += [sys.executable, __file__, f"--path={path}", f"--size={size}", f"--count={count}"]
    # A fixed hash seed: the set-up run and the counted one hash alike.
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    assert found is not None, done.stderr
    return int(found[1].replace(",", ""))


def per_answer(path: str, size: int) -> int:
    count = min(1000, max(10, (8 << 20) // max(size, 1)))
    return (instructions(path, size, count) - instructions(path, size, 0)) // count


def table(sizes: list[int]) -> None:
    """Per-answer instructions of each path: the loop's, the worker thread's, the child's."""
    print(f"off_loop round trip (a big answer takes 2): {per_answer('hop', 0):,}")
    print("body B | small (loop) | big (thread kind) | big/small | big on loop | parent | child")
    for size in sizes:
        got = {path: per_answer(path, size) for path in PATHS[:-1]}
        on_loop = got["big-row"] - got["big-split"]
        print(f"{len(sim_body(size)):>7,} | {got['small']:>12,} | {got['big']:>17,} | "
              f"{got['big'] / got['small']:>9.2f} | {on_loop:>11,} | {got['parent']:>9,} | "
              f"{got['child']:>11,}")  # fmt: skip


def timed(work: Callable[[], object], count: int) -> float:
    """Microseconds an answer over ``count`` calls of ``work``."""
    started = time.perf_counter()
    for _ in range(count):
        work()
    return (time.perf_counter() - started) / count * 1e6


def time_table(sizes: list[int], rounds: int) -> None:
    """The loop's two paths timed in turn, ``rounds`` times a size: medians and ratio.

    ``big`` here is the whole split path in one thread (what an answer from
    ``SPLIT_BYTES`` to ``--offload-bytes`` costs the loop); the worker hops are
    not in it."""
    print("body B | parsed whole us | split us | split/whole (median of rounds, min-max)")
    for size in sizes:
        raw = sim_body(size)
        works = {path: path_work(path, raw) for path in ("small", "big")}
        count = min(2000, max(20, (4 << 20) // max(size, 1)))
        got: dict[str, list[float]] = {"small": [], "big": []}
        for turn in range(rounds):
            order = ("small", "big") if turn % 2 == 0 else ("big", "small")
            for path in order:
                got[path].append(timed(works[path], count))
        ratios = sorted(b / a for a, b in zip(got["small"], got["big"], strict=True))
        print(f"{len(raw):>7,} | {statistics.median(got['small']):>15,.1f} | "
              f"{statistics.median(got['big']):>8,.1f} | {statistics.median(ratios):.2f} "
              f"({ratios[0]:.2f}-{ratios[-1]:.2f})")  # fmt: skip


def line_bytes(line: object) -> bytes:
    assert isinstance(line, bytes | Pieces)
    if isinstance(line, Pieces):
        return b"".join(bytes(piece) for piece in line.parts)
    return bytes(line)


def smoke() -> None:
    """Each path once per size: the same row whichever path wrote it."""
    for size in SIZES:
        raw = sim_body(size)
        assert abs(len(raw) - size) < 64, (size, len(raw))
        lines = [line_bytes(path_work(path, raw)()) for path in ("small", "big", "parent")]
        rows = [orjson.loads(line) for line in lines]
        assert all(row.pop("_ng_dispatch")["rollout_id"] == "7-0" for row in rows), rows
        assert rows[0] == rows[1] == rows[2], size
        assert pickle.loads(path_work("child", raw)())[0] == "split"  # type: ignore[arg-type]
        print(f"{size:>8d} B body {len(raw):>8d} B: small, big, parent rows equal; child splits")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", choices=PATHS, default="small")
    parser.add_argument("--size", type=int, default=4 * KIB, help="body bytes (about)")
    parser.add_argument("--count", type=int, default=100, help="answers (0: set-up only)")
    parser.add_argument("--smoke", action="store_true", help="each path once per size, checked")
    parser.add_argument("--table", action="store_true", help="run valgrind, print per answer")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="for --table")
    parser.add_argument("--time", action="store_true", help="time the loop's two paths in turn")
    parser.add_argument("--rounds", type=int, default=9, help="for --time: alternated rounds")
    args = parser.parse_args()
    if args.smoke:
        smoke()
        return
    if args.table:
        table(args.sizes)
        return
    if args.time:
        time_table(args.sizes, args.rounds)
        return
    if args.path == "hop":
        asyncio.run(hops(args.count))
        return
    raw = sim_body(args.size)
    work = path_work(args.path, raw)
    # One call outside the count in both runs: lazy imports and caches are set-up.
    work()
    for _ in range(args.count):
        work()
    print(f"{args.path}: {args.count} answers of {len(raw)} B")


if __name__ == "__main__":
    main()
