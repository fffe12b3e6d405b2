"""Metrics port `auto`: runs on one machine never collide, and each says where it listens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from dispatcher.errors import ConfigError
from dispatcher.settings.config import load_settings
from dispatcher.telemetry.discovery import MetricsEndpoint, resolve_listen, sd_file_for
from dispatcher.telemetry.run_gauges import declare_run_gauges
from tests.helpers import CliProcess, serve, spawn_cli, wait_until, write_tasks


@pytest.fixture
async def gated_agent() -> AsyncIterator[tuple[str, asyncio.Event]]:
    """An agent whose rollouts finish only once the test sets the event."""
    release = asyncio.Event()

    async def run(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"reward": 1.0})

    app = web.Application()
    app.router.add_post("/run", run)
    runner, url = await serve(app)
    yield url, release
    release.set()
    await runner.cleanup()


def test_default_is_auto_on_loopback() -> None:
    settings = load_settings({"input": "t", "output": "o"}, env={})
    assert settings.metrics_listen == "auto"
    assert resolve_listen("auto") == ("127.0.0.1", 0)
    assert resolve_listen("off") is None
    assert resolve_listen("0.0.0.0:9464") == ("0.0.0.0", 9464)
    with pytest.raises(ConfigError, match="metrics_listen"):
        load_settings({"input": "t", "output": "o", "metrics_listen": "automatic"}, env={})


def test_sd_file_names() -> None:
    assert sd_file_for(Path("runs/x.jsonl"), None) == Path("runs/x_prometheus.json")
    one = sd_file_for(Path("runs/step-1/x.jsonl"), Path("/sd"))
    two = sd_file_for(Path("runs/step-2/x.jsonl"), Path("/sd"))
    assert one.parent == Path("/sd") and one != two and one.name.startswith("x-")
    assert MetricsEndpoint("::1", 5).url == "http://[::1]:5/metrics"


def default_run(tasks: Path, output: Path, url: str, *extra: str) -> list[str]:
    # No --metrics-listen: the default is what is under test.
    return [
        "run", "--input", str(tasks), "--output", str(output), "--agent", f"sim={url}",
        "--log-format", "json", *extra,
    ]  # fmt: skip


async def get_json(url: str) -> dict[str, object]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        data: dict[str, object] = await response.json()
        return data


async def test_two_dispatchers_with_default_settings_both_run(
    tmp_path: Path, gated_agent: tuple[str, asyncio.Event]
) -> None:
    # Both used to want 127.0.0.1:9464: the second exited 2.
    url, release = gated_agent
    tasks = write_tasks(tmp_path / "t.jsonl", 8)
    sd_dir = tmp_path / "sd"
    outputs = [tmp_path / "a" / "x.jsonl", tmp_path / "b" / "x.jsonl"]
    runs: list[CliProcess] = [
        await spawn_cli(*default_run(tasks, out, url, "--metrics-sd-dir", str(sd_dir)))
        for out in outputs
    ]
    try:
        await wait_until(lambda: all(r.saw("run_started") for r in runs) or any_exited(runs), 30)
        targets = [orjson.loads(p.read_bytes()) for p in sorted(sd_dir.glob("*.json"))]
        assert len(targets) == 2, [r.stderr for r in runs]
        ports = set()
        for run in runs:
            [event] = [e for e in run.events() if e["event"] == "metrics_listening"]
            metrics_url = event["url"]
            assert metrics_url.startswith("http://127.0.0.1:")
            ports.add(metrics_url)
            status = await get_json(metrics_url.replace("/metrics", "/status"))
            assert status["metrics_url"] == metrics_url
        assert len(ports) == 2
        assert {t[0]["targets"][0] for t in targets} == {
            u.removeprefix("http://").removesuffix("/metrics") for u in ports
        }
        assert {t[0]["labels"]["output"] for t in targets} == {str(o.resolve()) for o in outputs}
    finally:
        release.set()
        results = [await run.wait(60) for run in runs]
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    assert list(sd_dir.glob("*.json")) == []  # withdrawn when the runs stopped
    for out in outputs:
        manifest = orjson.loads(out.with_name("x_manifest.json").read_bytes())
        assert manifest["metrics_url"] in ports


def any_exited(runs: list[CliProcess]) -> bool:
    return any(run.exited for run in runs)


def test_run_gauges_read_at_scrape_time() -> None:
    registry = CollectorRegistry()
    counts = {"a": {"http://r1": 2, "http://r2": 0}}
    declare_run_gauges(registry, 1800.0, lambda: counts)
    declare_run_gauges(registry, 900.0, lambda: counts)  # a second run on the same registry
    value = registry.get_sample_value
    r1 = {"agent": "a", "replica": "http://r1"}
    assert value("dispatcher_rollout_timeout_seconds") == 900.0
    assert value("dispatcher_replica_rollouts_in_flight", r1) == 2
    counts["a"]["http://r1"] = 0
    assert value("dispatcher_replica_rollouts_in_flight", r1) == 0
    declare_run_gauges(registry, None, lambda: {})
    assert value("dispatcher_rollout_timeout_seconds") is None


async def get_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await response.text()


async def test_target_file_beside_the_output_by_default(
    tmp_path: Path, gated_agent: tuple[str, asyncio.Event]
) -> None:
    url, release = gated_agent
    tasks = write_tasks(tmp_path / "t.jsonl", 4)
    output = tmp_path / "out" / "x.jsonl"
    sd_file = output.with_name("x_prometheus.json")
    run = await spawn_cli(*default_run(tasks, output, url, "--rollout-timeout-s", "600"))
    try:
        await wait_until(lambda: run.saw("run_started") or run.exited, 30)
        [target] = orjson.loads(sd_file.read_bytes())
        assert target["targets"][0].startswith("127.0.0.1:")
        assert target["labels"]["run_id"]
        # The scrape the file points at shows the per-replica split and the timeout.
        metrics_url = f"http://{target['targets'][0]}/metrics"
        per_replica = f'dispatcher_replica_rollouts_in_flight{{agent="sim",replica="{url}"}} 4.0'

        async def all_in_flight() -> bool:
            return per_replica in await get_text(metrics_url)

        await wait_until(all_in_flight, 30)
        assert "dispatcher_rollout_timeout_seconds 600.0" in await get_text(metrics_url)
    finally:
        release.set()
        result = await run.wait(60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not sd_file.exists()
