"""Rows of megabytes: split off the loop, written as the agent's bytes, bounded in memory.

A big answer is split at its top level in a worker and its values are
written back as they came; its row must have exactly the content a parse and
merge would give. A failure in the worker is a failure row when the agent's
body is at fault, and a requeue (§11) when we are; never a hang.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import msgspec
import orjson
import pytest
from aiohttp import web

from dispatcher.admission.bytebudget import ByteBudget
from dispatcher.delivery.client import classify_response
from dispatcher.delivery.faults import LocalFault
from dispatcher.errors import ExitCode
from dispatcher.files import writer as store
from dispatcher.files.resume import OutputPaths
from dispatcher.outcome import Outcome
from dispatcher.rows import finalize as finalizer
from dispatcher.rows import offload
from dispatcher.rows.capture import attach_capture
from dispatcher.rows.jsonworker import WorkerProcess
from dispatcher.rows.wire import Split, WireResult, classify_big, row_line, split_body, wire_result
from dispatcher.sim.agent import TOKENS_KEY, token_logprobs_json
from tests.delivery.test_faults import agent_url
from tests.helpers import FakeAgent, in_process_run, read_jsonl, run_args, run_cli
from tests.rows.test_capture import USAGE, chat_answer, exchange_line, write_lines

__all__ = ["agent_url"]

OURS = {
    "_ng_task_index": 7,
    "_ng_rollout_index": 1,
    "agent_ref": {"name": "sim"},
    "_ng_dispatch": {"replica": "http://x", "duration_s": 0.25},
}
# Values whose text a float round trip would change: they must come out as they went in.
EXACT = (
    b'"big_int":123456789012345678901234567890,"neg_big":-98765432109876543210,'
    b'"floats":[0.1,1e308,-0.0,5e-324,3.141592653589793238462643383279],'
    b'"unicode":"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80 \\u00e9\\n\\"q\\"",'
    b'"nested":{"a":[{"b":null,"c":true,"d":false}],"\xc3\xa9t\xc3\xa9":{}}'
)


def big_body(*, extra: bytes = EXACT, row_bytes: int = 300_000) -> bytes:
    """An agent's answer: the task echoed back, exact values, and a big token list."""
    echoed = b'"_ng_task_index":7,"_ng_rollout_index":0,"agent_ref":{"name":"other"},"reward":1.0'
    tokens = b'"' + TOKENS_KEY.encode() + b'":' + token_logprobs_json(row_bytes)
    return b"{" + echoed + b"," + extra + b"," + tokens + b"}"


# The two ways a big body is classed: validated in a thread, or in the worker process.
CLASSIFIERS = {"thread": classify_big, "process": offload.classify_in_process}


def merged_line(raw: bytes, worker: str = "thread") -> bytes:
    outcome, result, failure = CLASSIFIERS[worker](200, raw)
    assert outcome is Outcome.SUCCESS and failure is None and result is not None
    return joined(row_line({**result, **OURS}))


def joined(line: store.Line) -> bytes:
    """A line as the bytes it puts in the file."""
    return line if isinstance(line, bytes) else b"".join(line.parts)


@pytest.mark.parametrize("worker", CLASSIFIERS)
def test_a_split_row_has_the_content_of_a_parse_and_merge(worker: str) -> None:
    raw = big_body()
    line = merged_line(raw, worker)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    # The stdlib keeps big ints exact: compare with it, keys in order too.
    expected = {**json.loads(raw), **OURS}
    written = json.loads(line)
    assert written == expected
    assert list(written) == list(expected)
    # Numbers keep the agent's own text, byte for byte.
    for text in (b"123456789012345678901234567890", b"3.141592653589793238462643383279"):
        assert text in line


def test_the_split_result_decodes_only_the_dispatchers_keys() -> None:
    _, result, _ = classify_big(200, big_body())
    assert isinstance(result, WireResult)
    assert result["_ng_task_index"] == 7
    assert not isinstance(result["nested"], dict)
    view = result.decoded()
    assert view["nested"] == {"a": [{"b": None, "c": True, "d": False}], "été": {}}
    assert view["big_int"] == 123456789012345678901234567890


@pytest.mark.parametrize(
    "body",
    [
        # Pretty-printed: its newlines must not reach the JSON-lines file.
        b'{\n  "a": [1,\n 2],\r\n  "b": "x"\n}',
        b'{"a":"x",\r"b":1}',
    ],
)
def test_bodies_the_splitter_cannot_vouch_for_take_the_full_parse(body: bytes) -> None:
    outcome, result, _ = classify_big(200, body)
    assert outcome is Outcome.SUCCESS and result is not None
    assert not isinstance(result, WireResult)
    line = joined(row_line({**result, **OURS}))
    assert line.count(b"\n") == 1
    assert json.loads(line) == {**json.loads(body), **OURS}


# Numbers the full parse refuses (beyond a float's range, an integer of more digits
# than it reads): skipping a value does not check them, so a body holding one
# must be classed as a small one is.
OUT_OF_RANGE = [
    big_body(extra=b'"x":1e400'),
    big_body(extra=b'"x":[-1E+400]'),
    big_body(extra=b'"x":{"y":1.8e308}'),
    big_body(extra=b'"x":1.7976931348623159e308'),
    big_body(extra=b'"x":1e0400'),
    big_body(extra=b'"x":1e99999999999999999999'),
    big_body(extra=b'"x":[1' + b"0" * 210 + b"e99]"),
    big_body(extra=b'"x":1' + b"0" * 310 + b".5"),
    big_body(extra=b'"x":-1' + b"0" * 408 + b"e-99"),
    big_body(extra=b'"x":' + b"9" * 4301),
    big_body(extra=b'"x":-' + b"9" * 4300),
]


@pytest.mark.parametrize(
    "body",
    [
        big_body()[:-1],  # truncated
        b"[" + big_body() + b"]",  # an array
        big_body(extra=b'"bad":"\xff\xfe"'),  # not UTF-8
        big_body(extra=b'"lone":"\\ud800"'),  # a lone surrogate
        big_body(extra=b'"lone":{"k":["a\\udc00b"]}'),
        big_body(extra=b'"lone":[{"\\ud83d\\u0041":1}]'),
        big_body(extra=b'"lone":"\\ude00\\ud83d"'),
        big_body(extra=b'"n":01'),
        b"",
        *OUT_OF_RANGE,
        # Mantissas longer than the guard looks back over: the full parse decides.
        big_body(extra=b'"x":0.' + b"1" * 100 + b"e309"),
        big_body(extra=b'"x":' + b"9" * 100 + b".5e300"),
    ],
)
@pytest.mark.parametrize("worker", CLASSIFIERS)
def test_a_big_body_is_classed_exactly_as_the_full_parse_classes_it(
    body: bytes, worker: str
) -> None:
    assert CLASSIFIERS[worker](200, body)[::2] == classify_response(200, body)[::2]


def test_escaped_surrogate_pairs_are_kept_as_written() -> None:
    body = big_body(extra=b'"emoji":["\\ud83d\\ude00","\\uD83D\\uDE00 x"]')
    _, result, _ = classify_big(200, body)
    assert isinstance(result, WireResult)
    line = joined(row_line({**result, **OURS}))
    assert b'"emoji":["\\ud83d\\ude00","\\uD83D\\uDE00 x"]' in line
    assert orjson.loads(line)["emoji"] == ["\U0001f600", "\U0001f600 x"]


@pytest.mark.parametrize(
    "body",
    [
        b'{"a":1,"a":2}',
        b'{"a":1,"a":1}',
        b'{"a":"xy","a":"z"}',
        b'{"a":[1,2],"b":3,"a":[1]}',
        b'{"a":1} {}',
    ],
)
def test_a_repeated_key_or_trailing_text_is_not_split(body: bytes) -> None:
    # The decoded dict folds a repeated key: only the full parse can say what it means.
    assert split_body(body) is None


def test_spans_find_values_between_any_whitespace_and_escaped_keys() -> None:
    body = b' {  "a" :\t1 , "k\\"x\\\\" :  "s\\"" ,"n":{"m":[]} }  '
    split = split_body(body)
    assert split is not None
    assert [(key, body[start:end]) for key, start, end in split.spans] == [
        ("a", b"1"),
        ('k"x\\', b'"s\\""'),
        ("n", b'{"m":[]}'),
    ]
    assert json.loads(joined(row_line({**wire_result(body, split), **OURS}))) == {
        **json.loads(body),
        **OURS,
    }


def test_a_joined_line_is_the_encoders_line() -> None:
    _, result, _ = classify_big(200, big_body())
    assert result is not None
    row = {**result, **OURS, "ünï": ["\u2028", 1.5, None]}
    assert joined(row_line(row)) == msgspec.json.encode(row) + b"\n"


def test_a_big_kept_value_is_written_from_the_body_not_copied() -> None:
    # Joining a slice of the body copies the row with the GIL held (bytes.join
    # lets go of it only for bytes parts): the loop stalled 60 ms per 20 MB row.
    raw = big_body()
    _, result, _ = classify_big(200, raw)
    assert result is not None
    line = row_line({**result, **OURS})
    assert isinstance(line, store.Pieces)
    (big,) = [part for part in line.parts if isinstance(part, memoryview)]
    assert big.nbytes > 300_000
    small = [part for part in line.parts if part is not big]
    assert all(isinstance(part, bytes) and len(part) < 10_000 for part in small)
    assert len(line) == len(joined(line)) == len(msgspec.json.encode({**result, **OURS})) + 1


def test_the_dispatchers_own_keys_class_a_big_answer() -> None:
    reported = big_body(extra=b'"_ng_failure_class":"sandbox_crashed","_ng_failure_terminal":true')
    outcome, result, _ = classify_big(200, reported)
    assert outcome is Outcome.AGENT_REPORTED_FAILURE
    assert result is not None and result["_ng_failure_terminal"] is True
    killed = big_body(extra=b'"_ng_no_persist":true')
    assert classify_big(200, killed)[0] is Outcome.KILL_SHAPED
    assert classify_big(500, killed)[0] is Outcome.AGENT_RUN_ERROR


# ---- through the worker ---------------------------------------------------------


async def test_a_worker_out_of_memory_is_our_fault_and_a_bug_is_too() -> None:
    def out_of_memory() -> None:
        raise MemoryError

    def bug() -> None:
        raise KeyError("oops")

    with pytest.raises(LocalFault) as memory:
        await offload.off_loop(out_of_memory)
    assert memory.value.kind == "MemoryError"
    with pytest.raises(LocalFault) as ours:
        await offload.off_loop(bug)
    assert ours.value.kind == "bug" and "oops" in ours.value.message


@pytest.mark.parametrize(
    "row_bytes",
    [32_000, 300_000, 3_000_000],
    ids=["split-on-the-loop", "through-the-parser", "read-into-its-own-buffer"],
)
async def test_big_rows_round_trip_through_the_cli(tmp_path: Path, row_bytes: int) -> None:
    # Over http1.DIRECT_BODY_BYTES, the body is a bytearray read by the socket
    # itself: validated by the worker process and written from, byte for byte.
    raw = big_body(row_bytes=row_bytes)
    agent = FakeAgent(lambda _: web.Response(body=raw, content_type="application/json"))
    await agent.start()
    try:
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_bytes(
            b"".join(b'{"agent_ref": {"name": "sim"}, "q": %d}\n' % i for i in range(3))
        )
        output = tmp_path / "out" / "x.jsonl"
        output.parent.mkdir()
        result = await run_cli(*run_args(tasks, output, agent.url, "--fsync", "never"))
    finally:
        await agent.close()
    assert result.returncode == 0, result.stderr[-3000:]
    lines = output.read_bytes().splitlines()
    assert len(lines) == 3
    run_id = json.loads((tmp_path / "out" / "x_manifest.json").read_bytes())["run_id"]
    for index, line in enumerate(sorted(lines, key=lambda x: json.loads(x)["_ng_task_index"])):
        row = json.loads(line)
        ours = {
            "_ng_task_index": index,
            "_ng_rollout_index": 0,
            "agent_ref": {"name": "sim"},
            "_ng_rollout_id": f"{index}-0",
            "_ng_run_id": run_id,
        }
        expected = {**json.loads(raw), **ours}
        assert {k: v for k, v in row.items() if k != "_ng_dispatch"} == expected
        assert b"123456789012345678901234567890" in line


@pytest.mark.parametrize(
    "row_bytes",
    [32_000, 300_000, 3_000_000],
    ids=["split-on-the-loop", "through-the-parser", "read-into-its-own-buffer"],
)
async def test_a_big_body_that_is_not_json_is_a_terminal_failure_row(
    tmp_path: Path, row_bytes: int
) -> None:
    raw = big_body(row_bytes=row_bytes)[:-1]
    agent = FakeAgent(lambda _: web.Response(body=raw, content_type="application/json"))
    await agent.start()
    try:
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_bytes(b'{"agent_ref": {"name": "sim"}}\n')
        output = tmp_path / "out" / "x.jsonl"
        output.parent.mkdir()
        result = await run_cli(*run_args(tasks, output, agent.url, "--fsync", "never"))
    finally:
        await agent.close()
    # Its one rollout is final, as protocol_violation: a run with nothing else is not done.
    assert result.returncode == 1, result.stderr[-3000:]
    (row,) = read_jsonl(OutputPaths.for_output(output).failures)
    assert row["_ng_failure_class"] == "protocol_violation"
    assert row["_ng_failure_terminal"] is True


@pytest.mark.parametrize("error", [MemoryError(), RuntimeError("a bug of ours")])
async def test_a_fault_in_the_worker_requeues_the_rollout(
    tmp_path: Path,
    agent_url: str,
    no_signal_handlers: None,
    monkeypatch: pytest.MonkeyPatch,
    error: BaseException,
) -> None:
    failed = 0

    def flaky_row_line(row: dict[str, Any]) -> bytes:
        nonlocal failed
        if failed < 2:
            failed += 1
            raise error
        return row_line(row)

    monkeypatch.setattr(finalizer, "row_line", flaky_row_line)
    # Every answer counts as big: each row is serialized in the worker.
    dispatcher = in_process_run(tmp_path, agent_url, 6, concurrency=3, offload_bytes=0)

    assert await asyncio.wait_for(dispatcher.run(), 60) is ExitCode.DONE

    paths = OutputPaths.for_output(tmp_path / "x.jsonl")
    assert len(read_jsonl(paths.output)) == 6
    assert read_jsonl(paths.failures) == []
    assert dispatcher.summary()["outcomes"] == {"success": 6, "requeued": 2}


async def test_a_fault_while_classing_in_the_worker_thread_requeues_the_rollout(
    tmp_path: Path, agent_url: str, no_signal_handlers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    failed = 0

    def flaky_classify(status: int, raw: bytes) -> Any:
        nonlocal failed
        if failed < 1:
            failed += 1
            raise MemoryError
        return classify_big(status, raw)

    monkeypatch.setattr(offload, "WORKER_KIND", "thread")
    monkeypatch.setattr(offload, "classify_big", flaky_classify)
    dispatcher = in_process_run(tmp_path, agent_url, 4, concurrency=2, offload_bytes=0)

    assert await asyncio.wait_for(dispatcher.run(), 60) is ExitCode.DONE

    assert len(read_jsonl(OutputPaths.for_output(tmp_path / "x.jsonl").output)) == 4
    assert dispatcher.summary()["outcomes"] == {"success": 4, "requeued": 1}


async def test_a_worker_process_that_died_requeues_the_rollout_and_is_replaced(
    tmp_path: Path, agent_url: str, no_signal_handlers: None
) -> None:
    worker = offload.worker_process()
    worker.split(b"{}")
    assert worker.pid is not None
    os.kill(worker.pid, signal.SIGKILL)
    dispatcher = in_process_run(tmp_path, agent_url, 4, concurrency=1, offload_bytes=0)

    assert await asyncio.wait_for(dispatcher.run(), 60) is ExitCode.DONE

    assert len(read_jsonl(OutputPaths.for_output(tmp_path / "x.jsonl").output)) == 4
    assert dispatcher.summary()["outcomes"] == {"success": 4, "requeued": 1}


async def test_a_worker_process_killed_while_a_body_is_on_its_way_is_our_fault() -> None:
    worker = WorkerProcess()
    try:
        worker.split(b"{}")
        assert worker.pid is not None
        # Stopped, it reads nothing: the body (bigger than the pipe) is still
        # being written when it dies.
        os.kill(worker.pid, signal.SIGSTOP)
        call = asyncio.create_task(asyncio.to_thread(worker.split, big_body(row_bytes=5_000_000)))
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(LocalFault) as fault:
            await asyncio.wait_for(call, 30)
        assert fault.value.kind == "worker_exited"
        assert worker.split(b'{"a":1}') == Split([("a", 5, 6)], {})
    finally:
        worker.close()


async def test_a_big_capture_merged_in_a_worker_gives_the_same_row(tmp_path: Path) -> None:
    # 50 calls of about 200 KB each.
    filler = "x" * 200_000
    lines = []
    for n in range(50):
        answer = chat_answer(n, USAGE)
        answer["choices"][0]["message"]["content"] = filler
        lines.append(exchange_line(answer))
    write_lines(tmp_path, "7-1", lines)
    _, result, _ = classify_big(200, big_body())
    assert isinstance(result, WireResult)

    def merge(row: dict[str, Any]) -> Any:
        return attach_capture(
            row,
            capture_dir=tmp_path,
            rollout_id="7-1",
            task_id=7,
            agent_result=result.decoded(),
            total_latency_ms=10.0,
        )

    on_loop = {**result, **OURS}
    await merge(on_loop)
    in_worker = {**result, **OURS}
    line, summary = await offload.off_loop(
        finalizer._merge_in_worker, lambda: merge(in_worker), in_worker
    )
    assert summary.num_calls == 50 and summary.gaps == []
    assert orjson.loads(joined(line)) == orjson.loads(joined(row_line(on_loop)))


# ---- the commit queue's byte budget ----------------------------------------------


async def test_the_byte_budget_admits_in_order_and_an_outsized_holder_alone() -> None:
    budget = ByteBudget(100)
    await budget.acquire(60)
    admitted: list[str] = []

    async def take(name: str, size: int) -> None:
        await budget.acquire(size)
        admitted.append(name)

    big = asyncio.create_task(take("outsized", 500))
    small = asyncio.create_task(take("small", 10))
    await asyncio.sleep(0)
    # The small one would fit, but the outsized one came first: no overtaking.
    assert admitted == []
    budget.release(60)
    await big
    assert admitted == ["outsized"] and budget.held == 500
    budget.release(500)
    await small
    assert admitted == ["outsized", "small"] and budget.held == 10


async def test_a_cancelled_waiter_leaves_nothing_held() -> None:
    budget = ByteBudget(100)
    await budget.acquire(100)
    waiter = asyncio.create_task(budget.acquire(50))
    behind = asyncio.create_task(budget.acquire(30))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    budget.release(100)
    await behind
    assert budget.held == 30


# ---- the writer's batch ------------------------------------------------------------


def test_a_batch_is_written_as_its_big_rows_and_its_small_ones_joined() -> None:
    big = b"x" * store.JOIN_BYTES
    small = [b"a" * (store.JOIN_BYTES // 2)] * 4
    chunks = list(store._chunks([b"1", b"2", big, *small, b"3"]))
    assert chunks[1] is big
    assert [len(chunk) for chunk in chunks] == [2, len(big), len(big), len(big), 1]
    assert b"".join(chunks) == b"".join([b"1", b"2", big, *small, b"3"])


def test_a_batch_writes_pieces_as_they_are_between_its_joined_small_rows() -> None:
    pieces = store.Pieces((b'{"a":', memoryview(b"1" * 10), b"}\n"), 17)
    chunks = list(store._chunks([b"1", pieces, b"2", b"3"]))
    assert chunks == [b"1", pieces, b"23"]


async def test_big_rows_in_pieces_are_appended_whole_between_others(tmp_path: Path) -> None:
    _, result, _ = classify_big(200, big_body())
    assert result is not None
    big = [row_line({**result, **OURS, "n": n}) for n in range(3)]
    assert all(isinstance(line, store.Pieces) for line in big)
    lines = [b'{"n":"a"}\n', big[0], big[1], b'{"n":"b"}\n', big[2]]
    writer = store.RowWriter(tmp_path / "x.jsonl", "batch")
    writer.open()
    await asyncio.gather(*(writer.append_line(line) for line in lines))
    await writer.close()
    assert (tmp_path / "x.jsonl").read_bytes() == b"".join(joined(line) for line in lines)


def test_pieces_are_written_whole_past_short_writes_and_the_iovec_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_writev = os.writev
    calls: list[int] = []

    def short_writev(fd: int, buffers: list[memoryview]) -> int:
        # What a write(2) interrupted by a signal, or a full pipe, returns.
        calls.append(len(buffers))
        return real_writev(fd, [memoryview(b"".join(buffers))[:7]])

    monkeypatch.setattr(os, "writev", short_writev)
    monkeypatch.setattr(store, "IOV_MAX", 3)
    parts = (b"abc", memoryview(b"defghijklmnop"), b"", b"qr", memoryview(b"stuvwxyz"), b"\n")
    path = tmp_path / "x"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        store.writev_all(fd, parts)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"abcdefghijklmnopqrstuvwxyz\n"
    assert max(calls) == 3 and len(calls) >= 4  # 6 parts, 27 bytes, 7 a call


async def test_a_batch_of_big_rows_is_appended_whole(tmp_path: Path) -> None:
    writer = store.RowWriter(tmp_path / "x.jsonl", "never")
    writer.open()
    lines = [b'{"n":%d,"x":"%s"}\n' % (n, b"y" * (n * 100_000)) for n in range(1, 6)]
    await asyncio.gather(*(writer.append_line(line) for line in lines))
    await writer.close()
    assert (tmp_path / "x.jsonl").read_bytes() == b"".join(lines)
    assert writer.rows_written == 5


async def test_a_batch_that_reaches_its_bytes_is_committed_without_waiting_out_the_window(
    tmp_path: Path,
) -> None:
    # Big rows: the commit queue's byte bound lets few more in while the window
    # waits, so a batch of max_bytes goes at once (a 10-minute window would time out).
    writer = store.RowWriter(tmp_path / "x.jsonl", "batch", interval_s=600, max_bytes=1000)
    writer.open()
    first = writer.submit(b'{"n":1}\n')
    big = writer.submit(b'{"x":"%s"}\n' % (b"y" * 1000))
    assert await asyncio.wait_for(asyncio.gather(first, big), 30) == [None, None]
    await writer.close()
    assert writer.rows_written == 2
