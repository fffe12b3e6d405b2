"""What a final job keeps (contracts §12): its rows' state is freed the moment it ends,
and a restart reads the settled jobs' records one at a time.

The daemon makes the cyclic GC rare (``aio.tune_gc``: its old generation is
walked about once every two billion allocations), so whatever a final job
leaves in a reference cycle stays for the daemon's life. The service runs in
this process, with the jobs API on a real socket and an agent on 127.0.0.1;
the collector is off while the job runs and then saves what it finds
(``DEBUG_SAVEALL``) instead of freeing it: an object that dies here was freed
by reference counting alone, as in the daemon.
"""

from __future__ import annotations

import contextlib
import gc
import tracemalloc
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from dispatcher.serve.command import serving
from dispatcher.serve.jobs import Service
from dispatcher.serve.registry import JobRecord, Registry, now_iso
from dispatcher.serve.served import ServedJob
from dispatcher.serve.spec import STORED
from dispatcher.settings.serve import ServeLimits
from tests.helpers import FakeAgent, serve_arguments, wait_until
from tests.serve.test_service_e2e import rows

pytestmark = pytest.mark.timeout(120)

JSON = {"Content-Type": "application/json"}


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
async def service(tmp_path: Path, gated_agent: FakeAgent) -> AsyncIterator[Service]:
    """``dispatcher serve`` in this process, its jobs API on 127.0.0.1."""
    async with in_process(tmp_path, gated_agent) as running:
        yield running


@contextlib.asynccontextmanager
async def in_process(
    tmp_path: Path, agent: FakeAgent, limits: ServeLimits | None = None
) -> AsyncIterator[Service]:
    """``dispatcher serve`` on ``tmp_path/state`` in this process, until the block ends."""
    settings, state, access = serve_arguments(tmp_path, agent.url)
    async with serving(settings, state, None, None, access, limits or ServeLimits()) as running:
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


@pytest.mark.parametrize("end", ["done", "cancelled"])
async def test_a_final_jobs_per_row_state_is_freed_by_reference_counting(
    service: Service, gated_agent: FakeAgent, refcounting_only: None, end: str
) -> None:
    url = url_of(service)
    async with aiohttp.ClientSession() as http:
        body = orjson.dumps({"job_id": "j", "rows": rows(50), "num_repeats": 2})
        async with http.post(f"{url}/v1/jobs", data=body, headers=JSON) as r:
            assert r.status == 201, await r.text()
        await wait_until(lambda: gated_agent.holding > 0, timeout_s=30)
        served = service.jobs["j"]
        assert isinstance(served, ServedJob)
        refs = per_row_state(served)
        del served
        if end == "done":
            gated_agent.open()
        else:
            async with http.delete(f"{url}/v1/jobs/j") as r:
                assert r.status == 200
        query = {"group": "true", "wait": "true"}
        async with http.get(f"{url}/v1/jobs/j/results", params=query) as r:
            lines = [orjson.loads(line) async for line in r.content if line.strip()]
        assert lines[-1] == {"end": end}
        assert len(lines) == (51 if end == "done" else 1)
    # No collection has run since the job started: what is gone, refcounting freed.
    alive = sorted(name for name, ref in refs.items() if ref() is not None)
    assert alive == [], f"left for the cyclic collector: {alive}"
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    # Nor what its rollouts used: a connection closed under a cancelled call.
    ours = {"ServedJob", "Job", "Groups", "RunState", "Flight", "Connection"}
    kept = {type(o).__name__ for o in gc.garbage} & ours
    assert not kept, kept


async def test_many_small_jobs_settled_and_archived_leave_nothing_for_the_collector(
    tmp_path: Path, refcounting_only: None
) -> None:
    # A trainer submits a job per prompt group: ~10^5 jobs. Whatever each leaves in a
    # reference cycle (the daemon, not the test's client) stays for the daemon's life:
    # its old generation is walked about once every two billion allocations. Each fold
    # of settled jobs into an archive left one (~11 tar headers a job, ~7 KB).
    agent = FakeAgent()
    await agent.start()
    try:
        limits = ServeLimits(retain_settled_jobs=4)
        async with in_process(tmp_path, agent, limits) as service:
            url = url_of(service)
            async with aiohttp.ClientSession() as http:
                for n in range(12):
                    body = orjson.dumps({"job_id": f"g{n}", "rows": rows(1), "num_repeats": 4})
                    async with http.post(f"{url}/v1/jobs", data=body, headers=JSON) as r:
                        assert r.status == 201, await r.text()
                    query = {"group": "true", "wait": "true"}
                    async with http.get(f"{url}/v1/jobs/g{n}/results", params=query) as r:
                        lines = [orjson.loads(line) async for line in r.content if line.strip()]
                    assert lines[-1] == {"end": "done"}
            assert service.compaction is not None
            await wait_until(lambda: service.compaction.archived == 12)  # type: ignore[union-attr]
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            kept = sorted(
                {
                    f"{type(o).__module__}.{type(o).__qualname__}"
                    for o in gc.garbage
                    if type(o).__module__.split(".")[0] in ("dispatcher", "tarfile")
                }
            )
            service.daemon.stop_requested.set()
    finally:
        await agent.close()
    assert kept == []


PARAMS_BYTES = 1 << 20
JOBS = 24


def settled_jobs(state: Path, count: int, params_bytes: int = PARAMS_BYTES) -> None:
    """``count`` done jobs in a state directory, each with ``params_bytes`` of params."""
    registry = Registry(state)
    registry.jobs_dir.mkdir(parents=True)
    params = {"instructions": "p" * params_bytes}
    for n in range(count):
        spec = {"job_id": f"j{n}", "responses_create_params": params}
        fields = {"spec": spec, "digest": f"d{n}", "submitted_seq": n + 1, "state": "done",
                  "submitted_at": now_iso(), "rows_file": "input.jsonl"}  # fmt: skip
        record = JobRecord.model_validate(fields, context=STORED)
        registry.create(record, rows(1))


def peak_bytes(read: Callable[[], object]) -> int:
    """The most ``read`` held at once, by tracemalloc's count."""
    tracemalloc.start()
    try:
        read()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


async def test_a_restart_holds_one_settled_jobs_record_at_a_time(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    settled_jobs(tmp_path / "state", JOBS)
    # Reading one record (its params parsed, then checked) takes a few times its size.
    one = peak_bytes(lambda: Registry(tmp_path / "state").read(tmp_path / "state/jobs/j0"))
    tracemalloc.start()
    try:
        async with in_process(tmp_path, gated_agent) as service, aiohttp.ClientSession() as http:
            async with http.get(f"{url_of(service)}/v1/jobs") as r:
                jobs = (await r.json())["jobs"]
            peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sorted(job["job_id"] for job in jobs) == sorted(f"j{n}" for n in range(JOBS))
    assert {job["state"] for job in jobs} == {"done"}
    # The daemon's start and the listing, and one record at a time: never all of them
    # (24 MiB of params, held at once before).
    assert peak < one + 8 * PARAMS_BYTES, (peak / PARAMS_BYTES, one / PARAMS_BYTES)


async def held_after_restart(folder: Path, agent: FakeAgent, count: int) -> int:
    """What a daemon holds once it has resumed ``count`` settled jobs (tracemalloc)."""
    settled_jobs(folder / "state", count, params_bytes=100)
    gc.collect()
    tracemalloc.start()
    try:
        async with in_process(folder, agent):
            gc.collect()
            return tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


async def test_a_settled_job_costs_the_daemon_a_few_hundred_bytes(
    tmp_path_factory: pytest.TempPathFactory, gated_agent: FakeAgent
) -> None:
    # A first start warms what every start shares (caches, first uses).
    await held_after_restart(tmp_path_factory.mktemp("warm"), gated_agent, 10)
    few = await held_after_restart(tmp_path_factory.mktemp("few"), gated_agent, 10)
    many = await held_after_restart(tmp_path_factory.mktemp("many"), gated_agent, 410)
    per_job = (many - few) / 400
    # About 250 bytes: its id, digest, state and order in a slotted record, its
    # folder derived when asked (with a Path of its own and a __dict__: ~510).
    assert per_job < 400, per_job
