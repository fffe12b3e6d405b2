"""Metrics: names, types and labels of the exposition, and the figures behind them."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from dispatcher.outcome import Outcome
from dispatcher.telemetry.metrics import Metrics, RateWindow

# family name (as the parser reports it) -> (type, label names of its samples)
EXPECTED_FAMILIES = {
    "dispatcher_rollouts": ("counter", {"agent", "outcome"}),
    "dispatcher_rollouts_in_flight": ("gauge", {"agent"}),
    "dispatcher_rollout_duration_seconds": ("histogram", {"agent", "outcome", "le"}),
    "dispatcher_rollout_latency_quantile_seconds": ("summary", {"quantile"}),
    "dispatcher_rollouts_per_hour": ("gauge", set()),
    "dispatcher_drain_margin_seconds": ("gauge", set()),
    "dispatcher_dispatch_budget_remaining_seconds": ("gauge", set()),
    "dispatcher_rollouts_drained": ("counter", set()),
    "dispatcher_rollouts_remaining": ("gauge", set()),
    "dispatcher_event_loop_lag_seconds": ("histogram", {"le"}),
    "dispatcher_capture_wait_seconds": ("histogram", {"le"}),
    "dispatcher_start_order_estimate_error": ("histogram", {"le"}),
    "dispatcher_capture_gaps": ("counter", {"code"}),
    "dispatcher_build_info": ("gauge", {"version", "python"}),
    "dispatcher_retries": ("counter", {"agent", "reason"}),
    "dispatcher_replica_up": ("gauge", {"agent", "replica"}),
    "dispatcher_agent_up": ("gauge", {"agent"}),
    "dispatcher_local_faults": ("counter", {"kind"}),
    "dispatcher_pool_limit": ("gauge", set()),
    "dispatcher_concurrency_limit": ("gauge", {"agent"}),
}


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def sample_values(metrics: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(metrics.render().decode())
        for s in f.samples
    }


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return sample_values(metrics).get((name, frozenset(labels.items())))


def record_run(metrics: Metrics, rollouts: int) -> None:
    outcomes = [Outcome.SUCCESS, Outcome.SUCCESS, Outcome.TIMEOUT_EXCEEDED, Outcome.CANCELLED]
    for i in range(rollouts):
        agent = f"agent-{i % 2}"
        metrics.rollout_started(agent)
        metrics.rollout_left_agent(agent)
        metrics.rollout_finished(agent, outcomes[i % len(outcomes)], 1.0 + i)
    metrics.rollout_drained()
    metrics.declare_replicas({"agent-0": ["http://10.0.0.1:8000"]})
    metrics.retried("agent-0", "no_answer")
    metrics.agent_up("agent-0", True)
    metrics.local_fault("EMFILE")
    metrics.pool_limit(64)
    metrics.concurrency_limit("agent-0", 8)
    metrics.capture_waited(0.07, ["model_call_capture_pending"])
    metrics.update(
        quantiles={0.5: 2.0, 0.75: 3.0, 0.95: 4.0},
        drain_margin_s=3.0,
        budget_remaining_s=60.0,
        remaining=7,
    )


def test_exposition_has_every_family_with_its_type_and_labels() -> None:
    metrics = Metrics(process_metrics=False)
    record_run(metrics, 8)
    metrics.loop_lag.observe(0.001)

    found = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}

    assert set(found) == set(EXPECTED_FAMILIES)
    for name, (kind, labels) in EXPECTED_FAMILIES.items():
        assert found[name].type == kind, name
        assert {label for s in found[name].samples for label in s.labels} == labels, name


def test_series_count_does_not_grow_with_rollouts() -> None:
    few, many = Metrics(process_metrics=False), Metrics(process_metrics=False)
    record_run(few, 8)
    record_run(many, 800)

    assert len(sample_values(few)) == len(sample_values(many))


def test_no_created_series() -> None:
    metrics = Metrics(process_metrics=False)
    record_run(metrics, 4)

    assert b"_created" not in metrics.render()


def test_rollout_counts_durations_and_in_flight() -> None:
    metrics = Metrics(process_metrics=False)
    metrics.rollout_started("a")
    metrics.rollout_started("a")
    assert value(metrics, "dispatcher_rollouts_in_flight", agent="a") == 2

    metrics.rollout_left_agent("a")
    metrics.rollout_left_agent("a")
    metrics.rollout_finished("a", Outcome.SUCCESS, 30.0)
    metrics.rollout_finished("a", "timeout_exceeded", 7200.0)

    assert value(metrics, "dispatcher_rollouts_in_flight", agent="a") == 0
    assert value(metrics, "dispatcher_rollouts_total", agent="a", outcome="success") == 1
    assert value(metrics, "dispatcher_rollouts_total", agent="a", outcome="timeout_exceeded") == 1
    bucket = "dispatcher_rollout_duration_seconds_bucket"
    assert value(metrics, bucket, agent="a", outcome="timeout_exceeded", le="7200.0") == 1
    assert value(metrics, bucket, agent="a", outcome="timeout_exceeded", le="5400.0") == 0
    assert value(metrics, "dispatcher_rollout_duration_seconds_sum", agent="a", outcome="success")


def test_nan_duration_is_counted_but_not_observed() -> None:
    metrics = Metrics(process_metrics=False)
    metrics.rollout_started("a")
    metrics.rollout_finished("a", "cancelled", math.nan)

    labels = {"agent": "a", "outcome": "cancelled"}
    assert value(metrics, "dispatcher_rollouts_total", **labels) == 1
    assert value(metrics, "dispatcher_rollout_duration_seconds_sum", **labels) == 0
    assert value(metrics, "dispatcher_rollout_duration_seconds_count", **labels) == 0


def test_declared_agents_start_at_zero() -> None:
    metrics = Metrics(process_metrics=False)
    metrics.declare_agents(["a", "b"])

    assert value(metrics, "dispatcher_rollouts_in_flight", agent="b") == 0
    assert value(metrics, "dispatcher_rollouts_total", agent="b", outcome="success") == 0
    assert value(metrics, "dispatcher_rollouts_total", agent="b", outcome="drained") is None


def test_drained_and_capture() -> None:
    metrics = Metrics(process_metrics=False)
    metrics.rollout_drained()
    metrics.rollout_drained()
    metrics.capture_waited(0.0, [])
    metrics.capture_waited(10.0, ["model_call_capture_pending", "model_call_capture_pending"])

    assert value(metrics, "dispatcher_rollouts_drained_total") == 2
    assert value(metrics, "dispatcher_capture_wait_seconds_count") == 2
    assert value(metrics, "dispatcher_capture_wait_seconds_bucket", le="0.001") == 1
    pending = {"code": "model_call_capture_pending"}
    assert value(metrics, "dispatcher_capture_gaps_total", **pending) == 2
    assert (
        value(metrics, "dispatcher_capture_gaps_total", code="model_call_capture_no_records") == 0
    )


def test_start_order_errors_fill_cumulative_buckets_and_a_sum() -> None:
    metrics = Metrics(process_metrics=False)
    for error in (0.0, 0.1, 0.3, 5.0, math.nan):
        metrics.start_order_error(error)
    name = "dispatcher_start_order_estimate_error"
    # A bucket counts the errors up to its bound, that bound included; NaN is left out.
    assert value(metrics, f"{name}_bucket", le="0.05") == 1
    assert value(metrics, f"{name}_bucket", le="0.1") == 2
    assert value(metrics, f"{name}_bucket", le="0.35") == 3
    assert value(metrics, f"{name}_bucket", le="3.0") == 3
    assert value(metrics, f"{name}_bucket", le="+Inf") == 4
    assert value(metrics, f"{name}_count") == 4
    assert value(metrics, f"{name}_sum") == pytest.approx(5.4)


def test_update_exports_known_figures_and_leaves_unknown_ones_out() -> None:
    metrics = Metrics(process_metrics=False)
    metrics.update(
        quantiles={0.5: 12.5, 0.75: None, 0.95: math.nan},
        drain_margin_s=None,
        budget_remaining_s=90.0,
        remaining=None,
    )

    quantile = "dispatcher_rollout_latency_quantile_seconds"
    assert value(metrics, quantile, quantile="0.5") == 12.5
    assert value(metrics, quantile, quantile="0.75") is None
    assert value(metrics, quantile, quantile="0.95") is None
    assert value(metrics, "dispatcher_dispatch_budget_remaining_seconds") == 90
    assert value(metrics, "dispatcher_drain_margin_seconds") is None
    assert value(metrics, "dispatcher_rollouts_remaining") is None

    metrics.update(
        quantiles={0.5: 1.0, 0.75: 2.0, 0.95: 3.0},
        drain_margin_s=0.0,
        budget_remaining_s=None,
        remaining=0,
    )

    assert value(metrics, quantile, quantile="0.75") == 2
    assert value(metrics, "dispatcher_drain_margin_seconds") == 0
    assert value(metrics, "dispatcher_dispatch_budget_remaining_seconds") is None
    assert value(metrics, "dispatcher_rollouts_remaining") == 0


def test_build_info() -> None:
    metrics = Metrics(process_metrics=False)
    (labels,) = [
        dict(labels)
        for (name, labels), v in sample_values(metrics).items()
        if name == "dispatcher_build_info" and v == 1
    ]
    assert labels["version"]
    assert labels["python"].count(".") == 2


def test_rate_counts_successes_over_the_window() -> None:
    clock = FakeClock()
    metrics = Metrics(process_metrics=False, rate_window_s=300.0, clock=clock)
    metrics.dispatch_started()
    assert metrics.rollouts_per_hour() == 0

    for _ in range(60):  # one success and one failure a second for a minute
        clock.now += 1.0
        metrics.rollout_started("a")
        metrics.rollout_finished("a", Outcome.SUCCESS, 1.0)
        metrics.rollout_started("a")
        metrics.rollout_finished("a", Outcome.AGENT_RUN_ERROR, 1.0)

    assert metrics.rollouts_per_hour() == pytest.approx(3600.0)
    assert value(metrics, "dispatcher_rollouts_per_hour") == pytest.approx(3600.0)


def test_rate_window_slides_and_forgets() -> None:
    clock = FakeClock(0.0)
    window = RateWindow(100.0, clock)
    window.start()
    for _ in range(200):  # two a second for 100 s
        window.add()
        window.add()
        clock.now += 1.0
    assert window.per_hour() == pytest.approx(7200.0, rel=0.02)

    clock.now += 50.0  # half the window without events: half the rate
    assert window.per_hour() == pytest.approx(3600.0, rel=0.03)

    clock.now += 100.0
    assert window.per_hour() == 0


def test_rate_window_does_not_dilute_a_young_run() -> None:
    clock = FakeClock(0.0)
    window = RateWindow(300.0, clock)
    window.start()
    for _ in range(10):
        clock.now += 1.0
        window.add()

    assert window.per_hour() == pytest.approx(3600.0)


def test_rate_window_rejects_a_non_positive_window() -> None:
    with pytest.raises(ValueError, match="positive"):
        RateWindow(0.0)


def test_metrics_on_a_given_registry_and_many_side_by_side() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry=registry)
    other = Metrics()

    assert metrics.registry is registry
    assert other.registry is not registry
    assert b"process_cpu_seconds_total" in metrics.render()
