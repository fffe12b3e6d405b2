"""A job's admit channel (contracts §12): ``GET /v1/jobs/<id>/admit`` as a WebSocket,
each message raising the job's ``admit`` as ``POST`` does. ``dispatcher serve`` runs as
a child process, its agent a gated ``FakeAgent`` on this loop."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from tests.helpers import FakeAgent, wait_until
from tests.serve.test_service_e2e import Serve, rows

pytestmark = pytest.mark.timeout(60)


async def test_each_message_admits_as_a_post_does(tmp_path: Path, gated_agent: FakeAgent) -> None:
    serve = await Serve.start(tmp_path / "state", gated_agent.url)
    try:
        await serve.submit(job_id="w", rows=rows(4), admit=1)
        await wait_until(lambda: gated_agent.holding == 1)
        async with serve.http.ws_connect(f"{serve.url}/v1/jobs/w/admit") as channel:
            await channel.send_str('{"admit": 2}')
            await wait_until(lambda: gated_agent.holding == 2)
            await channel.send_str('{"admit": 1}')  # never lowered
            await channel.send_str('{"admit": 3}')
            await wait_until(lambda: gated_agent.holding == 3)
            assert gated_agent.seen == 3
            await channel.send_str('{"admit": 4}')
            await wait_until(lambda: gated_agent.holding == 4)
        gated_agent.open()
        stream = await serve.results("w", wait=True)
        assert stream[-1] == {"end": "done"} and len(stream) == 5
        assert gated_agent.max_in_flight == 4
        await wait_until(serve.streams_open(0))  # the channel's slot is back
    finally:
        await serve.stop()


@pytest.mark.parametrize(
    ("message", "code", "reason"),
    [
        ('{"admit": -1}', 1007, "admit: Input should be greater than or equal to 0"),
        ('{"admit": "2"}', 1007, "admit: Input should be a valid integer"),
        ('{"admit": 2, "more": 1}', 1007, "more: not a field of admit channel message"),
        ("[2]", 1007, "body: must be a JSON object"),
        (b"\x00", 1003, "binary message"),
        ('{"admit": %s}' % ("9" * 300), 1009, ""),
    ],
)
async def test_a_bad_message_closes_the_channel_naming_its_field(
    tmp_path: Path, gated_agent: FakeAgent, message: str | bytes, code: int, reason: str
) -> None:
    serve = await Serve.start(tmp_path / "state", gated_agent.url)
    try:
        await serve.submit(job_id="w", rows=rows(2), admit=0)
        async with serve.http.ws_connect(f"{serve.url}/v1/jobs/w/admit") as channel:
            if isinstance(message, bytes):
                await channel.send_bytes(message)
            else:
                await channel.send_str(message)
            closed = await channel.receive(timeout=30)
            assert closed.type is aiohttp.WSMsgType.CLOSE
            assert (closed.data, closed.extra or "") == (code, reason)
        assert gated_agent.seen == 0  # nothing was admitted
    finally:
        await serve.stop()


async def test_an_unknown_job_a_plain_get_and_no_free_stream_are_refused(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    serve = await Serve.start(tmp_path / "state", gated_agent.url, "--max-streams", "1")
    try:
        await serve.submit(job_id="w", rows=rows(1), admit=0)
        with pytest.raises(aiohttp.WSServerHandshakeError) as unknown:
            await serve.http.ws_connect(f"{serve.url}/v1/jobs/nope/admit")
        assert unknown.value.status == 404
        async with serve.http.get(f"{serve.url}/v1/jobs/w/admit") as plain:
            assert plain.status == 400
            assert "not a WebSocket upgrade" in (await plain.json())["error"]
        async with serve.http.ws_connect(f"{serve.url}/v1/jobs/w/admit"):
            with pytest.raises(aiohttp.WSServerHandshakeError) as full:
                await serve.http.ws_connect(f"{serve.url}/v1/jobs/w/admit")
            assert full.value.status == 503
        async with serve.http.ws_connect(f"{serve.url}/v1/jobs/w/admit") as again:
            assert not again.closed  # its slot was given back
    finally:
        await serve.stop()
