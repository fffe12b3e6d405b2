"""What a person at a terminal sees: `dispatcher run` and `serve` on a real pseudo-terminal
(their stdout and stderr on a pty's slave, read from its master), against a simulated
agent that answers some 429s, 503s and 500s; and the JSON lines of the same run off it."""

from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import re
import signal
import struct
import sys
import termios
from collections import Counter
from pathlib import Path

import orjson

from tests.conftest import SimAgentFactory
from tests.helpers import cli_env, read_jsonl, run_args, run_cli, wait_until, write_tasks
from tests.telemetry.test_logs import render_terminal

TASKS = 40
# 429s first, then a 503 or a 500 for one request in five each; retries 10 ms apart.
AGENT = {"fail_500": 0.2, "fail_503": 0.2, "rate_limit_first": 3, "retry_after_s": 0, "seed": 3}
FAST_RETRIES = {"DISPATCHER_RETRY_BACKOFF_BASE_S": "0.01"}
_SGR = re.compile(r"\x1b\[[0-9;]*m")
_FAILED = re.compile(
    r"failed: (\d+) agent_run_error \(HTTP 500\)(?: in the last [\d.]+s)?: (.*?)(?: — |$)"
)


class OnTerminal:
    """``dispatcher ARGS`` with a pseudo-terminal for its stdin, stdout and stderr."""

    def __init__(self, proc: asyncio.subprocess.Process, master: int) -> None:
        self.proc = proc
        self.raw = b""
        self._master = master
        self._eof = asyncio.Event()
        asyncio.get_running_loop().add_reader(master, self._read)

    @classmethod
    async def start(cls, *args: str, env: dict[str, str] | None = None) -> OnTerminal:
        master, slave = pty.openpty()
        # 120 columns, as a person's terminal: the progress line fits it whole.
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 120, 0, 0))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dispatcher", *args,
            stdin=slave, stdout=slave, stderr=slave, env=cli_env(env), start_new_session=True,
        )  # fmt: skip
        os.close(slave)
        return cls(proc, master)

    def _read(self) -> None:
        try:
            data = os.read(self._master, 1 << 16)
        except OSError:  # EIO: the last slave descriptor closed
            data = b""
        if not data:
            asyncio.get_running_loop().remove_reader(self._master)
            self._eof.set()
        self.raw += data

    def text(self) -> str:
        return _SGR.sub("", self.raw.decode(errors="replace"))

    def screen(self) -> list[str]:
        """The rows a terminal shows (colors removed), blank rows left out."""
        return [row.rstrip() for row in render_terminal(self.text()) if row.strip()]

    async def wait(self, timeout_s: float = 120) -> int:
        try:
            code = await asyncio.wait_for(self.proc.wait(), timeout_s)
            await asyncio.wait_for(self._eof.wait(), timeout_s)
        except TimeoutError:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: nothing is left behind
            raise
        finally:
            asyncio.get_running_loop().remove_reader(self._master)
        os.close(self._master)
        return code


def console_run_args(tasks: Path, output: Path, url: str, *extra: str) -> list[str]:
    """``run_args`` without ``--log-format json``: the default, console on a terminal."""
    args = run_args(tasks, output, url, *extra)
    at = args.index("--log-format")
    return args[:at] + args[at + 2 :]


def failure_lines(screen: list[str]) -> list[tuple[int, list[str]]]:
    found = [_FAILED.search(row) for row in screen]
    return [(int(m[1]), m[2].split(", ")) for m in found if m]


async def test_a_run_on_a_terminal_shows_failures_folds_retries_and_ends_with_the_table(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, _ = await sim_agent(**AGENT)
    tasks = write_tasks(tmp_path / "t.jsonl", TASKS)
    output = tmp_path / "o.jsonl"
    args = console_run_args(tasks, output, url, "--concurrency", "8")
    term = await OnTerminal.start(*args, env=FAST_RETRIES)

    assert await term.wait() == 75, term.text()[-3000:]
    screen = term.screen()
    failures = read_jsonl(tmp_path / "o_failures.jsonl")
    assert failures and {f["_ng_failure_http_status"] for f in failures} == {500}
    # Every failure on a line of its class, folded: fewer lines than failures.
    lines = failure_lines(screen)
    assert sum(count for count, _ in lines) == len(failures)
    assert len(lines) < len(failures)
    named = [rid for _, ids in lines for rid in ids if not rid.startswith("+")]
    assert set(named) <= {f"{f['_ng_task_index']}-0" for f in failures}
    # Retries happened (the 429s at least) and none has a line of its own.
    assert "rollout_retry" not in term.text()
    [ended] = [row for row in screen if "run ended: " in row]
    assert f", {len(failures)} failed in " in ended
    retries = re.search(r"retries (\d+) \(", ended)
    assert retries and int(retries[1]) >= 3, ended
    assert "outcomes=" not in term.text()  # the summary for machines is not printed
    # Then status's table and the next step, last.
    end = screen[screen.index(next(r for r in screen if "run ended: " in r)) + 1 :]
    assert end[0] == (
        f"{output}: {100 * (TASKS - len(failures)) / TASKS:.1f}% covered "
        f"({TASKS - len(failures)} of {TASKS} succeeded); left to run: {len(failures)}"
    )
    assert re.fullmatch(r"\s+rollouts\s+count\s+share", end[1])
    retryable = rf"\s+left: retryable \(failed, attempts left\)\s+{len(failures)}\s.*"
    assert re.fullmatch(retryable, end[5]), end
    assert end[-1] == (
        f"exit 75: rerun the same command to finish {len(failures)} rollouts "
        "(finished ones are kept)"
    )


async def test_a_finished_run_on_a_terminal_says_where_the_rows_are(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, _ = await sim_agent()
    output = tmp_path / "o.jsonl"
    args = console_run_args(write_tasks(tmp_path / "t.jsonl", 5), output, url)
    term = await OnTerminal.start(*args)

    assert await term.wait() == 0, term.text()[-3000:]
    screen = term.screen()
    assert not failure_lines(screen)
    assert screen[-1] == (
        f"exit 0: every rollout is final; the rows are in {output} (5 succeeded); "
        f"`dispatcher report {output}` tells more"
    )


async def test_a_run_that_fails_on_a_terminal_says_so_above_its_error(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, _ = await sim_agent(fail_500=1.0)
    args = console_run_args(write_tasks(tmp_path / "t.jsonl", 20), tmp_path / "o.jsonl", url)
    term = await OnTerminal.start(*args, "--concurrency", "1", "--max-failure-fraction", "0.1")

    assert await term.wait() == 1, term.text()[-3000:]
    screen = term.screen()
    assert failure_lines(screen)
    assert screen[-2].startswith("exit 1: the run stopped on the error below; once it is fixed, ")
    assert screen[-1].startswith("error: --max-failure-fraction 0.1: ")


async def test_the_same_run_off_a_terminal_writes_the_json_events_it_always_did(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, _ = await sim_agent(**AGENT)
    tasks = write_tasks(tmp_path / "t.jsonl", TASKS)
    args = run_args(tasks, tmp_path / "o.jsonl", url, "--concurrency", "8")

    result = await run_cli(*args, env=FAST_RETRIES)

    assert result.returncode == 75, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    events = [orjson.loads(line) for line in lines]  # every line is JSON
    names = Counter(e["event"] for e in events)
    assert set(names) <= {
        "run_started", "rollout_retry", "rollout_finished", "progress", "run_summary"
    }  # fmt: skip
    [summary] = [e for e in events if e["event"] == "run_summary"]
    # One rollout_retry line per retry, one rollout_finished line per attempt, as before.
    assert names["rollout_retry"] == sum(summary["retries"]["sim"].values()) >= 3
    assert names["rollout_finished"] == TASKS
    failures = read_jsonl(tmp_path / "o_failures.jsonl")
    finished = [e for e in events if e["event"] == "rollout_finished"]
    assert sum(e["outcome"] == "agent_run_error" for e in finished) == len(failures) > 0
    assert "\x1b[" not in result.stderr and "failed: " not in result.stderr


async def test_serve_on_a_terminal_says_listening_on_a_line_of_its_own(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, _ = await sim_agent()
    term = await OnTerminal.start(
        "serve", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
        "--agent", f"sim={url}",
    )  # fmt: skip
    try:
        await wait_until(lambda: b"listening on http" in term.raw, timeout_s=30)
        await wait_until(lambda: b"\n" in term.raw[term.raw.index(b"listening on") :])
    finally:
        os.killpg(term.proc.pid, signal.SIGTERM)
        await term.wait()

    text = term.text()
    # The progress line was on the screen before the line was written.
    assert text.index("budget left") < text.index("listening on"), text
    [row] = [row for row in term.screen() if "listening on" in row]
    assert re.fullmatch(r"dispatcher serve listening on http://127\.0\.0\.1:\d+", row), row
