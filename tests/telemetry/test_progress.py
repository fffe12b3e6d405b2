"""The console view: a progress line that fits, per-rollout lines at debug only, a summary."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import structlog

from dispatcher.telemetry.logs import configure_logging, reset_logging
from dispatcher.telemetry.progress import (
    ProgressLine,
    fit_progress,
    format_progress,
    progress_fields,
    write_line,
)
from tests.conftest import SimAgentFactory
from tests.helpers import log_events, run_args, run_cli, write_tasks
from tests.telemetry.test_logs import TTY, render_terminal, snapshot

BIG = {"expected": 10_000_000, "done": 1_234_567, "remaining": 8_765_433, "in_flight": 1024}


@pytest.fixture(autouse=True)
def clean_logging() -> Iterator[None]:
    yield
    reset_logging()


@pytest.mark.parametrize("width", [79, 70, 60])
def test_progress_line_shortens_but_keeps_budget_and_eta(width: int) -> None:
    snap = snapshot(progress=BIG, drained=123_456)
    assert len(format_progress(snap)) > 150

    line = fit_progress(snap, width)

    assert len(line) <= width
    assert line.startswith("1,234,567/10,000,000 (12.3%)")
    assert "budget left 1h02m" in line and line.endswith("ETA 2h32m")


def test_a_wide_terminal_gets_the_whole_line() -> None:
    snap = snapshot()
    assert fit_progress(snap, 500) == format_progress(snap)


def test_a_state_other_than_running_is_kept() -> None:
    line = fit_progress(snapshot(progress=BIG, state="shutting_down"), 79)
    assert line.startswith("shutting_down ") and "ETA" in line


def test_live_line_on_an_80_column_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    # The line used to be cut at the width, which took the budget and the ETA.
    monkeypatch.setenv("COLUMNS", "80")
    tty = TTY()
    line = ProgressLine(tty, enabled=True)

    line.show(snapshot(progress=BIG))

    [shown] = render_terminal(tty.getvalue())
    assert len(shown) <= 79
    assert "budget left 1h02m" in shown and "ETA 2h32m" in shown


def test_console_hides_per_rollout_lines_below_debug() -> None:
    tty = TTY()
    configure_logging("console", stream=tty, level="info")
    line = ProgressLine(tty)
    line.show(snapshot())
    log = structlog.get_logger("dispatcher.run")
    log.info("rollout_finished", rollout_id="0-0")
    log.info("run_started", expected=10)

    screen = render_terminal(tty.getvalue())
    assert not any("rollout_finished" in row for row in screen)
    assert "run_started" in screen[0]
    assert screen[-1].startswith("1,234/10,000")  # still the bottom line


def test_console_shows_per_rollout_lines_above_the_live_line_at_debug() -> None:
    tty = TTY()
    configure_logging("console", stream=tty, level="debug")
    line = ProgressLine(tty)
    line.show(snapshot())
    structlog.get_logger("dispatcher.run").info("rollout_finished", rollout_id="0-0")

    screen = render_terminal(tty.getvalue())
    assert "rollout_finished" in screen[0]
    assert screen[-1].startswith("1,234/10,000")


@pytest.mark.parametrize("level", ["warning", "error"])
def test_summary_at_every_level(level: str) -> None:
    stream = io.StringIO()
    configure_logging("json", stream=stream, level=level)
    log = structlog.get_logger("dispatcher.run")
    log.info("run_started")
    log.info("run_summary", remaining=0)
    log.warning("agent_slow")
    log.error("write_failed")

    events = [orjson.loads(line)["event"] for line in stream.getvalue().splitlines()]
    wanted = ["run_summary", "write_failed"]
    if level == "warning":
        wanted.insert(1, "agent_slow")
    assert events == wanted


async def test_run_at_log_level_error_still_ends_with_its_summary(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, _ = await sim_agent()
    tasks = write_tasks(tmp_path / "t.jsonl", 3)
    result = await run_cli(*run_args(tasks, tmp_path / "o.jsonl", url, "--log-level", "error"))
    assert result.returncode == 0, result.stderr
    [summary] = log_events(result.stderr)
    assert summary["event"] == "run_summary" and summary["outcomes"] == {"success": 3}


def test_the_live_line_counts_retries_by_reason() -> None:
    retries = {"a": {"http_503": 500, "http_429": 31}, "b": {"http_503": 400, "no_answer": 1}}
    snap = snapshot(retries=retries)

    line = fit_progress(snap, 500)

    assert line.endswith(" | retries 932 (503 900, 429 31, no_answer 1)")
    # A narrower terminal keeps them longer than the in-flight count, the margin and
    # the rate's label; narrower still, they go before the failures.
    narrower = fit_progress(snap, 140)
    assert narrower.endswith(" | failed 12 | retries 932 (503 900, 429 31, no_answer 1)")
    assert "in flight" not in narrower and "margin" not in narrower and "/h |" in narrower
    assert "retries" not in fit_progress(snap, 100) and "failed 12" in fit_progress(snap, 100)


def test_the_progress_event_has_no_retry_field() -> None:
    # The JSON `progress` event keeps its fields; the count is the terminal line's.
    assert "retries" not in progress_fields(snapshot(retries={"a": {"http_503": 5}}))


def test_a_line_on_another_stream_of_the_terminal_is_written_off_the_live_line() -> None:
    # stdout and stderr on one terminal: one buffer takes both.
    screen = TTY()
    configure_logging("console", stream=screen, level="info")
    ProgressLine(screen).show(snapshot())
    other = SharedScreen(screen)

    write_line(other, "dispatcher serve listening on http://127.0.0.1:1")

    rows = render_terminal(screen.getvalue())
    assert rows[0] == "dispatcher serve listening on http://127.0.0.1:1"
    assert rows[1].startswith("1,234/10,000")  # redrawn below it


def test_a_line_to_a_pipe_is_written_as_it_is() -> None:
    screen, pipe = TTY(), io.StringIO()
    configure_logging("console", stream=screen, level="info")
    ProgressLine(screen).show(snapshot())
    write_line(pipe, "dispatcher serve listening on http://127.0.0.1:1")
    assert pipe.getvalue() == "dispatcher serve listening on http://127.0.0.1:1\n"
    assert "listening" not in screen.getvalue()


class SharedScreen:
    """Another stream (stdout) writing to the same terminal as ``screen``."""

    def __init__(self, screen: TTY) -> None:
        self._screen = screen

    def write(self, text: str) -> int:
        return self._screen.write(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True
