"""A job's start window (contracts §12): ``admit``, a window the caller frees as it
takes results. ``dispatcher serve`` runs as a child process, its agent a gated
``FakeAgent`` on this loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.helpers import FakeAgent, wait_until
from tests.serve.test_service_e2e import Serve, rows

pytestmark = pytest.mark.timeout(60)


async def admit(serve: Serve, job_id: str, count: Any, expect: int = 200) -> dict[str, Any]:
    body = orjson.dumps({"admit": count})
    async with serve.http.post(f"{serve.url}/v1/jobs/{job_id}/admit", data=body) as r:
        assert r.status == expect, await r.text()
        answer: dict[str, Any] = await r.json()
        return answer


async def durable(serve: Serve, job_id: str, count: int) -> bool:
    return bool((await serve.job(job_id))["rows_durable"] >= count)


async def test_a_job_starts_no_more_than_its_caller_admitted(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    """Rows that came back do not free the window; the caller's admissions do (a
    trainer's resident tasks, freed as it takes results). The field was a 400."""
    serve = await Serve.start(tmp_path / "state", gated_agent.url, "--concurrency", "64")
    try:
        await serve.submit(job_id="w", rows=rows(5), admit=2)
        await wait_until(lambda: gated_agent.holding == 2)
        gated_agent.release_next()
        gated_agent.release_next()
        await wait_until(lambda: durable(serve, "w", 2))
        assert gated_agent.seen == 2  # answered and durable, not taken: nothing more
        assert (await admit(serve, "w", 3))["admit"] == 3
        await wait_until(lambda: gated_agent.holding == 1)
        assert gated_agent.seen == 3
        assert (await admit(serve, "w", 1))["admit"] == 3  # never lowered
        assert (await admit(serve, "w", 5))["admit"] == 5
        await wait_until(lambda: gated_agent.holding == 3)
        gated_agent.open()
        stream = await serve.results("w", wait=True)
        assert stream[-1] == {"end": "done"} and len(stream) == 6
        assert gated_agent.max_in_flight == 3 and gated_agent.seen == 5
    finally:
        await serve.stop()


async def test_admit_refuses_what_is_no_count_and_names_an_unknown_job(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    serve = await Serve.start(tmp_path / "state", gated_agent.url)
    try:
        await serve.submit(job_id="w", rows=rows(1), admit=0)
        for bad in (-1, "2", 1.5, None):
            answer = await admit(serve, "w", bad, expect=400)
            assert answer["error"].startswith("admit:"), answer
        await admit(serve, "nope", 1, expect=404)
        refused = await serve.submit(400, job_id="x", rows=rows(1), admit=-1)
        assert refused["error"].startswith("admit:"), refused
        assert gated_agent.seen == 0  # admit 0: nothing starts
        await admit(serve, "w", 1)
        await wait_until(lambda: gated_agent.holding == 1)
        gated_agent.open()
        assert (await serve.results("w", wait=True))[-1] == {"end": "done"}
    finally:
        await serve.stop()


async def test_rows_a_full_window_waits_on_are_not_held_for_a_batch(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    """``--fsync batch`` gathers a job's rows while more are at agents; a job whose
    next start waits for its caller to take rows writes each at once (its row
    waited the whole batch window, an hour here, while its caller waited on it)."""
    import os

    env = {**os.environ, "DISPATCHER_FSYNC_BATCH_INTERVAL_S": "3600"}
    serve = await Serve.spawn(
        "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
        "--agent", f"sim={gated_agent.url}", "--fsync", "batch", env=env,
    )  # fmt: skip
    try:
        await serve.submit(job_id="w", rows=rows(3), admit=2)
        await wait_until(lambda: gated_agent.holding == 2)
        gated_agent.release_next()  # the other stays at its agent
        await wait_until(lambda: durable(serve, "w", 1), timeout_s=30)
        await admit(serve, "w", 3)
        await wait_until(lambda: gated_agent.holding == 2)
        gated_agent.open()
        assert (await serve.results("w", wait=True))[-1] == {"end": "done"}
    finally:
        await serve.stop()


async def test_after_a_restart_a_job_admits_its_admit_beyond_what_is_final(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    """Admissions are not on disk: a restarted daemon counts the job's final
    rollouts as taken, so it goes on without its caller's next request."""
    import signal

    serve = await Serve.start(tmp_path / "state", gated_agent.url)
    await serve.submit(job_id="w", rows=rows(3), admit=1)
    await wait_until(lambda: gated_agent.holding == 1)
    gated_agent.release_next()
    await wait_until(lambda: durable(serve, "w", 1))
    assert await serve.stop(signal.SIGKILL) != 0
    serve = await Serve.start(tmp_path / "state", gated_agent.url)
    try:
        await wait_until(lambda: gated_agent.holding == 1)  # 1 final + admit 1
        assert gated_agent.seen == 2
        await admit(serve, "w", 3)
        await wait_until(lambda: gated_agent.holding == 2)
        gated_agent.open()
        stream = await serve.results("w", wait=True)
        assert stream[-1] == {"end": "done"} and len(stream) == 4
    finally:
        await serve.stop()
