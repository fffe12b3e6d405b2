"""The HTTP endpoints on a real socket, promtool on a scrape, and the loop-lag sampler."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from dispatcher.telemetry.discovery import parse_listen
from dispatcher.telemetry.lag import LoopLagMonitor
from dispatcher.telemetry.metrics import Metrics
from dispatcher.telemetry.server import start_http_server
from tests.helpers import listening_port, wait_until
from tests.prometheus_helpers import require_binary


class Daemon:
    """Stands in for the service: its status snapshot and health flag."""

    def __init__(self) -> None:
        self.healthy = True
        self.snapshot: dict[str, Any] = {
            "run_id": "run-1",
            "state": "running",
            "progress": {"expected": 10, "done": 4, "remaining": 6, "in_flight": 2},
            "outcomes": {"success": 4},
            "latency_s": {"p50": 1.5, "p75": None, "p95": math.nan, "p99": None},
            "in_flight_by_agent": {"a": {"http://127.0.0.1:1/": 2}},
        }

    def status(self) -> Mapping[str, Any]:
        return self.snapshot

    def is_healthy(self) -> bool:
        return self.healthy


@pytest.fixture
def daemon() -> Daemon:
    return Daemon()


@pytest.fixture
async def server(daemon: Daemon) -> AsyncIterator[tuple[Metrics, str]]:
    metrics = Metrics()
    runner, port = await start_http_server(
        "127.0.0.1", 0, metrics=metrics, status=daemon.status, healthy=daemon.is_healthy
    )
    try:
        yield metrics, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def get(url: str) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, response.headers["Content-Type"], await response.read()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        ("localhost:80", ("localhost", 80)),
        ("[::1]:9464", ("::1", 9464)),
        ("off", None),
        (" OFF ", None),
    ],
)
def test_parse_listen(value: str, expected: tuple[str, int] | None) -> None:
    assert parse_listen(value) == expected


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ("9464", "HOST:PORT"),
        (":9464", "HOST:PORT"),
        ("127.0.0.1:", "HOST:PORT"),
        ("127.0.0.1:http", "0 to 65535"),
        ("127.0.0.1:65536", "0 to 65535"),
        ("127.0.0.1:-1", "0 to 65535"),
        ("::1:9464", "brackets"),
        ("[nope]:9464", "IPv6"),
    ],
)
def test_parse_listen_rejects_with_a_clear_message(value: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        parse_listen(value)


async def test_metrics_endpoint_serves_the_text_format(server: tuple[Metrics, str]) -> None:
    metrics, url = server
    metrics.rollout_started("a")
    metrics.rollout_finished("a", "success", 3.0)

    status, content_type, body = await get(f"{url}/metrics")

    assert status == 200
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    assert b'dispatcher_rollouts_total{agent="a",outcome="success"} 1.0' in body


async def test_promtool_finds_a_scrape_clean(server: tuple[Metrics, str]) -> None:
    promtool = require_binary("promtool")
    metrics, url = server
    metrics.declare_agents(["a", "b"])
    for i in range(20):
        metrics.rollout_started("a")
        metrics.rollout_left_agent("a")
        metrics.rollout_finished("a", "success" if i % 3 else "agent_run_error", 10.0 * i)
    metrics.rollout_drained()
    metrics.capture_waited(0.2, ["model_call_capture_no_records"])
    metrics.loop_lag.observe(0.002)
    metrics.update(
        quantiles={0.5: 1.0, 0.75: 2.0, 0.95: 3.0},
        drain_margin_s=2.0,
        budget_remaining_s=50.0,
        remaining=3,
    )
    _, _, scrape = await get(f"{url}/metrics")

    process = await asyncio.create_subprocess_exec(
        promtool,
        "check",
        "metrics",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    report, _ = await process.communicate(scrape)

    assert process.returncode == 0, report.decode()
    assert report.strip() == b""


async def test_healthz_turns_503_when_shutting_down(
    server: tuple[Metrics, str], daemon: Daemon
) -> None:
    _, url = server
    status, content_type, body = await get(f"{url}/healthz")
    assert (status, content_type, body) == (200, "application/json", b'{"status":"ok"}')

    daemon.healthy = False

    status, _, body = await get(f"{url}/healthz")
    assert (status, body) == (503, b'{"status":"shutting_down"}')


async def test_status_is_the_snapshot_as_json(server: tuple[Metrics, str], daemon: Daemon) -> None:
    _, url = server
    async with aiohttp.ClientSession() as session, session.get(f"{url}/status") as response:
        assert response.status == 200
        body = await response.json()

    assert body["progress"] == daemon.snapshot["progress"]
    assert body["in_flight_by_agent"] == {"a": {"http://127.0.0.1:1/": 2}}
    # NaN is not JSON: it goes out as null.
    assert body["latency_s"] == {"p50": 1.5, "p75": None, "p95": None, "p99": None}

    daemon.snapshot["state"] = "draining"
    _, _, raw = await get(f"{url}/status")
    assert b'"state":"draining"' in raw


async def test_unknown_path_is_404(server: tuple[Metrics, str]) -> None:
    _, url = server
    status, _, _ = await get(f"{url}/nope")
    assert status == 404


async def test_busy_port_raises_before_serving(daemon: Daemon) -> None:
    with listening_port() as port, pytest.raises(OSError):
        await start_http_server(
            "127.0.0.1", port, metrics=Metrics(), status=daemon.status, healthy=bool
        )


async def test_server_handlers_run_on_the_callers_loop(daemon: Daemon) -> None:
    seen: list[asyncio.AbstractEventLoop] = []

    def status() -> Mapping[str, Any]:
        seen.append(asyncio.get_running_loop())
        return {}

    runner, port = await start_http_server(
        "127.0.0.1", 0, metrics=Metrics(), status=status, healthy=daemon.is_healthy
    )
    try:
        await get(f"http://127.0.0.1:{port}/status")
    finally:
        await runner.cleanup()
    assert isinstance(runner, web.AppRunner)
    assert seen == [asyncio.get_running_loop()]


def block_loop(seconds: float) -> None:
    """Hold the event loop the way a blocking call would."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


async def test_loop_lag_monitor_sees_a_blocked_loop() -> None:
    metrics = Metrics(process_metrics=False)
    monitor = LoopLagMonitor(metrics, interval_s=0.01)
    assert monitor.p99_s() is None

    await monitor.start()
    try:
        await wait_until(lambda: monitor.samples >= 3)
        block_loop(0.05)
        await wait_until(lambda: (monitor.max_s() or 0.0) >= 0.04)
    finally:
        await monitor.stop()

    p99 = monitor.p99_s()
    assert p99 is not None and p99 >= 0.04
    assert b"dispatcher_event_loop_lag_seconds_count" in metrics.render()
    assert f"dispatcher_event_loop_lag_seconds_count {float(monitor.samples)}" in (
        metrics.render().decode()
    )
    await monitor.stop()  # idempotent


def test_loop_lag_p99_interpolates_as_every_quantile_does() -> None:
    monitor = LoopLagMonitor(Metrics(process_metrics=False), window=100)
    for i in range(1, 101):
        monitor.observe(i / 1000)

    assert monitor.p99_s() == pytest.approx(0.09901)  # rank 98.01, contracts §8
    assert monitor.max_s() == pytest.approx(0.1)
