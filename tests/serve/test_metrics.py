"""The service's own series (serve/metrics.py) and the rollout duration buckets, as a
scrape renders them; a submit's time to its answer, on ``/metrics`` and ``/status``."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise
from pathlib import Path

import orjson
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from dispatcher.serve.metrics import ServiceGauges
from dispatcher.telemetry.metrics import DURATION_BUCKETS_S
from tests.helpers import FakeAgent
from tests.serve.test_archive import JSON, daemon


def scrape(registry: CollectorRegistry) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    text = generate_latest(registry).decode()
    return [
        (sample.name, tuple(sorted(sample.labels.items())), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def test_each_job_state_is_one_series_paced_included() -> None:
    registry = CollectorRegistry()
    registry.register(ServiceGauges(lambda: {"paced": 2, "running": 1}, lambda: 3))
    samples = scrape(registry)
    series = Counter((name, labels) for name, labels, _ in samples)
    assert [key for key, count in series.items() if count > 1] == []
    jobs = {
        dict(labels)["state"]: value for name, labels, value in samples if name == "dispatcher_jobs"
    }
    assert jobs["paced"] == 2 and jobs["running"] == 1 and jobs["done"] == 0


def test_duration_buckets_resolve_a_tenth_of_a_second_to_ten_seconds() -> None:
    # A p95 read from the histogram sits within one bucket of the truth: no step
    # between 0.1 s and 10 s may be wider than half its lower edge.
    steps = [b for b in DURATION_BUCKETS_S if 0.1 <= b <= 10.0]
    assert steps[0] == 0.1 and steps[-1] == 10.0
    assert max(high / low for low, high in pairwise(steps)) <= 1.5


async def test_each_answered_submit_is_timed_on_metrics_and_status(
    tmp_path: Path, agent: FakeAgent
) -> None:
    async with daemon(tmp_path, agent, window=1000) as api:
        assert await api.submit("a") == 201
        assert await api.submit("a") == 200
        # A refused body is no answer to time.
        async with api.http.post(api.url, data=orjson.dumps({"rows": []}), headers=JSON) as r:
            assert r.status == 400
        status = api.service.status()["submit_s"]
        assert 0 < status["p50"] <= status["p99"] <= status["max"]
        counts = [value for name, _, value in scrape(api.service.daemon.metrics.registry)
                  if name == "dispatcher_submit_seconds_count"]  # fmt: skip
        assert counts == [2]
