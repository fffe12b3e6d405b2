"""`dispatcher serve` as a person starts it (serve/command.py), through the CLI."""

from __future__ import annotations

from pathlib import Path

import orjson

from dispatcher.lifecycle import JobState
from tests.conftest import SimAgentFactory
from tests.helpers import listening_port, spawn_cli
from tests.prometheus_helpers import require_binary, running_prometheus
from tests.serve.test_service_e2e import Serve


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
