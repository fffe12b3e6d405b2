"""The service bounded by its settings whatever its clients do (contracts §12), through
real sockets: `dispatcher serve` in a subprocess, raw TCP clients that misbehave.

Results streams: a client that reads nothing holds the stream's buffer and no more,
and is cut after the idle timeout; streams over --max-streams are a 503; a client
cut that way resumes with after= and gets every row once. Requests: a client that
never finishes its headers is closed; bodies wait for room under
--max-body-bytes-in-flight before they are read. No sleeps: every wait is on what the
daemon says (its log, /status) or on the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from dispatcher.client import AsyncClient
from dispatcher.serve.bodies import BodyBudget, NoRoom
from dispatcher.settings.serve import SERVE_LIMIT_FLAGS
from tests.helpers import FakeAgent, run_cli, wait_until
from tests.serve.test_service_e2e import Serve, rows

pytestmark = pytest.mark.timeout(180)

PAD_BYTES = 64 * 1024
BUFFER_BYTES = 64 * 1024


def padded(body: dict[str, Any]) -> web.StreamResponse:
    """An agent's answer of about PAD_BYTES: rows big enough to fill buffers."""
    return web.json_response({"reward": 1.0, "pad": "x" * PAD_BYTES})


@pytest.fixture
async def big_agent() -> AsyncIterator[FakeAgent]:
    agent = FakeAgent(padded)
    await agent.start()
    yield agent
    await agent.close()


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def address(serve: Serve) -> tuple[str, int]:
    """The daemon's host and port, for a raw socket."""
    host, port = serve.url.removeprefix("http://").split(":")
    return host, int(port)


async def raw_get(serve: Serve, path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A GET sent on a raw socket that then reads nothing (its receive buffer small)."""
    host, port = address(serve)
    reader, writer = await asyncio.open_connection(host, port, limit=1024)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    await writer.drain()
    return reader, writer


async def status(serve: Serve) -> dict[str, Any]:
    async with serve.http.get(f"{serve.url}/status") as r:
        data: dict[str, Any] = await r.json()
        return data


async def closed(reader: asyncio.StreamReader) -> bool:
    """Whether the daemon closed the connection (read to its end, or reset)."""
    try:
        while await reader.read(1 << 16):
            pass
    except ConnectionResetError:
        pass
    return True


@pytest.mark.parametrize("group", [False, True])
async def test_streams_that_read_nothing_hold_their_buffer_and_are_cut_when_idle(
    tmp_path: Path, big_agent: FakeAgent, group: bool
) -> None:
    flags = ("--stream-buffer-bytes", str(BUFFER_BYTES), "--stream-idle-timeout-s", "1")
    serve = await Serve.start(tmp_path / "state", big_agent.url, *flags)
    try:
        # 400 rows of 64 KiB (25 MiB), in groups of 4: a chunk of the old kind
        # (64 lines) held 4 MiB per stream, and 64 groups 16 MiB.
        await serve.submit(job_id="big", rows=rows(100), num_repeats=4)
        await wait_until(serve.in_state("big", "done"), timeout_s=60)
        before = rss_kb(serve.proc.proc.pid)
        path = f"/v1/jobs/big/results?wait=true&group={str(group).lower()}"
        clients = [await raw_get(serve, path) for _ in range(16)]
        await wait_until(lambda: len(cuts(serve)) == 16, timeout_s=60)
        grown_mb = (rss_kb(serve.proc.proc.pid) - before) / 1024
        # The old stream held 64+ MiB for these; the bound is 16 x (64 KiB + a chunk).
        assert grown_mb < 24, grown_mb
        for reader, writer in clients:
            assert await asyncio.wait_for(closed(reader), timeout=30)
            writer.close()
        assert (await status(serve))["streams_open"] == 0
    finally:
        assert await serve.stop() == 0


def cuts(serve: Serve) -> list[dict[str, Any]]:
    return [e for e in serve.proc.events() if e.get("event") == "results_stream_cut"]


async def test_a_client_cut_for_idleness_resumes_with_after_and_gets_every_row_once(
    tmp_path: Path, big_agent: FakeAgent
) -> None:
    flags = ("--stream-buffer-bytes", str(BUFFER_BYTES), "--stream-idle-timeout-s", "1")
    serve = await Serve.start(tmp_path / "state", big_agent.url, *flags)
    try:
        await serve.submit(job_id="big", rows=rows(100), num_repeats=4)
        await wait_until(serve.in_state("big", "done"), timeout_s=60)
        seqs: list[int] = []
        async with AsyncClient(serve.url, retry_deadline_s=60) as client:
            lines = client.results("big")
            seqs.append((await anext(lines))["_ng_seq"])
            # The consumer stalls until the daemon cuts its stream, then reads on.
            await wait_until(lambda: len(cuts(serve)) == 1, timeout_s=60)
            seqs.extend([row["_ng_seq"] async for row in lines])
        assert seqs == list(range(1, 401))
    finally:
        assert await serve.stop() == 0


async def test_streams_over_max_streams_are_a_503_with_retry_after(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    serve = await Serve.start(tmp_path / "state", gated_agent.url, "--max-streams", "2")
    try:
        await serve.submit(job_id="held", rows=rows(1))
        path = "/v1/jobs/held/results?wait=true"
        first = await raw_get(serve, path)
        second = await raw_get(serve, path)
        await wait_until(lambda: _streams_open(serve, 2), timeout_s=30)
        async with serve.http.get(f"{serve.url}{path}") as r:
            body = await r.read()
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            assert b"\n" not in body.strip() and b"--max-streams" in body
        first[1].close()
        await wait_until(lambda: _streams_open(serve, 1), timeout_s=30)
        gated_agent.open()
        lines = await serve.results("held", wait=True)
        assert lines[-1] == {"end": "done"}
        second[1].close()
        await wait_until(final(serve, "held"), timeout_s=60)
    finally:
        assert await serve.stop() == 0


async def _streams_open(serve: Serve, count: int) -> bool:
    return bool((await status(serve))["streams_open"] == count)


async def test_a_client_that_never_finishes_its_headers_is_closed(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    serve = await Serve.start(tmp_path / "state", gated_agent.url, "--header-timeout-s", "1")
    try:
        host, port = address(serve)
        slow = [await asyncio.open_connection(host, port) for _ in range(5)]
        for _, writer in slow:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            await writer.drain()
        for reader, writer in slow:
            # Closed by the daemon: EOF, without an answer.
            assert await asyncio.wait_for(reader.read(), timeout=30) == b""
            writer.close()
        async with serve.http.get(f"{serve.url}/healthz") as r:
            assert r.status == 200
    finally:
        assert await serve.stop() == 0


async def test_bodies_wait_for_room_under_max_body_bytes_in_flight_as_their_bytes_arrive(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    mib = 1024 * 1024
    flags = ("--max-body-bytes", str(mib), "--max-body-bytes-in-flight", str(mib))
    serve = await Serve.start(tmp_path / "state", gated_agent.url, *flags)
    try:
        host, port = address(serve)
        reader, writer = await asyncio.open_connection(host, port)
        # A client that sends all but 10 bytes of a 1 MiB body and stops: the
        # bytes it sent hold the room.
        sent = mib - 10
        writer.write(
            f"POST /v1/jobs HTTP/1.1\r\nHost: {host}\r\nContent-Length: {mib}\r\n"
            "Content-Type: application/json\r\n\r\n".encode()
            + b"{" * sent
        )
        await writer.drain()
        await wait_until(lambda: _held(serve, sent, 0), timeout_s=30)
        second = asyncio.create_task(serve.submit(job_id="small", rows=rows(1)))
        await wait_until(lambda: _held(serve, sent, 1), timeout_s=30)
        assert not second.done()
        writer.close()
        gated_agent.open()
        await second
        await wait_until(final(serve, "small"), timeout_s=60)
        too_big = io.BytesIO(b" " * (mib + 1))
        async with serve.http.post(f"{serve.url}/v1/jobs", data=too_big) as r:
            assert r.status == 413 and "--max-body-bytes" in (await r.json())["error"]
        with contextlib.suppress(ConnectionError):
            await reader.read()
    finally:
        gated_agent.open()
        assert await serve.stop() == 0


async def _held(serve: Serve, held: int, waiting: int) -> bool:
    now = await status(serve)
    return bool(now["request_bytes_held"] == held and now["requests_waiting"] == waiting)


async def test_loose_types_deep_json_and_oversized_jobs_are_refused_naming_why(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    flags = ("--max-job-rollouts", "10", "--max-job-bytes", "100000")
    serve = await Serve.start(tmp_path / "state", gated_agent.url, *flags)
    deep = b'{"rows": [{"agent_ref": {"name": "sim"}, "x": ' + b"[" * 300 + b"]" * 300 + b"}]}"
    bad = {
        orjson.dumps({"rows": rows(1), "num_repeats": True}): (400, "num_repeats:"),
        orjson.dumps({"rows": rows(1), "num_repeats": "3"}): (400, "num_repeats:"),
        orjson.dumps({"rows": rows(1), "num_repeats": 2.0}): (400, "num_repeats:"),
        orjson.dumps({"rows": rows(1), "priority": "1"}): (400, "priority:"),
        deep: (400, "body: JSON nested deeper than 64 levels"),
        orjson.dumps({"rows": rows(3), "num_repeats": 4}): (400, "--max-job-rollouts 10"),
        orjson.dumps({"rows": rows(2, pad="y" * 20_000), "num_repeats": 4}): (
            413,
            "--max-job-bytes 100000",
        ),
    }
    try:
        for body, (code, message) in bad.items():
            async with serve.http.post(f"{serve.url}/v1/jobs", data=body) as r:
                text = await r.text()
                assert r.status == code, (body[:80], text)
                error = orjson.loads(text)["error"]
                assert message in error and "\n" not in error, (body[:80], error)
        assert list((tmp_path / "state" / "jobs").iterdir()) == []
        gated_agent.open()
        await serve.submit(job_id="fits", rows=rows(2), num_repeats=5)
        await wait_until(final(serve, "fits"), timeout_s=60)
    finally:
        gated_agent.open()
        assert await serve.stop() == 0


async def test_a_jobs_responses_create_params_count_toward_max_job_bytes_once_per_row(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    # Merged into each of 100 rows, 64 KiB of params is ~6.5 MB materialized:
    # six times the bound, though the body is 64 KiB.
    serve = await Serve.start(tmp_path / "state", gated_agent.url, "--max-job-bytes", "1000000")
    params = {"instructions": "p" * (64 << 10)}
    try:
        body = orjson.dumps({"rows": rows(100), "responses_create_params": params})
        async with serve.http.post(f"{serve.url}/v1/jobs", data=body) as r:
            text = await r.text()
        assert r.status == 413, text
        error = orjson.loads(text)["error"]
        assert error.startswith("responses_create_params: ") and "\n" not in error, error
        assert "100 rows" in error and "--max-job-bytes 1000000" in error, error
        assert list((tmp_path / "state" / "jobs").iterdir()) == []
        # The same params on 9 rows fit (9 x 64 KiB and the rows' bytes).
        gated_agent.open()
        await serve.submit(job_id="fits", rows=rows(9), responses_create_params=params)
        await wait_until(serve.in_state("fits", "done"), timeout_s=60)
    finally:
        gated_agent.open()
        assert await serve.stop() == 0


async def test_rows_live_in_the_jobs_file_and_a_finished_job_keeps_none_across_a_restart(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    state = tmp_path / "state"
    body = {"job_id": "j", "rows": rows(3, secret_row_text="r0w-text"), "num_repeats": 2}
    serve = await Serve.start(state, gated_agent.url)
    try:
        await serve.submit(**body)
        folder = state / "jobs" / "j"
        # Written once it is answered (its journal line is the durable copy).
        await wait_until(lambda: (folder / "job.json").exists())
        record = (folder / "job.json").read_bytes()
        # One line, no rows: they are in the job's own task file, once.
        assert record.count(b"\n") == 1 and b"r0w-text" not in record
        assert orjson.loads(record)["rows_file"] == "input.jsonl"
        assert (folder / "input.jsonl").read_bytes().count(b"r0w-text") == 3
        gated_agent.open()
        await wait_until(final(serve, "j"), timeout_s=60)
        done = await serve.job("j")
        assert (await status(serve))["jobs_running_in_memory"] == 0
        # The same body again is the same job; another body for its id is a 409.
        assert await serve.submit(expect=200, **body) == done
        await serve.submit(expect=409, **{**body, "num_repeats": 3})
    finally:
        assert await serve.stop() == 0
    again = await Serve.start(state, gated_agent.url)
    try:
        assert await again.job("j") == done
        assert (await status(again))["jobs_running_in_memory"] == 0
        assert await again.submit(expect=200, **body) == done
        await again.submit(expect=409, **{**body, "rows": rows(3)})
        lines = await again.results("j", group=True, wait=True)
        assert [len(line["rows"]) for line in lines[:-1]] == [2, 2, 2]
        assert lines[-1] == {"end": "done"}
    finally:
        assert await again.stop() == 0


def final(serve: Serve, job_id: str) -> Any:
    """A condition: the job is final (handed over as such: its status says so)."""

    async def check() -> bool:
        return bool((await serve.job(job_id))["final"])

    return check


SERVICE_DOC = Path(__file__).resolve().parents[2] / "docs" / "service.md"


async def test_every_bound_is_in_serve_help_and_in_the_docs_table_once() -> None:
    help_text = (await run_cli("serve", "--help")).stdout
    section = SERVICE_DOC.read_text().split("\n### Bounds whatever the clients do\n", 1)[1]
    table = [line for line in section.split("\n#", 1)[0].splitlines() if line.startswith("| `--")]
    listed = [line.split("`")[1].split()[0] for line in table]
    assert sorted(listed) == sorted(SERVE_LIMIT_FLAGS)
    assert all(flag in help_text for flag in SERVE_LIMIT_FLAGS)


async def test_a_bad_bound_is_exit_2_naming_the_flag(tmp_path: Path) -> None:
    for flags, named in (
        (("--max-streams", "0"), "--max-streams"),
        (("--stream-idle-timeout-s", "soon"), "--stream-idle-timeout-s"),
        (("--max-body-bytes", "2000000", "--max-body-bytes-in-flight", "1000000"),
         "--max-body-bytes-in-flight"),
    ):  # fmt: skip
        result = await run_cli(
            "serve", "--state-dir", str(tmp_path / "s"), "--agent", "a=http://127.0.0.1:9", *flags
        )
        assert result.returncode == 2 and named in result.stderr, result.stderr[-500:]


async def test_a_stalled_body_holds_only_its_bytes_and_is_cut_at_the_body_deadline(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    serve = await Serve.start(tmp_path / "state", gated_agent.url, "--body-timeout-s", "2")
    try:
        host, port = address(serve)
        reader, writer = await asyncio.open_connection(host, port)
        # Announces the whole body budget (256 MiB), sends 9 bytes, goes quiet.
        writer.write(
            f"POST /v1/policy HTTP/1.1\r\nHost: {host}\r\nContent-Length: {256 * 1024 * 1024}\r\n"
            'Content-Type: application/json\r\n\r\n{"version'.encode()
        )
        await writer.drain()
        await wait_until(lambda: _held(serve, 9, 0), timeout_s=30)
        # The control plane answers meanwhile: nothing was held for bytes not sent.
        for path, body in (("/v1/policy", {"version": 4}), ("/v1/admission", {"paused": False})):
            call = serve.http.post(f"{serve.url}{path}", json=body)
            async with await asyncio.wait_for(call, timeout=30) as r:
                assert r.status == 200, await r.text()
        await asyncio.wait_for(serve.submit(job_id="meanwhile", rows=rows(1)), timeout=30)
        # The stalled body is cut at its deadline: a 408 naming the flag, then the close.
        answer = await asyncio.wait_for(reader.read(), timeout=30)
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.split()[1] == b"408", answer
        error = orjson.loads(payload)["error"]
        assert "--body-timeout-s 2" in error and "9 of 268435456 bytes" in error, error
        writer.close()
        await wait_until(lambda: _held(serve, 0, 0), timeout_s=30)
    finally:
        gated_agent.open()
        assert await serve.stop() in (0, 75)


async def test_bodies_that_all_wait_for_room_let_the_youngest_give_way() -> None:
    budget = BodyBudget(100)
    async with budget.reading() as old:
        await budget.take(old, 60)

        async def young_body() -> None:
            async with budget.reading() as young:
                await budget.take(young, 30)
                await budget.take(young, 20)  # no room: waits for the old one

        young = asyncio.create_task(young_body())
        await wait_until(lambda: budget.waiting == 1)
        # Now both would wait for ever: the young one gives its bytes back.
        await budget.take(old, 20)
        with pytest.raises(NoRoom, match="--max-body-bytes-in-flight 100"):
            await young
        assert budget.held == 80
    assert budget.held == budget.waiting == 0


async def test_a_jobs_task_line_over_the_bound_is_a_400_naming_file_and_line(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    line = {"agent_ref": {"name": "sim"}, "responses_create_params": {"input": "q"}}
    tasks.write_bytes(
        orjson.dumps(line) + b"\n" + orjson.dumps({**line, "pad": "x" * 5000}) + b"\n"
    )
    serve = await Serve.start(
        tmp_path / "state", gated_agent.url, "--input-root", str(tmp_path),
        "--max-task-line-bytes", "4096",
    )  # fmt: skip
    try:
        async with serve.http.post(f"{serve.url}/v1/jobs", json={"input": str(tasks)}) as r:
            status, error = r.status, orjson.loads(await r.text())["error"]
    finally:
        assert await serve.stop() == 0
    assert status == 400
    assert error == f"{tasks}:2: a task line is longer than --max-task-line-bytes (4096 bytes)"
