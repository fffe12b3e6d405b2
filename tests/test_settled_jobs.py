"""What a final job keeps (contracts §12): its rows' state is freed the moment it ends.

The daemon makes the cyclic GC rare (``aio.tune_gc``: its old generation is
walked about once every two billion allocations), so whatever a final job
leaves in a reference cycle stays for the daemon's life. The service runs in
this process, with the jobs API on a real socket and an agent on 127.0.0.1;
the collector is off while the job runs and then saves what it finds
(``DEBUG_SAVEALL``) instead of freeing it: an object that dies here was freed
by reference counting alone, as in the daemon.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from dispatcher.serve import auth
from dispatcher.serve.command import serving
from dispatcher.serve.jobs import Service
from dispatcher.serve.served import ServedJob
from dispatcher.settings.config import load_settings
from dispatcher.settings.serve import ServeLimits
from tests.helpers import FakeAgent, wait_until
from tests.test_service_e2e import rows

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def refcounting_only() -> Iterator[None]:
    """The cyclic collector off; a collection keeps what it finds in ``gc.garbage``."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


@pytest.fixture
async def gated_agent() -> AsyncIterator[FakeAgent]:
    agent = FakeAgent(gated=True)
    await agent.start()
    yield agent
    await agent.close()


@pytest.fixture
async def service(tmp_path: Path, gated_agent: FakeAgent) -> AsyncIterator[Service]:
    """``dispatcher serve`` in this process, its jobs API on 127.0.0.1."""
    state = tmp_path / "state"
    values = {
        "input": str(state / "jobs"),
        "output": str(state / "jobs" / "x.jsonl"),
        "agents": {"sim": [gated_agent.url]},
        "metrics_listen": "127.0.0.1:0",
        "fsync": "never",
    }
    settings = load_settings(values, env={})
    access = auth.access_from_flags(
        listen="127.0.0.1:0", host="127.0.0.1", token_file=None, allow_unauthenticated=False,
        tls_cert=None, tls_key=None, input_root=str(tmp_path), env={},
    )  # fmt: skip
    async with serving(settings, state, None, None, access, ServeLimits()) as running:
        yield running
        running.daemon.stop_requested.set()


def url_of(service: Service) -> str:
    endpoint = service.daemon.metrics_endpoint
    assert endpoint is not None
    return endpoint.url.removesuffix("/metrics")


def per_row_state(served: ServedJob) -> dict[str, weakref.ref[Any]]:
    """Weak references to what a running job holds per row (and to its holders)."""
    job = served.job
    assert job is not None and job.prepared is not None and served.groups is not None
    held: dict[str, Any] = {
        "served job": served,
        "job (hop)": job,
        "groups": served.groups,
        "output line index": served.output_index,
        "run state": job.prepared.state,
        "latency tracker": job.tracker,
        "recorder": job.recorder,
    }
    return {name: weakref.ref(value) for name, value in held.items()}


async def test_a_final_jobs_per_row_state_is_freed_by_reference_counting(
    service: Service, gated_agent: FakeAgent, refcounting_only: None
) -> None:
    url = url_of(service)
    async with aiohttp.ClientSession() as http:
        body = orjson.dumps({"job_id": "j", "rows": rows(50), "num_repeats": 2})
        async with http.post(f"{url}/v1/jobs", data=body) as r:
            assert r.status == 201, await r.text()
        await wait_until(lambda: gated_agent.holding > 0, timeout_s=30)
        served = service.jobs["j"]
        assert isinstance(served, ServedJob)
        refs = per_row_state(served)
        del served
        gated_agent.open()
        query = {"group": "true", "wait": "true"}
        async with http.get(f"{url}/v1/jobs/j/results", params=query) as r:
            lines = [orjson.loads(line) async for line in r.content if line.strip()]
        assert lines[-1] == {"end": "done"} and len(lines) == 51
    # No collection has run since the job started: what is gone, refcounting freed.
    alive = sorted(name for name, ref in refs.items() if ref() is not None)
    assert alive == [], f"left for the cyclic collector: {alive}"
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    kept = {type(o).__name__ for o in gc.garbage} & {"ServedJob", "Job", "Groups", "RunState"}
    assert not kept, kept
