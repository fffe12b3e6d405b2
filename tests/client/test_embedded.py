"""The drop-in's own daemon: ``RolloutCollectionHelper()`` without a URL.

A fake Gym head server (as in tests/settings/test_gym_head.py) names one
agent, a simulated agent on this loop; the helper starts ``dispatcher serve``
as its child, finds the agent through the head server, and stops the child on
``close()``, at exit, and when its parent is killed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from dispatcher.client.embedded import EmbeddedDaemon, head_server_url
from dispatcher.client.gym import RolloutCollectionHelper
from tests.conftest import SimAgentFactory
from tests.helpers import wait_until
from tests.settings.test_gym_head import (
    HeadFactory,
    agent_instance,
    gym_config,
    head_server,
    runners,
)

__all__ = ["head_server", "runners"]  # fixtures, imported to be found

pytestmark = pytest.mark.timeout(180)


def rows(count: int) -> list[dict[str, Any]]:
    return [
        {"agent_ref": {"name": "sim"}, "responses_create_params": {"input": f"q{i}"}}
        for i in range(count)
    ]


def gone(pid: int) -> bool:
    """No such process, or a zombie (exited, its parent not yet reaping it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status


async def start_head(head_server: HeadFactory, sim_agent: SimAgentFactory) -> str:
    agent_url, _ = await sim_agent()
    return await head_server(gym_config(sim=agent_instance(agent_url)))


@pytest.fixture
def no_dispatcher_url(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.delenv("DISPATCHER_URL", raising=False)
    monkeypatch.setenv("DISPATCHER_STATE", str(tmp_path / "state"))
    return tmp_path / "state"


async def test_without_a_url_the_helper_runs_a_daemon_of_its_own_and_stops_it(
    head_server: HeadFactory, sim_agent: SimAgentFactory, no_dispatcher_url: Path
) -> None:
    head = await start_head(head_server, sim_agent)
    parts = head.removeprefix("http://").split(":")
    config = SimpleNamespace(host=parts[0], port=int(parts[1]))  # as Gym's BaseServerConfig
    helper = RolloutCollectionHelper()
    try:
        pairs = [await f for f in helper.run_examples(rows(4), head_server_config=config)]
        assert sorted(row["responses_create_params"]["input"] for row, _ in pairs) == [
            "q0", "q1", "q2", "q3",
        ]  # fmt: skip
        daemon = helper.daemon
        assert daemon is not None and daemon.url.startswith("http://127.0.0.1:")
        # The next call reuses it; another head server is refused, naming both.
        again = [await f for f in helper.run_examples(rows(2), head_server_config=config)]
        assert len(again) == 2 and helper.daemon is daemon
        other = helper.run_examples(rows(1), head_server_config={"host": "10.0.0.9", "port": 1})
        with pytest.raises(ValueError, match=r"10\.0\.0\.9:1 is not the head server"):
            await next(iter(other))
    finally:
        await asyncio.to_thread(helper.close)
    assert daemon.process.returncode == 0
    # Its state was DISPATCHER_STATE, kept: the jobs' files are there.
    assert len(list((no_dispatcher_url / "jobs").iterdir())) == 2


def test_a_head_server_config_is_an_object_a_mapping_or_a_url() -> None:
    assert head_server_url(SimpleNamespace(host="h", port=1)) == "http://h:1"
    assert head_server_url({"host": "h", "port": 2}) == "http://h:2"
    assert head_server_url("http://h:3") == "http://h:3"
    with pytest.raises(ValueError, match="head_server_config: no host and integer port"):
        head_server_url({"host": "h"})


PARENT = textwrap.dedent(
    """
    import asyncio, sys
    from dispatcher.client.gym import RolloutCollectionHelper

    async def main():
        helper = RolloutCollectionHelper()
        rows = [{"agent_ref": {"name": "sim"}, "responses_create_params": {"input": "q"}}]
        for f in helper.run_examples(rows, head_server_config=sys.argv[1]):
            await f
        print(helper.daemon.process.pid, flush=True)
        if sys.argv[2] == "hang":
            await asyncio.Event().wait()

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("end", ["exit", "kill"])
async def test_the_daemon_never_outlives_its_parent(
    head_server: HeadFactory,
    sim_agent: SimAgentFactory,
    no_dispatcher_url: Path,
    end: str,
) -> None:
    """A parent that returns without ``close()`` (atexit) or is SIGKILLed (the
    child's stdin ends) leaves no daemon behind."""
    head = await start_head(head_server, sim_agent)
    parent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PARENT, head, "hang" if end == "kill" else "exit",
        stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    assert parent.stdout is not None
    line = await asyncio.wait_for(parent.stdout.readline(), 120)
    child = int(line)
    if end == "kill":
        parent.send_signal(signal.SIGKILL)
        await parent.wait()
        await wait_until(lambda: gone(child), timeout_s=60)
    else:
        assert await parent.wait() == 0
        assert gone(child)  # stopped before the parent exited


def test_dispatcher_url_is_the_daemon_when_no_url_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISPATCHER_URL", "http://rollouts:8080")
    assert RolloutCollectionHelper().url == "http://rollouts:8080"
    assert RolloutCollectionHelper("http://other:1").url == "http://other:1"
    with pytest.raises(ValueError, match="max_attempts must be >= 1"):
        RolloutCollectionHelper(max_attempts=0)


async def test_the_nemo_rl_guide_runs_as_written(
    head_server: HeadFactory, sim_agent: SimAgentFactory, tmp_path: Path
) -> None:
    """docs/nemo-rl.md: the daemon beside the trainer, then the trainer with its import
    changed, against a Gym head server (a stand-in) and its agent."""
    from tests.helpers import free_port
    from tests.test_readme_commands import example, replaced

    head = (await start_head(head_server, sim_agent)).removeprefix("http://")
    daemon = example("dispatcher serve --listen 127.0.0.1:8080 --state-dir rd-state")
    listen = f"127.0.0.1:{free_port()}"
    daemon = replaced(daemon, {"127.0.0.1:8080": listen, "127.0.0.1:11000": head})
    (tmp_path / "trainer.py").write_text(example("# trainer.py: NeMo RL's rollout step"))
    (tmp_path / "tasks.jsonl").write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows(4)))
    script = f"{daemon}\npython trainer.py tasks.jsonl\nkill $!\nwait $!\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISPATCHER_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    proc = await asyncio.create_subprocess_exec(
        "bash", "-euo", "pipefail", "-c", script, cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, (err.decode()[-2000:], (tmp_path / "serve.log").read_text())
    assert out.decode().splitlines()[-1] == "4 rewards, failed with statuses []"
    assert len(list((tmp_path / "rd-state" / "jobs").iterdir())) == 1


async def test_the_daemon_process_starts_with_the_helper_and_serves_at_the_first_call(
    head_server: HeadFactory, sim_agent: SimAgentFactory, no_dispatcher_url: Path
) -> None:
    """Its imports (most of its start) run while the trainer sets up, not in its
    first call: the process is there before ``run_examples``, and serves it."""
    head = await start_head(head_server, sim_agent)
    helper = RolloutCollectionHelper()
    try:
        daemon = helper.daemon
        assert daemon is not None and daemon.process.poll() is None
        assert not daemon.configured
        assert await asyncio.to_thread(daemon.wait_imported, 120)
        pairs = [await f for f in helper.run_examples(rows(2), head_server_config=head)]
        assert len(pairs) == 2 and helper.daemon is daemon and daemon.configured
    finally:
        await asyncio.to_thread(helper.close)
    assert daemon.process.returncode == 0


def test_a_helper_with_a_url_starts_no_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISPATCHER_URL", raising=False)
    assert RolloutCollectionHelper("http://rollouts:8080").daemon is None


async def test_a_daemon_whose_parent_never_configures_it_exits_quietly() -> None:
    """The child waits for its flags on stdin; a parent that ends first ends it."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dispatcher.client.embedded",
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert child.stdin is not None
    child.stdin.close()
    assert await asyncio.wait_for(child.wait(), 120) == 0


def test_a_daemon_whose_state_is_temporary_does_not_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its state is removed when it stops and never resumed after a power cut: an
    fsync per row would protect nothing (and each refill of a trainer's window
    waited for one). ``DISPATCHER_STATE`` or ``DISPATCHER_FSYNC`` keep the default."""
    monkeypatch.delenv("DISPATCHER_STATE", raising=False)
    monkeypatch.delenv("DISPATCHER_FSYNC", raising=False)
    daemon = EmbeddedDaemon.spawn()
    try:
        assert daemon._durability() == ("--fsync", "never")
        monkeypatch.setenv("DISPATCHER_FSYNC", "always")
        assert daemon._durability() == ()
    finally:
        daemon.stop()
    assert not Path(daemon.state_dir).exists()
    monkeypatch.delenv("DISPATCHER_FSYNC")
    monkeypatch.setenv("DISPATCHER_STATE", "/nonexistent/state")
    kept = EmbeddedDaemon.spawn()
    try:
        assert kept._durability() == ()
    finally:
        kept.stop()
