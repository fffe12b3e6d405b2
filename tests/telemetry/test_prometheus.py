"""A real Prometheus scrapes the metrics server; the shipped configs hold up against it."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dispatcher.admission.pause import AdmissionPause
from dispatcher.outcome import Outcome
from dispatcher.serve.metrics import StepTotals, declare_service_metrics
from dispatcher.telemetry.metrics import Metrics
from dispatcher.telemetry.server import start_http_server
from tests.conftest import SimAgentFactory
from tests.helpers import wait_until
from tests.prometheus_helpers import PrometheusServer, require_binary, running_prometheus
from tests.serve.test_service_e2e import Serve

CONFIG = Path(__file__).resolve().parents[2] / "dispatcher" / "examples"
DASHBOARD = CONFIG / "grafana-dashboard.json"
# Grafana's own variables, as a dashboard with every instance selected would send them.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$job": ".*", "$instance": ".*"}


@pytest.fixture
async def scraped(
    prometheus: str, tmp_path: Path
) -> AsyncIterator[tuple[Metrics, PrometheusServer]]:
    """A metrics server on a free port and a Prometheus scraping it every second."""
    metrics = Metrics()
    runner, port = await start_http_server(
        "127.0.0.1", 0, metrics=metrics, status=dict, healthy=lambda: True
    )
    try:
        async with running_prometheus(f"127.0.0.1:{port}", tmp_path / "prometheus") as prom:
            yield metrics, prom
    finally:
        await runner.cleanup()


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels() -> Iterator[dict[str, Any]]:
    for panel in dashboard()["panels"]:
        yield panel
        yield from panel.get("panels", [])


def expressions() -> list[str]:
    return [t["expr"] for p in panels() for t in p.get("targets", [])]


def substitute(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


async def test_prometheus_sees_every_recorded_rollout(
    scraped: tuple[Metrics, PrometheusServer],
) -> None:
    metrics, prom = scraped
    outcomes = [Outcome.SUCCESS, Outcome.SUCCESS, Outcome.AGENT_RUN_ERROR, Outcome.TIMEOUT_EXCEEDED]
    rollouts = 37
    for i in range(rollouts):
        agent = f"agent-{i % 3}"
        metrics.rollout_started(agent)
        metrics.rollout_left_agent(agent)
        metrics.rollout_finished(agent, outcomes[i % len(outcomes)], 0.5 + i)
    metrics.update(
        quantiles={0.5: 18.5, 0.75: 27.5, 0.95: 34.7},
        drain_margin_s=27.5,
        budget_remaining_s=600.0,
        remaining=3,
    )

    await prom.wait_for_value("sum(dispatcher_rollouts_total)", rollouts)

    assert await prom.query_value('sum(dispatcher_rollouts_total{outcome="success"})') == 19
    assert await prom.query_value("sum(dispatcher_rollouts_in_flight)") == 0
    quantile = 'dispatcher_rollout_latency_quantile_seconds{quantile="0.75"}'
    assert await prom.query_value(quantile) == 27.5
    assert await prom.query_value("dispatcher_drain_margin_seconds") == 27.5
    assert await prom.query_value("dispatcher_rollouts_remaining") == 3
    assert await prom.query_value("dispatcher_build_info") == 1
    assert await prom.query_value('up{job="dispatcher"}') == 1


async def test_every_dashboard_query_is_valid_promql_on_real_series(
    scraped: tuple[Metrics, PrometheusServer],
) -> None:
    metrics, prom = scraped
    metrics.rollout_started("a")
    metrics.rollout_left_agent("a")
    metrics.rollout_finished("a", Outcome.SUCCESS, 1.0)
    await prom.wait_for_value("sum(dispatcher_rollouts_total)", 1)

    for expr in expressions():
        await prom.check_expression(substitute(expr))
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            selector = re.fullmatch(r"label_values\((.+), \w+\)", variable["query"]["query"])
            assert selector is not None, variable["query"]
            await prom.check_expression(substitute(selector.group(1)))


def test_dashboard_only_queries_exported_metrics() -> None:
    metrics = Metrics(process_metrics=False)
    # A serve daemon's registry also holds the service's own series.
    declare_service_metrics(metrics.registry, dict, lambda: 1, AdmissionPause(), StepTotals)
    exported = {f.name for f in text_string_to_metric_families(metrics.render().decode())}
    suffixes = re.compile(r"_(total|bucket|count|sum)$")

    referenced = {
        suffixes.sub("", name)
        for expr in expressions()
        for name in re.findall(r"\bdispatcher_\w+", expr)
    }

    assert referenced
    assert referenced <= exported


def test_dashboard_shape() -> None:
    board = dashboard()
    assert 38 <= board["schemaVersion"] <= 41
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"

    all_panels = list(panels())
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids))
    for panel in all_panels:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}", panel["title"]

    by_title = {p["title"]: p["gridPos"] for p in all_panels}
    # Rate and latency side by side: same row, left and right halves.
    rate, latency = by_title["Rollouts per hour"], by_title["Rollout latency percentiles"]
    assert rate["y"] == latency["y"] and rate["x"] + rate["w"] <= latency["x"]
    for title in (
        "Drain margin vs remaining budget",
        "Failures by class",
        "In flight vs concurrency limit by agent",
        "Event-loop lag",
        "Model-call capture wait and gaps",
        "Remaining rollouts",
        "ETA",
        "Retries by reason",
        "Replicas up",
        "Jobs by state",
        "Policy version",
        "Admission paused",
        "Results delay",
    ):
        assert title in by_title


def test_dashboard_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in panels():
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_example_prometheus_config_is_valid() -> None:
    promtool = require_binary("promtool")
    result = subprocess.run(
        [promtool, "check", "config", str(CONFIG / "prometheus.yml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # Targets come from the file_sd files the runs write (--metrics-listen auto).
    assert "file_sd_configs" in (CONFIG / "prometheus.yml").read_text()


SERVICE_PANELS = ("Jobs by state", "Policy version", "Admission paused", "Results delay")


async def test_each_service_panel_shows_a_real_serve_daemon_to_a_real_prometheus(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    require_binary("prometheus")
    url, _ = await sim_agent(latency_s=0.0)
    serve = await Serve.start(tmp_path / "state", url)
    try:
        rows = [{"responses_create_params": {}}] * 4
        await serve.submit(job_id="step0", rows=rows, default_agent="sim")
        assert (await serve.results("step0", wait=True))[-1] == {"end": "done"}
        await serve.set_policy(3)
        async with serve.http.post(f"{serve.url}/v1/admission", json={"paused": True}) as r:
            assert r.status == 200
        target = serve.url.removeprefix("http://")
        async with running_prometheus(target, tmp_path / "prom") as prom:
            await prom.wait_for_value("max(dispatcher_admission_paused)", 1)
            await prom.wait_for_value("max(dispatcher_policy_version)", 3)
            await prom.wait_for_value('sum(dispatcher_jobs{state="done"})', 1)
            shown = [p for p in panels() if p["title"] in SERVICE_PANELS]
            assert sorted(p["title"] for p in shown) == sorted(SERVICE_PANELS)
            for panel in shown:
                for query in panel["targets"]:
                    # The rates need two scrapes: wait for a series, not a value.
                    expr = substitute(query["expr"])
                    await wait_until(lambda e=expr: _has_series(prom, e), timeout_s=30)
    finally:
        assert await serve.stop() == 0


async def _has_series(prom: PrometheusServer, expr: str) -> bool:
    return bool(await prom.query(expr))
