"""The per-rollout series as plain numbers: the exposition prometheus_client's objects give."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.registry import Collector

from dispatcher.telemetry.hot_series import PlainHistogram, RolloutSeries
from dispatcher.telemetry.metrics import (
    DURATION_BUCKETS_S,
    START_ORDER_ERROR_BUCKETS,
    _WithoutCreated,
)

# (agent, outcome, duration_s) as they finish; "b" is never declared.
FINISHED = [
    ("a", "success", 0.05),
    ("b", "cancelled", 7200.0),
    ("a", "agent_run_error", 0.0),
    ("a", "success", 8000.0),
    ("a", "success", 1.2345),
    ("b", "cancelled", 0.1),
]
ERRORS = [0.0, 0.05, 0.07, 0.5, 2.9, 3.0, 10.0, float("inf"), float("nan"), 1.5]


def exposition(*collectors: Collector) -> bytes:
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)
    return generate_latest(_WithoutCreated(registry))


def test_rollout_series_render_what_the_metric_objects_render() -> None:
    registry = CollectorRegistry()
    total = Counter(
        "dispatcher_rollouts",
        "Rollout attempts finished, by agent and outcome class.",
        ("agent", "outcome"),
        registry=registry,
    )
    in_flight = Gauge(
        "dispatcher_rollouts_in_flight",
        "Rollouts at agents: admitted and not answered yet (commits not included).",
        ("agent",),
        registry=registry,
    )
    durations = Histogram(
        "dispatcher_rollout_duration_seconds",
        "Wall time of finished rollout attempts, by agent and outcome class.",
        ("agent", "outcome"),
        buckets=DURATION_BUCKETS_S,
        registry=registry,
    )
    series = RolloutSeries(DURATION_BUCKETS_S)
    series.declare("a", ["success", "timeout_exceeded"])
    in_flight.labels("a").set(0)
    for outcome in ("success", "timeout_exceeded"):
        total.labels("a", outcome)
    for agent, outcome, duration_s in FINISHED:
        series.started(agent)
        in_flight.labels(agent).inc()
        series.left_agent(agent)
        in_flight.labels(agent).dec()
        series.finished(agent, outcome, duration_s)
        total.labels(agent, outcome).inc()
        durations.labels(agent, outcome).observe(duration_s)
    series.started("a")
    in_flight.labels("a").inc()

    assert exposition(series) == generate_latest(_WithoutCreated(registry))


def test_a_plain_histogram_renders_what_a_histogram_renders() -> None:
    name, help_text = "dispatcher_start_order_estimate_error", "How far |ln(a / e)| is."
    registry = CollectorRegistry()
    histogram = Histogram(name, help_text, buckets=START_ORDER_ERROR_BUCKETS, registry=registry)
    plain = PlainHistogram(name, help_text, START_ORDER_ERROR_BUCKETS)
    assert exposition(plain) == generate_latest(_WithoutCreated(registry))
    for error in ERRORS:
        histogram.observe(error)
        plain.observe(error)
    assert exposition(plain) == generate_latest(_WithoutCreated(registry))
    with_inf = PlainHistogram(name, help_text, (*START_ORDER_ERROR_BUCKETS, float("inf")))
    assert exposition(with_inf) == exposition(
        PlainHistogram(name, help_text, START_ORDER_ERROR_BUCKETS)
    )
