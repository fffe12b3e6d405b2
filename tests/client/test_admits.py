"""A job's admit channel from the client (contracts §12): ``AsyncClient.admit_channel``
against a real ``dispatcher serve``, its agent a gated ``FakeAgent`` on this loop."""

from __future__ import annotations

from pathlib import Path

import pytest

from dispatcher.client import AsyncClient, ClientError
from tests.client.test_blocking_e2e import start_daemon
from tests.helpers import FakeAgent, wait_until

pytestmark = pytest.mark.timeout(60)

ROWS = [{"responses_create_params": {"input": f"q{i}"}, "agent_ref": {"name": "sim"}}
        for i in range(3)]  # fmt: skip


async def test_each_send_admits_and_a_closed_channel_says_why_at_the_next(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    daemon, url = await start_daemon(tmp_path / "state", gated_agent.url)
    try:
        async with AsyncClient(url) as client:
            await client.submit(ROWS, job_id="w", admit=1)
            await wait_until(lambda: gated_agent.holding == 1)
            channel = await client.admit_channel("w")
            await channel.send(2)
            await wait_until(lambda: gated_agent.holding == 2)
            await channel.send(-1)  # no count: the daemon closes the channel
            await wait_until(lambda: channel.closed, timeout_s=30)
            with pytest.raises(ClientError, match=r"closed \(code 1007\): admit: Input should"):
                await channel.send(3)
            await channel.aclose()
            assert await client.admit("w", 3) == 3  # a request still admits
            await wait_until(lambda: gated_agent.holding == 3)
            gated_agent.open()
            await client.wait("w", poll_s=0.05)
    finally:
        await daemon.kill()


async def test_an_unknown_job_has_no_channel(tmp_path: Path, gated_agent: FakeAgent) -> None:
    daemon, url = await start_daemon(tmp_path / "state", gated_agent.url)
    try:
        async with AsyncClient(url) as client:
            with pytest.raises(ClientError) as unknown:
                await client.admit_channel("nope")
            assert unknown.value.status == 404
    finally:
        await daemon.kill()
