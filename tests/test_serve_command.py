"""`dispatcher serve` as a person starts it (serve/command.py), through the CLI."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.helpers import spawn_cli


async def test_a_taken_listen_port_is_exit_2_naming_listen_not_metrics_listen(
    tmp_path: Path,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = await spawn_cli(
            "serve", "--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "state"),
            "--agent", "sim=http://127.0.0.1:9",
        )  # fmt: skip
        result = await proc.wait()
    assert result.returncode == 2, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: --listen 127.0.0.1:{port}: cannot listen"), line
    assert "Traceback" not in result.stderr
