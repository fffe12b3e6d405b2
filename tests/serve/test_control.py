"""The control plane of a daemon that runs for days (contracts §12, §13), through the real
CLI and real sockets: /healthz once the state directory is gone, integers of any size
through the API, the admission pause across kill -9, a job whose folder is gone, a job
between hops, the policy version that only goes forward.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from dispatcher import jsonx
from tests.delivery.test_prober_e2e import Restartable, restartable
from tests.delivery.test_prober_e2e import _hop_paused as hop_paused
from tests.delivery.test_prober_e2e import _serve as quick_breakers_serve
from tests.helpers import FakeAgent, run_cli, wait_until
from tests.serve.test_bodies import final
from tests.serve.test_service_e2e import Serve, rows

pytestmark = pytest.mark.timeout(180)

BIG = 123456789012345678901234567890
__all__ = ["restartable"]  # the fixture, imported for these tests


async def call(serve: Serve, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = jsonx.dumps(body) if body is not None else None
    async with serve.http.request(method, f"{serve.url}{path}", data=data) as r:
        return r.status, await r.json(loads=_exact)


def _exact(text: str) -> Any:
    return jsonx.loads(text)


def one_line(answer: Any) -> str:
    assert isinstance(answer, dict) and set(answer) == {"error"}, answer
    message: str = answer["error"]
    assert "\n" not in message
    return message


async def test_healthz_is_503_naming_the_state_directory_once_it_is_gone(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    state = tmp_path / "state"
    serve = await Serve.start(state, gated_agent.url)
    try:
        assert (await call(serve, "GET", "/healthz"))[0] == 200
        shutil.rmtree(state)
        status, answer = await call(serve, "GET", "/healthz")
        assert status == 503, answer
        assert answer["status"] == "state_dir_unwritable" and str(state) in answer["error"]
        state.mkdir()
        (state / "jobs").mkdir()
        assert (await call(serve, "GET", "/healthz"))[0] == 200
    finally:
        await serve.stop(signal.SIGKILL)


async def test_integers_beyond_64_bits_stay_exact_through_the_api(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    state = tmp_path / "state"
    serve = await Serve.start(state, gated_agent.url)
    try:
        body = {"job_id": "big", "rows": rows(1, seed=BIG), "metadata": {"run": -BIG}}
        status, answer = await call(serve, "POST", "/v1/jobs", body)
        assert status == 201, answer
        assert answer["metadata"] == {"run": -BIG}
        rows_file = state / "jobs" / "big" / "input.jsonl"
        # Written just after the answer (the journal holds the job until then).
        await wait_until(rows_file.exists)
        assert str(BIG).encode() in rows_file.read_bytes()
        gated_agent.open()
        await wait_until(serve.in_state("big", "done"), timeout_s=60)
        status, answer = await call(serve, "GET", "/v1/jobs/big")
        assert answer["metadata"] == {"run": -BIG}
        # The same body again is the same job.
        assert (await call(serve, "POST", "/v1/jobs", body))[0] == 200
    finally:
        assert await serve.stop() == 0


async def test_a_jobs_responses_create_params_beyond_64_bits_are_counted_not_a_500(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    serve = await Serve.start(tmp_path / "state", gated_agent.url)
    try:
        body = {"job_id": "p", "rows": rows(1), "responses_create_params": {"seed": BIG}}
        status, answer = await call(serve, "POST", "/v1/jobs", body)
        assert status == 201, answer
        gated_agent.open()
        await wait_until(serve.in_state("p", "done"), timeout_s=60)
    finally:
        assert await serve.stop() == 0


async def test_the_admission_pause_survives_a_kill_9(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    state = tmp_path / "state"
    serve = await Serve.start(state, gated_agent.url)
    status, answer = await call(
        serve, "POST", "/v1/admission", {"paused": True, "ttl_s": 3600, "reason": "update"}
    )
    assert status == 200 and answer["paused"], answer
    await serve.submit(job_id="held", rows=rows(4))
    await serve.stop(signal.SIGKILL)
    again = await Serve.start(state, gated_agent.url)
    try:
        status, answer = await call(again, "GET", "/v1/admission")
        assert answer["paused"] is True and answer["reason"] == "update", answer
        assert 3000 < answer["ttl_remaining_s"] <= 3600, answer
        await wait_until(lambda: _held(again, 1), timeout_s=30)
        assert gated_agent.seen == 0
        # Resumed, it stays resumed across a restart too.
        assert (await call(again, "POST", "/v1/admission", {"paused": False}))[0] == 200
        await wait_until(lambda: gated_agent.holding == 4, timeout_s=30)
    finally:
        await again.stop(signal.SIGKILL)
    third = await Serve.start(state, gated_agent.url)
    try:
        assert (await call(third, "GET", "/v1/admission"))[1]["paused"] is False
    finally:
        gated_agent.open()
        await third.stop(signal.SIGKILL)


async def _held(serve: Serve, count: int) -> bool:
    return bool((await call(serve, "GET", "/v1/admission"))[1]["held"] == count)


async def test_a_final_job_whose_folder_is_gone_keeps_its_status(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    state = tmp_path / "state"
    serve = await Serve.start(state, gated_agent.url)
    try:
        gated_agent.open()
        await serve.submit(job_id="gone", rows=rows(2))
        await wait_until(final(serve, "gone"), timeout_s=60)
        shutil.rmtree(state / "jobs" / "gone")
        status, answer = await call(serve, "GET", "/v1/jobs/gone")
        assert status == 200, answer
        assert answer["state"] == "done" and answer["final"] is True
        assert "folder" in answer["error"] and "gone" in answer["error"]
        status, answer = await call(serve, "GET", "/v1/jobs")
        assert status == 200 and [job["job_id"] for job in answer["jobs"]] == ["gone"]
    finally:
        assert await serve.stop() == 0


async def test_the_policy_version_goes_back_only_with_force(
    tmp_path: Path, gated_agent: FakeAgent
) -> None:
    serve = await Serve.start(tmp_path / "state", gated_agent.url)
    try:
        assert await call(serve, "POST", "/v1/policy", {"version": 5}) == (200, {"version": 5})
        assert await call(serve, "POST", "/v1/policy", {"version": 5}) == (200, {"version": 5})
        status, answer = await call(serve, "POST", "/v1/policy", {"version": 3})
        assert status == 409 and "current version is 5" in one_line(answer), answer
        assert "force" in answer["error"]
        assert (await call(serve, "GET", "/v1/policy"))[1] == {"version": 5}
        forced = {"version": 3, "force": True}
        assert await call(serve, "POST", "/v1/policy", forced) == (200, {"version": 3})
        status, answer = await call(serve, "POST", "/v1/policy", {"version": 4, "force": 1})
        assert status == 400 and one_line(answer).startswith("force:"), answer
        status, answer = await call(serve, "POST", "/v1/policy", {"version": 4, "why": 1})
        assert status == 400 and one_line(answer).startswith("why:"), answer
    finally:
        assert await serve.stop() == 0


async def test_an_admission_file_that_cannot_be_read_is_exit_2_naming_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "admission.json").write_text('{"paused": "maybe"}')
    result = await run_cli(
        "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state),
        "--agent", "sim=http://127.0.0.1:9",
    )  # fmt: skip
    assert result.returncode == 2 and "admission.json" in result.stderr, result.stderr[-2000:]


async def test_a_job_between_hops_says_running_not_a_final_state(
    tmp_path: Path, restartable: Restartable
) -> None:
    await restartable.start()
    serve = await quick_breakers_serve(tmp_path / "state", restartable.url)
    try:
        await restartable.stop()
        await serve.submit(job_id="j", rows=rows(2))
        # Its first hop ended incomplete (the agent is down): it waits for the next.
        await wait_until(lambda: hop_paused(serve), timeout_s=30)
        status = await serve.job("j")
        assert (status["state"], status["final"]) == ("running", False), status
        await restartable.start()
        await wait_until(final(serve, "j"), timeout_s=30)
        status = await serve.job("j")
        assert (status["state"], status["final"]) == ("done", True), status
    finally:
        assert await serve.stop() == 0
