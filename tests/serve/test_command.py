"""`dispatcher serve` as a person starts it (serve/command.py), through the CLI."""

from __future__ import annotations

import itertools
from pathlib import Path

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web

from dispatcher.lifecycle import JobState
from dispatcher.telemetry.http_app import start_site
from tests.conftest import SimAgentFactory
from tests.helpers import (
    free_port,
    listening_port,
    listening_url,
    run_cli,
    spawn_cli,
    wait_until,
)
from tests.prometheus_helpers import require_binary, running_prometheus
from tests.serve.test_service_e2e import Serve, rows
from tests.settings.test_gym_head import agent_instance, gym_config


async def test_a_taken_listen_port_is_exit_2_naming_listen_not_metrics_listen(
    tmp_path: Path,
) -> None:
    with listening_port() as port:
        proc = await spawn_cli(
            "serve", "--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "state"),
            "--agent", "sim=http://127.0.0.1:9",
        )  # fmt: skip
        result = await proc.wait()
    assert result.returncode == 2, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: --listen 127.0.0.1:{port}: cannot listen"), line
    assert "Traceback" not in result.stderr


async def test_serve_writes_a_file_sd_target_a_real_prometheus_scrapes_and_removes_it(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    require_binary("prometheus")
    url, _ = await sim_agent(latency_s=0.0)
    targets = tmp_path / "targets"
    serve = await Serve.start(tmp_path / "state", url, "--metrics-sd-dir", str(targets))
    try:
        [target_file] = targets.glob("*_prometheus.json")
        [entry] = orjson.loads(target_file.read_bytes())
        assert entry["targets"] == [serve.url.removeprefix("http://")]
        state = str((tmp_path / "state").resolve())
        assert entry["labels"] == {"state_dir": state, "mode": "serve"}
        files = str(targets / "*_prometheus.json")
        async with running_prometheus("", tmp_path / "prom", sd_files=files) as prom:
            # One series per job state, each labelled with the service's state directory.
            query = f'count(dispatcher_jobs{{mode="serve",state_dir="{state}"}})'
            await prom.wait_for_value(query, len(JobState))
    finally:
        assert await serve.stop() == 0
    assert list(targets.iterdir()) == []


async def test_serve_waits_for_a_gym_head_server_started_after_it(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    agent_url, _ = await sim_agent(latency_s=0.0)
    config = gym_config(sim=agent_instance(agent_url))

    async def config_yaml(request: web.Request) -> web.Response:
        return web.json_response(yaml.safe_dump(config, sort_keys=False))

    port = free_port()
    proc = await spawn_cli(
        "serve", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
        "--gym-head-server", f"127.0.0.1:{port}", "--log-format", "json",
    )  # fmt: skip
    runner = None
    try:
        await wait_until(lambda: proc.saw("gym_head_server_waiting") or proc.exited)
        assert not proc.exited and not proc.stdout, b"".join(proc.stderr).decode()[-2000:]
        app = web.Application()
        app.router.add_get("/global_config_dict_yaml", config_yaml)
        runner, _ = await start_site(app, "127.0.0.1", port)
        url = await listening_url(proc)
        async with aiohttp.ClientSession() as http, http.get(f"{url}/status") as r:
            assert r.status == 200
            # The agents are the head server's.
            assert (await r.json())["in_flight_by_agent"] == {"sim": {agent_url: 0}}
    finally:
        await proc.kill()
        if runner is not None:
            await runner.cleanup()


async def test_a_gym_head_server_that_never_answers_is_one_error_line_after_the_wait(
    tmp_path: Path,
) -> None:
    dead = f"127.0.0.1:{free_port()}"
    result = await run_cli(
        "serve", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
        "--gym-head-server", dead, "--gym-head-server-wait-s", "1",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: Gym head server http://{dead} does not answer"), line
    assert line.endswith("(waited 1 s: --gym-head-server-wait-s)"), line
    assert "gym_head_server_waiting" in result.stderr
    assert "Traceback" not in result.stderr
    result = await run_cli("serve", "--state-dir", "x", "--gym-head-server-wait-s", "soon")
    assert result.returncode == 2
    assert "error: --gym-head-server-wait-s 'soon': must be a number" in result.stderr


# glibc gives a thread a heap of its own in a region of 64 MiB aligned on 64 MiB: its
# used part read-write, the rest reserved (no access), in one mapping each.
THREAD_HEAP = 64 << 20


def thread_heaps(pid: int) -> int:
    """The heaps of ``pid``'s threads (glibc), from its memory map."""
    regions = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        span, perms, _offset, _device, _inode, *name = line.split()
        start, end = (int(x, 16) for x in span.split("-"))
        regions.append((start, end, perms, bool(name)))
    return sum(
        1
        for (start, _, perms, named), (_, end, after, after_named) in itertools.pairwise(regions)
        if start % THREAD_HEAP == 0 and end == start + THREAD_HEAP
        and (perms, after, named, after_named) == ("rw-p", "---p", False, False)
    )  # fmt: skip


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="Linux's /proc")
async def test_serve_threads_share_one_heap_so_settled_jobs_leave_no_fragments(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    """Every thread of the daemon allocates from the main heap: 20,000 jobs left 5 MB more
    in heaps of its threads, each fragmented its own way (heap.one_heap)."""
    url, _ = await sim_agent(latency_s=0.0)
    serve = await Serve.start(tmp_path / "state", url, "--retain-settled-jobs", "2")
    try:
        for n in range(4):  # their rows written, streamed and archived by threads
            await serve.submit(job_id=f"j{n}", rows=rows(2), num_repeats=2)
            assert len(await serve.results(f"j{n}", wait=True)) == 5

        async def archived() -> bool:
            async with serve.http.get(f"{serve.url}/status") as r:
                return bool((await r.json())["jobs_archived"] == 4)

        await wait_until(archived)
        assert thread_heaps(serve.proc.proc.pid) == 0
    finally:
        assert await serve.stop() == 0
