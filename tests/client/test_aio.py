"""dispatcher.client without the daemon: requests it builds, streams it parses, peers it survives.

The end-to-end tests against a real ``dispatcher serve`` are in
``test_client_e2e.py``. Here the only server is a *peer behaving badly*: a
stand-in for the daemon's results stream that cuts connections mid-line,
restarts, answers 503 or resends rows, to show the client's resume contract.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import orjson
import pytest
from aiohttp import web

from dispatcher.client import (
    AsyncClient,
    Client,
    ClientError,
    JobState,
    JobStatus,
    NdjsonSplitter,
    StreamPosition,
    error_message,
    job_path,
    results_query,
    submit_body,
)
from dispatcher.delivery.retry import BackoffPolicy
from dispatcher.telemetry.http_app import start_site
from tests.helpers import serve

FAST = BackoffPolicy(base_s=0.01, cap_s=0.05)

# --- requests ----------------------------------------------------------------------


def test_job_path_quotes_the_id_as_one_segment() -> None:
    assert job_path("step-3") == "/v1/jobs/step-3"
    assert job_path("a/b c", "/results") == "/v1/jobs/a%2Fb%20c/results"


def test_results_query_spells_every_parameter() -> None:
    assert results_query(0, False, True) == "after=0&group=false&wait=true"
    assert results_query(17, True, False) == "after=17&group=true&wait=false"


def test_submit_body_sends_only_what_was_given() -> None:
    assert submit_body([{"q": 1}], None, job_id=None, priority=None) == {"rows": [{"q": 1}]}
    body = submit_body(
        None, Path("tasks") / "step.jsonl", job_id="s1", num_repeats=4, policy_version=0
    )
    assert body == {
        "input": str(Path("tasks") / "step.jsonl"),
        "job_id": "s1",
        "num_repeats": 4,
        "policy_version": 0,
    }


def test_submit_body_holds_a_dict_of_each_mapping_it_is_given() -> None:
    """Any mapping (not only a dict) for the object fields: the JSON encoder takes dicts."""
    given = MappingProxyType({"a": 1})
    body = submit_body(None, None, metadata=given, target_groups_by_agent=given)
    assert type(body["metadata"]) is dict and body["metadata"] == {"a": 1}
    assert type(body["target_groups_by_agent"]) is dict
    body = submit_body(None, None, responses_create_params=given)
    assert type(body["responses_create_params"]) is dict


def test_error_message_is_the_daemons_one_line() -> None:
    assert error_message(b'{"error": "rows: not a list"}', "Bad Request") == "rows: not a list"
    assert error_message(b"<html>\nBad gateway</html>", "Bad Gateway") == "<html>"
    assert error_message(b"", "Not Found") == "Not Found"


def test_job_status_parses_and_ignores_unknown_fields() -> None:
    body = {
        "job_id": "s1",
        "state": "running",
        "final": False,
        "priority": 2,
        "policy_version": 5,
        "expected": 8,
        "done": 3,
        "remaining": 5,
        "in_flight": 4,
        "outcomes": {"success": 3},
        "eta_s": 12.5,
        "output": "jobs/s1/rollouts.jsonl",
        "error": None,
        "added_later": {"x": 1},
    }
    status = JobStatus.from_json(body)
    assert status.state is JobState.RUNNING
    assert (status.done, status.remaining, status.outcomes) == (3, 5, {"success": 3})
    with pytest.raises(ClientError, match="bad job status"):
        JobStatus.from_json({**body, "state": "exploded"})
    with pytest.raises(ClientError, match="bad job status"):
        JobStatus.from_json({"state": "done"})


# --- the NDJSON stream -------------------------------------------------------------


def stream_bytes(items: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(item) + b"\n" for item in items)


def test_lines_cut_at_every_byte_boundary_come_out_whole() -> None:
    items = [{"_ng_seq": i, "text": "é" * i, "nested": {"a": [i]}} for i in range(1, 6)]
    raw = stream_bytes(items)
    for cut in range(len(raw) + 1):
        splitter = NdjsonSplitter()
        lines = splitter.feed(raw[:cut]) + splitter.feed(raw[cut:])
        assert [orjson.loads(line) for line in lines] == items
        assert not splitter.partial


def test_a_big_line_in_small_chunks_and_keepalive_blank_lines() -> None:
    big = {"_ng_seq": 1, "blob": "x" * 1_000_000}
    raw = b"\n\r\n" + stream_bytes([big]) + b"\n" + stream_bytes([{"_ng_seq": 2}])
    splitter = NdjsonSplitter()
    lines: list[bytes] = []
    for start in range(0, len(raw), 65_536):
        lines += splitter.feed(raw[start : start + 65_536])
    assert [orjson.loads(line)["_ng_seq"] for line in lines] == [1, 2]


def test_a_stream_cut_mid_line_leaves_a_partial_line() -> None:
    splitter = NdjsonSplitter()
    assert splitter.feed(b'{"_ng_seq": 1}\n{"_ng_se') == [b'{"_ng_seq": 1}']
    assert splitter.partial


def test_position_yields_each_seq_once_and_stops_at_the_end_line() -> None:
    position = StreamPosition(last_seq=2)
    assert position.accept(b'{"_ng_seq": 2, "r": 0}') is None  # already yielded
    assert position.accept(b'{"_ng_seq": 5, "r": 1}') == {"_ng_seq": 5, "r": 1}
    assert position.accept(b'{"_ng_seq": 4}') is None
    assert position.last_seq == 5
    assert position.accept(b'{"end": "incomplete"}') is None
    assert position.final_state is JobState.INCOMPLETE
    # contracts §12 words it as ``{"end": status}``: a status object is read too.
    assert position.accept(b'{"end": {"job_id": "s", "state": "cancelled"}}') is None
    assert position.final_state is JobState.CANCELLED


@pytest.mark.parametrize(
    ("line", "match"),
    [
        (b"[1]", "not an object"),
        (b'{"row": 1}', "without _ng_seq"),
        (b"{oops", "not JSON"),
        (b'{"end": "exploded"}', "unknown state"),
        (b'{"_ng_seq": "7"}', "bad _ng_seq"),
    ],
)
def test_position_rejects_lines_outside_the_contract(line: bytes, match: str) -> None:
    with pytest.raises(ClientError, match=match):
        StreamPosition().accept(line)


# --- peers behaving badly -------------------------------------------------------------


class BadResultsPeer:
    """A peer behaving badly: the daemon's results stream, cut, refused or repeated.

    ``plans`` says what each successive connection gets: an int N sends N
    lines after ``after`` then half of the next one and drops the connection;
    ``"503"`` answers 503; ``"resend"`` ignores ``after`` and sends everything;
    ``"hold"`` sends one line and waits for ``release`` (a daemon about to be
    killed); ``"stall"`` sends one line and then nothing (a half-open
    connection). Past the plans it streams the rest and the end line, in 7-byte
    writes so lines straddle chunks.
    """

    def __init__(self, lines: list[dict[str, Any]], plans: list[int | str]) -> None:
        self.lines = lines
        self.plans = list(plans)
        self.afters: list[int] = []
        self.queries: list[dict[str, str]] = []
        self.holding = asyncio.Event()
        self.release = asyncio.Event()
        self.consumed = 0
        self._consumed_grew = asyncio.Event()

    def saw(self, seq: int) -> None:
        """The consumer yielded the row ``seq``."""
        self.consumed = seq
        self._consumed_grew.set()

    async def until_consumed(self, seq: int) -> None:
        while self.consumed < seq:
            self._consumed_grew.clear()
            await self._consumed_grew.wait()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/jobs/{job_id}/results", self.results)
        return app

    async def results(self, request: web.Request) -> web.StreamResponse:
        after = int(request.query["after"])
        self.afters.append(after)
        self.queries.append(dict(request.query))
        plan = self.plans.pop(0) if self.plans else "complete"
        if plan == "503":
            return web.json_response({"error": "starting"}, status=503)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        pending = [line for line in self.lines if plan == "resend" or line["_ng_seq"] > after]
        if isinstance(plan, int) or plan in ("hold", "stall"):
            count = 1 if plan in ("hold", "stall") else int(plan)
            hold, stall = plan == "hold", plan == "stall"
            await self.send_then_drop(request, response, pending, count, hold=hold, stall=stall)
            return response
        await self.write_slowly(response, stream_bytes(pending) + b'{"end": "done"}\n')
        await response.write_eof()
        return response

    async def send_then_drop(
        self,
        request: web.Request,
        response: web.StreamResponse,
        pending: list[Any],
        n: int,
        *,
        hold: bool = False,
        stall: bool = False,
    ) -> None:
        await self.write_slowly(response, stream_bytes(pending[:n]))
        if n < len(pending):
            await response.write(orjson.dumps(pending[n])[:9])
        if n:
            await self.until_consumed(pending[min(n, len(pending)) - 1]["_ng_seq"])
        if hold:
            self.holding.set()
            await self.release.wait()
        if stall:
            await self.release.wait()  # silent until the client has given up on it
        assert request.transport is not None
        request.transport.close()

    async def write_slowly(self, response: web.StreamResponse, raw: bytes) -> None:
        for start in range(0, len(raw), 7):
            await response.write(raw[start : start + 7])


def rows(count: int) -> list[dict[str, Any]]:
    return [{"_ng_seq": seq, "_ng_task_index": seq // 2} for seq in range(1, count + 1)]


@pytest.fixture
async def bad_peer() -> AsyncIterator[Any]:
    runners: list[web.AppRunner] = []

    async def start(peer: BadResultsPeer) -> str:
        runner, url = await serve(peer.app())
        runners.append(runner)
        return url

    yield start
    for runner in runners:
        await runner.cleanup()


async def collect(
    client: AsyncClient, peer: BadResultsPeer | None = None, **kwargs: Any
) -> tuple[list[int], JobState | None]:
    """The seqs a consumer of ``step-1`` gets, each reported to ``peer`` as yielded."""
    results = client.results("step-1", **kwargs)
    seqs = []
    async for item in results:
        seqs.append(item["_ng_seq"])
        if peer is not None:
            peer.saw(item["_ng_seq"])
    return seqs, results.final_state


async def test_a_stream_cut_mid_line_resumes_after_the_last_seq(bad_peer: Any) -> None:
    peer = BadResultsPeer(rows(10), plans=[3, 0, 4])
    async with AsyncClient(await bad_peer(peer), backoff=FAST) as client:
        seqs, final = await collect(client, peer, group=True)
    assert seqs == list(range(1, 11))
    assert final is JobState.DONE
    assert peer.afters == [0, 3, 3, 7]
    assert {q["group"] for q in peer.queries} == {"true"}


async def test_resume_from_a_caller_given_seq(bad_peer: Any) -> None:
    peer = BadResultsPeer(rows(6), plans=[1])
    async with AsyncClient(await bad_peer(peer), backoff=FAST) as client:
        seqs, _ = await collect(client, peer, after=2)
    assert seqs == [3, 4, 5, 6]
    assert peer.afters == [2, 3]


async def test_a_peer_that_resends_everything_yields_nothing_twice(bad_peer: Any) -> None:
    peer = BadResultsPeer(rows(5), plans=[2, "resend"])
    async with AsyncClient(await bad_peer(peer), backoff=FAST) as client:
        seqs, final = await collect(client, peer)
    assert seqs == [1, 2, 3, 4, 5]
    assert final is JobState.DONE


async def test_a_silent_stream_is_reconnected_after_the_idle_timeout(bad_peer: Any) -> None:
    peer = BadResultsPeer(rows(4), plans=["stall"])
    url = await bad_peer(peer)
    async with AsyncClient(url, backoff=FAST, stream_idle_timeout_s=0.2) as client:
        seqs, final = await collect(client, peer)
    peer.release.set()
    assert seqs == [1, 2, 3, 4]
    assert final is JobState.DONE
    assert peer.afters == [0, 1]


async def test_503_while_the_daemon_starts_is_retried(bad_peer: Any) -> None:
    peer = BadResultsPeer(rows(3), plans=["503", "503"])
    async with AsyncClient(await bad_peer(peer), backoff=FAST) as client:
        seqs, _ = await collect(client)
    assert seqs == [1, 2, 3]
    assert peer.afters == [0, 0, 0]


async def test_retries_stop_at_the_deadline(bad_peer: Any) -> None:
    peer = BadResultsPeer(rows(3), plans=["503"] * 1_000)
    url = await bad_peer(peer)
    async with AsyncClient(url, backoff=FAST, retry_deadline_s=0.3) as client:
        with pytest.raises(ClientError, match=r"no answer within 0\.3 s.*503: starting") as caught:
            await collect(client)
    # No answer: the infrastructure's failure, as a trainer's typed retries read it.
    assert (caught.value.http_status, caught.value.status) == (None, 503)


async def test_without_wait_a_clean_end_is_caught_up(bad_peer: Any) -> None:
    peer = BadResultsPeer(rows(3), plans=[])

    async def caught_up(request: web.Request) -> web.StreamResponse:
        peer.afters.append(int(request.query["after"]))
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        await response.write(stream_bytes(rows(2)))
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/v1/jobs/{job_id}/results", caught_up)
    runner, url = await serve(app)
    try:
        async with AsyncClient(url, backoff=FAST) as client:
            seqs, final = await collect(client, wait=False)
    finally:
        await runner.cleanup()
    assert seqs == [1, 2]
    assert final is None
    assert peer.afters == [0]


async def test_a_4xx_is_raised_at_once_with_the_daemons_message() -> None:
    async def not_found(request: web.Request) -> web.Response:
        return web.json_response({"error": "no job 'step-1'"}, status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", not_found)
    runner, url = await serve(app)
    try:
        async with AsyncClient(url, backoff=FAST) as client:
            with pytest.raises(ClientError) as caught:
                await collect(client)
            assert (caught.value.status, caught.value.message) == (404, "no job 'step-1'")
            with pytest.raises(ClientError, match="404: no job"):
                await client.status("step-1")
    finally:
        await runner.cleanup()


async def test_404_after_a_restart_is_retried_for_a_job_streamed_before() -> None:
    lines = rows(4)
    first = BadResultsPeer(lines, plans=[2])
    unknown_then_known = BadResultsPeer(lines, plans=[])
    calls = 0

    async def results(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        if calls == 1:
            return await first.results(request)
        if calls == 2:  # the restarted daemon, its registry not loaded yet
            return web.json_response({"error": "job_id: no job 'step-1'"}, status=404)
        return await unknown_then_known.results(request)

    app = web.Application()
    app.router.add_get("/v1/jobs/{job_id}/results", results)
    runner, url = await serve(app)
    try:
        async with AsyncClient(url, backoff=FAST) as client:
            seqs, final = await collect(client, first)
    finally:
        await runner.cleanup()
    assert seqs == [1, 2, 3, 4]
    assert final is JobState.DONE
    assert unknown_then_known.afters == [2]


async def test_a_daemon_restart_on_the_same_port_is_survived() -> None:
    lines = rows(6)
    first = BadResultsPeer(lines, plans=["hold"])
    runner, port = await start_site(first.app(), "127.0.0.1", 0)
    second_runner: web.AppRunner | None = None
    try:
        client = AsyncClient(f"http://127.0.0.1:{port}", backoff=FAST, retry_deadline_s=30)
        async with client:
            consumer = asyncio.create_task(collect(client, first))
            await first.holding.wait()
            first.release.set()  # the daemon dies: connection gone, port refuses
            await runner.cleanup()
            second = BadResultsPeer(lines, plans=[])
            second_runner, _ = await start_site(second.app(), "127.0.0.1", port)
            seqs, final = await asyncio.wait_for(consumer, 30)
    finally:
        await runner.cleanup()
        if second_runner is not None:
            await second_runner.cleanup()
    assert seqs == [1, 2, 3, 4, 5, 6]
    assert final is JobState.DONE
    assert second.afters == [1]


async def test_the_blocking_client_resumes_the_same_way(bad_peer: Any) -> None:
    peer = BadResultsPeer(rows(8), plans=[2, 5])
    url = await bad_peer(peer)

    loop = asyncio.get_running_loop()

    def consume() -> tuple[list[int], JobState | None, int]:
        with Client(url, backoff=FAST) as client:
            results = client.results("step-1")
            seqs = []
            for item in results:
                seqs.append(item["_ng_seq"])
                loop.call_soon_threadsafe(peer.saw, item["_ng_seq"])
            return seqs, results.final_state, results.last_seq

    # The peer runs on this loop, so the blocking consumer gets a thread.
    seqs, final, last = await asyncio.to_thread(consume)
    assert seqs == list(range(1, 9))
    assert (final, last) == (JobState.DONE, 8)
    assert peer.afters == [0, 2, 7]


async def test_the_blocking_client_can_stop_reading_early(bad_peer: Any) -> None:
    peer = BadResultsPeer(rows(50), plans=[])
    url = await bad_peer(peer)

    def first_three() -> list[int]:
        with Client(url, backoff=FAST) as client:
            results = client.results("step-1")
            seqs = [next(results)["_ng_seq"] for _ in range(3)]
            results.close()
            return seqs

    assert await asyncio.to_thread(first_three) == [1, 2, 3]


def test_a_client_used_outside_its_context_says_so() -> None:
    with pytest.raises(RuntimeError, match="with Client"):
        Client("http://127.0.0.1:9").status("x")
