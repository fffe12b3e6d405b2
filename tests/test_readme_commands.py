"""The shell examples of the README and docs/, run as written.

Each example is found by its first line in the Markdown (an indented block),
so a changed example is the one that runs. Only what cannot exist on a test
machine is replaced, and each replacement must match the text (a test that
silently ran something else would prove nothing): cluster hosts become
simulated agents on 127.0.0.1, fixed ports become free ones, `/data/tasks`
a temporary folder. `pip install .` is left out: the packaging tests install
the wheel and the sdist outside the checkout; here the `dispatcher` on PATH is
this checkout's.

Python examples and the `curl` example of the service run in
``test_examples.py``; the Python API of each is the same there.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import SimAgentFactory
from tests.helpers import (
    FakeAgent,
    free_port,
    indented_blocks,
    read_jsonl,
    serve,
    wait_until,
)

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

pytestmark = pytest.mark.timeout(180)


def doc_blocks() -> list[str]:
    """Every indented code block of the README and docs/, as text."""
    return [block for doc in DOCS for block in indented_blocks(doc.read_text())]


def example(first_line: str) -> str:
    """The one block whose first line starts with ``first_line``."""
    found = [block for block in doc_blocks() if block.startswith(first_line)]
    assert len(found) == 1, f"{len(found)} examples start with {first_line!r}"
    return found[0]


def replaced(text: str, changes: dict[str, str]) -> str:
    for old, new in changes.items():
        assert old in text, f"the example no longer says {old!r}"
        text = text.replace(old, new)
    return text


def shell_env() -> dict[str, str]:
    """This checkout's `dispatcher` first on PATH, as after `pip install .`."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


async def run_shell(script: str, cwd: Path, timeout_s: float = 120) -> str:
    """Run ``script`` with bash -eu (background jobs killed at its end); its stdout."""
    guarded = "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + script
    proc = await asyncio.create_subprocess_exec(
        "bash", "-euo", "pipefail", "-c", guarded, cwd=cwd, env=shell_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode == 0, (stdout + stderr).decode()[-3000:]
    return stdout.decode()


def tasks_for(agent: str | None, n: int) -> str:
    """A task file of ``n`` rows for ``agent`` (None: rows name no agent)."""
    rows = []
    for i in range(n):
        row: dict[str, object] = {"responses_create_params": {"input": f"q{i}"}}
        if agent is not None:
            row["agent_ref"] = {"name": agent}
        rows.append(json.dumps(row))
    return "\n".join(rows) + "\n"


async def test_the_installed_package_example_runs_as_written(tmp_path: Path) -> None:
    script = example("pip install .")
    port = free_port()
    script = replaced(script, {"pip install .": "true", "127.0.0.1:8000": f"127.0.0.1:{port}"})

    out = await run_shell(script, tmp_path)

    assert re.search(r"\b80 rollouts\b", out), out
    rows = read_jsonl(tmp_path / "runs" / "x.jsonl")
    assert len(rows) == 80
    # The front page shows a row of this run: its keys are a real row's.
    assert set(front_page_row()) == set(rows[0])
    assert (tmp_path / "rd-config").is_dir()


async def test_the_cluster_run_example_runs_with_its_hosts_replaced(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    one, _ = await sim_agent(latency_s=0.0)
    two, _ = await sim_agent(latency_s=0.0)
    script = example("dispatcher run --input tasks.jsonl --output runs/step1/rollouts.jsonl")
    script = replaced(script, {"http://10.0.0.11:8000": one, "http://10.0.0.12:8000": two})
    (tmp_path / "tasks.jsonl").write_text(tasks_for("math_agent", 5))

    await run_shell(script, tmp_path)

    assert len(read_jsonl(tmp_path / "runs" / "step1" / "rollouts.jsonl")) == 5 * 8


async def test_the_capture_proxy_example_serves(tmp_path: Path) -> None:
    port = free_port()
    script = example("dispatcher capture-proxy --listen 127.0.0.1:8100 --upstream")
    script = replaced(
        script, {"127.0.0.1:8100": f"127.0.0.1:{port}", "http://vllm:8000": "http://127.0.0.1:9"}
    )
    out = await serve_until_listening(script, tmp_path)
    assert f"listening on http://127.0.0.1:{port}" in out


async def test_the_routing_proxy_example_serves_with_its_upstreams_replaced(
    tmp_path: Path,
) -> None:
    port = free_port()
    script = example("dispatcher capture-proxy --listen 127.0.0.1:8100 --capture-dir")
    script = replaced(
        script,
        {
            "127.0.0.1:8100": f"127.0.0.1:{port}",
            "http://vllm-0:8000": "http://127.0.0.1:9",
            "http://vllm-1:8000": "http://127.0.0.1:10",
        },
    )
    out = await serve_until_listening(script, tmp_path)
    assert f"listening on http://127.0.0.1:{port}" in out
    assert '"route":"group"' in out


async def test_the_serve_example_serves_with_its_hosts_replaced(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    one, _ = await sim_agent(latency_s=0.0)
    two, _ = await sim_agent(latency_s=0.0)
    (tmp_path / "data").mkdir()
    script = example("head -c 32 /dev/urandom | base64 > api-token")
    port = free_port()
    script = replaced(
        script,
        {
            "0.0.0.0:8080": f"127.0.0.1:{port}",
            "/data/tasks": str(tmp_path / "data"),
            "http://10.0.0.11:8000": one,
            "http://10.0.0.12:8000": two,
        },
    )
    out = await serve_until_listening(script, tmp_path)
    assert f"listening on http://127.0.0.1:{port}" in out
    assert (tmp_path / "api-token").stat().st_mode & 0o777 == 0o600


async def serve_until_listening(
    script: str, cwd: Path, meanwhile: Callable[[str], Awaitable[None]] | None = None
) -> str:
    """Start a script whose last command serves; once it says it listens, await
    ``meanwhile(its URL)`` if given, then SIGTERM it."""
    proc = await asyncio.create_subprocess_exec(
        "bash", "-euo", "pipefail", "-c", script, cwd=cwd, env=shell_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []

    async def read() -> None:
        assert proc.stdout is not None
        async for line in proc.stdout:
            lines.append(line.decode())

    reader = asyncio.create_task(read())
    try:
        await wait_until(lambda: any("listening on" in line for line in lines) or reader.done())
        if meanwhile is not None:
            url = re.search(r"listening on (http://\S+)", "".join(lines))
            assert url is not None, "".join(lines)
            await meanwhile(url.group(1))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 60)
        reader.cancel()
    out = "".join(lines)
    assert re.search(r"listening on http://", out), out
    return out


async def test_the_slurm_example_runs_under_a_stand_in_for_slurm(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    """``sbatch`` here runs the job script at once, as a job of an hour; the successor
    it queues is only recorded, and cancelled when the run is complete."""
    one, _ = await sim_agent(latency_s=0.0)
    two, _ = await sim_agent(latency_s=0.0)
    out = await run_slurm_example(tmp_path, one, two)

    assert len(read_jsonl(tmp_path / "runs" / "step1" / "rollouts.jsonl")) == 3 * 8, out
    assert (tmp_path / "queued").read_text().count("--dependency=afterany:4242") == 1
    assert (tmp_path / "cancelled").read_text().split() == ["4243"]


async def test_the_slurm_chain_stops_when_the_agents_answer_500_to_everything(
    tmp_path: Path,
) -> None:
    """Before, the chain ran hop after hop and ended with exit 0 at 0 % success."""
    broken = [FakeAgent(lambda _: web.json_response({"detail": "no"}, status=500)) for _ in "ab"]
    for agent in broken:
        await agent.start()
    try:
        out = await run_slurm_example(tmp_path, broken[0].url, broken[1].url, check=False)
    finally:
        for agent in broken:
            await agent.close()
    assert "sbatch exit 1" in out, out
    assert not (tmp_path / "runs" / "step1" / "rollouts.jsonl").read_text()
    assert (tmp_path / "cancelled").read_text().split() == ["4243"]


async def run_slurm_example(tmp_path: Path, one: str, two: str, *, check: bool = True) -> str:
    """The README's Slurm example with its agents at ``one`` and ``two``; its stdout (with
    ``check=False``, ending with ``sbatch exit N``)."""
    script = example("dispatcher init rd-config\ncat > rollouts.toml")
    script = replaced(script, {"http://10.0.0.11:8000": one, "http://10.0.0.12:8000": two})
    if not check:
        # Hops rerun at once (not after the default minute) until the chain stops.
        script = "export DISPATCH_PAUSE_S=0\n" + script.rstrip()
        script += ' && echo "sbatch exit 0" || echo "sbatch exit $?"'
    (tmp_path / "tasks.jsonl").write_text(tasks_for(None, 3))
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    stand_ins = {
        "sbatch": """
            if [[ " $* " == *" --parsable "* ]]; then echo "$*" >> queued; echo 4243; exit 0; fi
            export SLURM_JOB_ID=4242 SLURM_JOB_END_TIME=$(( $(date +%s) + 3600 ))
            exec bash "$@"
        """,
        "scancel": 'echo "$*" >> cancelled',
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/bash\nset -eu\n{body}\n")
        (bin_dir / name).chmod(0o755)

    return await run_shell(f'PATH="{bin_dir}:$PATH"\n{script}', tmp_path)


def front_page_row() -> dict[str, object]:
    """The row the README's "A row" shows."""
    readme = (ROOT / "README.md").read_text()
    shown = readme.split("\n## A row\n", 1)[1].split("\n    {\n", 1)[1]
    text = "{\n" + shown.split("\n    }\n", 1)[0].replace("\n    ", "\n") + "\n}"
    row: dict[str, object] = json.loads(text)
    return row


async def test_the_router_proxy_example_sends_the_identity_and_the_release_to_the_router(
    tmp_path: Path,
) -> None:
    seen: list[tuple[str, dict[str, str]]] = []

    async def router(request: web.Request) -> web.Response:
        seen.append((request.path, dict(request.headers)))
        await request.read()
        return web.json_response({"id": "c", "object": "chat.completion", "choices": []})

    app = web.Application()
    app.router.add_post("/{tail:.*}", router)
    runner, router_url = await serve(app)
    port = free_port()
    script = example("dispatcher capture-proxy --listen 127.0.0.1:8200 --capture-dir")
    script = replaced(
        script, {"127.0.0.1:8200": f"127.0.0.1:{port}", "http://router:8000": router_url}
    )

    async def one_rollout(proxy: str) -> None:
        async with aiohttp.ClientSession() as session:
            url = f"{proxy}/ng-rollout/3-1/v1/chat/completions"
            async with session.post(url, json={"model": "m", "messages": []}) as answer:
                assert answer.status == 200
            async with session.post(f"{proxy}/ng-release/3-1") as answer:
                assert (await answer.json())["released"] is True
        await wait_until(lambda: len(seen) == 2)

    try:
        await serve_until_listening(script, tmp_path, one_rollout)
    finally:
        await runner.cleanup()
    (call_path, headers), (release_path, _) = seen
    assert call_path == "/v1/chat/completions" and release_path == "/release"
    assert (headers["X-Session-ID"], headers["X-Prefix-Group"]) == ("3-1", "t3")


# Each example a reader can run, by a line of it only that example has, and what runs it.
SERVICE_EXAMPLES = "ops.test_init.test_readme_service_and_step_control_examples_run_as_written"
GYM_PATH = "gym.test_gym_readme.test_the_five_minute_path_runs_as_written"
NEMO_RL_GUIDE = "client.test_embedded.test_the_nemo_rl_guide_runs_as_written"
GYM_ROUTING = (
    "gym.test_gym_routing_proxy.test_the_proxy_in_front_of_gym_model_servers_runs_as_written"
)
RUN_BY = {
    "make demo": ".ci/run",
    "pip install .": "test_the_installed_package_example_runs_as_written",
    "dispatcher run --input tasks.jsonl --output runs/step1/rollouts.jsonl": (
        "test_the_cluster_run_example_runs_with_its_hosts_replaced"
    ),
    "dispatcher capture-proxy --listen 127.0.0.1:8100 --upstream": (
        "test_the_capture_proxy_example_serves"
    ),
    "dispatcher capture-proxy --listen 127.0.0.1:8100 --capture-dir": (
        "test_the_routing_proxy_example_serves_with_its_upstreams_replaced"
    ),
    "dispatcher capture-proxy --listen 127.0.0.1:8200 --capture-dir": (
        "test_the_router_proxy_example_sends_the_identity_and_the_release_to_the_router"
    ),
    "dispatcher capture-proxy --listen 127.0.0.1:8100 --route group": GYM_ROUTING,
    "cat > replica_1.yaml": GYM_ROUTING,
    "dispatcher run --gym-head-server 127.0.0.1:11000 --capture-proxy-url": GYM_ROUTING,
    "sbatch rd-config/slurm/dispatch.sbatch": (
        "test_the_slurm_example_runs_under_a_stand_in_for_slurm"
    ),
    "head -c 32 /dev/urandom | base64 > api-token": (
        "test_the_serve_example_serves_with_its_hosts_replaced"
    ),
    "from dispatcher.client import AsyncClient": SERVICE_EXAMPLES,
    "URL=${DISPATCHER_URL": SERVICE_EXAMPLES,
    "dispatcher jobs submit --input tasks.jsonl": (
        "ops.test_jobs.test_the_jobs_example_runs_as_written"
    ),
    "gym env start": GYM_PATH,
    "dispatcher run --gym-head-server $HEAD": GYM_PATH,
    "from dispatcher.client.gym import RolloutCollectionHelper": GYM_PATH,
    "from dispatcher.client.ray import": "client.test_ray.test_the_ray_example_runs_as_written",
    "dispatcher serve --listen 127.0.0.1:8080 --state-dir rd-state": NEMO_RL_GUIDE,
    "# trainer.py: NeMo RL's rollout step": NEMO_RL_GUIDE,
}
COMMANDS = re.compile(r"^(dispatcher|make|pip|python|curl|head|gym|ng_\w+|import|from) |^[A-Z_]+=")


def test_every_example_a_reader_can_run_is_run_by_a_test() -> None:
    runnable = [block for block in doc_blocks() if COMMANDS.match(block)]
    unrun = [b.splitlines()[0] for b in runnable if not any(key in b for key in RUN_BY)]
    assert not unrun, f"examples no test runs: {unrun}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make demo" in ci and "make test" in ci
    for runner in RUN_BY.values():
        if runner == ".ci/run":
            continue
        module, _, name = runner.rpartition(".")
        path = ROOT / "tests" / (module.replace(".", "/") or Path(__file__).stem)
        source = path.with_suffix(".py").read_text()
        assert re.search(rf"^(async )?def {name}\(", source, flags=re.MULTILINE), runner


# A bench command in a table cell: `bench/NAME.py ARGS`, with or without `.venv/bin/python`.
BENCH_COMMAND = re.compile(r"`(?:\.venv/bin/python )?(bench/[a-z_]+\.py)((?: [^`]*)?)`")
# Runs a bench script until its arguments are parsed, then exits 0: what it would
# measure is not run, but a flag the script no longer takes fails as it would.
PARSE_ONLY = """
import argparse, runpy, sys
parse = argparse.ArgumentParser.parse_args
def parsed(self, *args, **kwargs):
    parse(self, *args, **kwargs)
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parsed
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def bench_commands() -> list[tuple[str, str]]:
    found = {
        (script, args.strip())
        for doc in (ROOT / "README.md", ROOT / "docs" / "benchmarks.md")
        for script, args in BENCH_COMMAND.findall(doc.read_text())
    }
    return sorted(found)


def test_the_docs_show_bench_commands() -> None:
    scripts = {script for script, _ in bench_commands()}
    assert {"bench/dispatch_overhead.py", "bench/big_rows.py", "bench/service.py"} <= scripts


@pytest.mark.parametrize(("script", "args"), bench_commands())
async def test_each_bench_command_shown_takes_its_arguments(script: str, args: str) -> None:
    assert (ROOT / script).is_file(), f"{script} does not exist"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PARSE_ONLY, str(ROOT / script), *args.split(),
        cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await proc.communicate()
    assert proc.returncode == 0, f"{script} {args}: {err.decode()[-500:]}"
