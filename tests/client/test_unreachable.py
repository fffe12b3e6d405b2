"""A daemon the client never reached is an error within its connect deadline (10 s by
default), not a minute of retries; nothing of the client is left running after it."""

from __future__ import annotations

import pytest

from dispatcher.client import AsyncClient, ClientError
from dispatcher.client.aio import DEFAULT_CONNECT_DEADLINE_S, DEFAULT_RETRY_DEADLINE_S
from dispatcher.client.gym import RolloutCollectionHelper
from dispatcher.delivery.retry import BackoffPolicy
from tests.helpers import free_port

FAST = BackoffPolicy(base_s=0.01, cap_s=0.05)


def test_the_connect_deadline_is_ten_seconds_and_shorter_than_the_retries() -> None:
    assert DEFAULT_CONNECT_DEADLINE_S == 10.0 < DEFAULT_RETRY_DEADLINE_S


async def test_a_daemon_never_reached_fails_a_call_at_the_connect_deadline() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    # The retry deadline stays a minute: only the connect deadline can end this call.
    async with AsyncClient(url, backoff=FAST, connect_deadline_s=0.3) as client:
        with pytest.raises(ClientError, match=r"no answer within 0\.3 s") as caught:
            await client.submit([{"responses_create_params": {}}], job_id="j")
    assert caught.value.status == 503
    assert not client.reached


async def test_a_results_stream_from_a_daemon_never_reached_fails_too() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with AsyncClient(url, backoff=FAST, connect_deadline_s=0.3) as client:
        with pytest.raises(ClientError, match=r"no answer within 0\.3 s"):
            async for _ in client.results("j"):
                pass


async def test_the_gym_drop_in_fails_every_example_without_cancelling_a_job_never_made() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    helper = RolloutCollectionHelper(url, backoff=FAST, connect_deadline_s=0.3)
    futures = list(helper.run_examples([{"responses_create_params": {}}] * 3))
    for future in futures:
        with pytest.raises(ClientError, match=r"no answer within 0\.3 s"):
            await future
