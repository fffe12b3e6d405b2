"""``dispatcher serve`` as a detached, named Ray actor (``dispatcher/client/ray.py``),
on a local CPU-only Ray cluster: Ray restarts it when it is killed mid-job, the
job resumes with no row lost or repeated, and a trainer actor finds it by name.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dispatcher.client import AsyncClient
from dispatcher.client.ray import PID_FILE, find_serve, start_serve_actor, stop_serve_actor
from tests.conftest import SimAgentFactory
from tests.helpers import FakeAgent, read_jsonl, wait_until
from tests.test_readme_commands import example, replaced

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
ROWS = 8


@pytest.fixture(scope="module")
def ray() -> Iterator[Any]:
    ray = pytest.importorskip(
        "ray", reason="the `ray` package is not installed (pip install 'ray>=2.9')"
    )
    # The trainer actor's class lives in this module: workers import it from the checkout.
    ray.init(
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        namespace="tests",
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    try:
        yield ray
    finally:
        ray.shutdown()


class Trainer:
    """A trainer's actor: finds the daemon by name and reads a job's results."""

    def __init__(self, name: str, token: str) -> None:
        self.name = name
        self.token = token

    def results(self, job_id: str) -> list[dict[str, Any]]:
        from dispatcher.client import Client

        with Client(find_serve(self.name), token=self.token) as client:
            return list(client.results(job_id, wait=True))


async def test_a_killed_serve_actor_is_restarted_and_its_job_resumes_exactly(
    ray: Any, tmp_path: Path, gated_agent: FakeAgent
) -> None:
    state, token = tmp_path / "state", "t" * 32
    (tmp_path / "token").write_text(token)
    args = ["--agent", f"sim={gated_agent.url}", "--api-token-file", str(tmp_path / "token")]
    args += ["--log-format", "json", "--input-root", str(tmp_path)]
    name = f"serve-{tmp_path.name}"
    url = await asyncio.to_thread(start_serve_actor, name, state, args=args, listen="127.0.0.1:0")
    try:
        rows = [{"agent_ref": {"name": "sim"}, "q": i} for i in range(ROWS)]
        async with AsyncClient(url, token=token) as client:
            await client.submit(rows, job_id="j")
            await wait_until(lambda: gated_agent.holding == ROWS, timeout_s=60)
            for _ in range(ROWS // 2):
                gated_agent.release_next()
            await wait_until(lambda: _durable(client, ROWS // 2), timeout_s=60)
        first_pid = int((state / PID_FILE).read_text())

        actor = ray.get_actor(name, namespace="dispatcher")
        ray.kill(actor, no_restart=False)  # as a node's OOM killer would
        # Ray restarts it; its daemon resumes the job and sends the rest again.
        await wait_until(lambda: _pid(state) not in (None, first_pid), timeout_s=120)
        again = await asyncio.to_thread(find_serve, name)
        await wait_until(lambda: gated_agent.holding == ROWS // 2, timeout_s=60)
        gated_agent.open()

        trainer = ray.remote(Trainer).options(num_cpus=0).remote(name, token)
        results = await asyncio.to_thread(ray.get, trainer.results.remote("j"), timeout=120)
    finally:
        code = await asyncio.to_thread(stop_serve_actor, name)
    assert code == 0
    assert again.startswith("http://127.0.0.1:")  # a new port, found by the name
    keys = sorted(row["_ng_task_index"] for row in results)
    assert keys == list(range(ROWS)), keys  # none lost, none twice
    output = read_jsonl(state / "jobs" / "j" / "rollouts.jsonl")
    assert sorted(row["_ng_task_index"] for row in output) == list(range(ROWS))


def _pid(state: Path) -> int | None:
    try:
        return int((state / PID_FILE).read_text())
    except (OSError, ValueError):
        return None


async def _durable(client: AsyncClient, count: int) -> bool:
    return (await client.status("j")).rows_durable >= count


async def test_the_ray_example_runs_as_written(
    ray: Any, tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    agent_url, _ = await sim_agent(latency_s=0.0)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "api-token").write_text("s" * 32 + "\n")
    code = replaced(
        example("from dispatcher.client.ray import"),
        {"/shared/run-7": str(shared), "http://10.0.0.11:8000": agent_url},
    )
    scope: dict[str, Any] = {}
    await asyncio.to_thread(exec, compile(code, "docs/ray.md", "exec"), scope)
    assert [row["q"] for row in scope["rows"]] == [1]
    assert "rollouts" not in ray.util.list_named_actors()
