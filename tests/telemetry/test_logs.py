"""Logging setup, progress figures and the live progress line."""

from __future__ import annotations

import io
import logging
import math
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
import structlog

from dispatcher.outcome import Outcome
from dispatcher.telemetry.event_log import log_at
from dispatcher.telemetry.logs import (
    LogFormat,
    configure_logging,
    get_logger,
    reset_logging,
    resolve_log_format,
)
from dispatcher.telemetry.progress import (
    ProgressLine,
    estimate_eta_s,
    format_progress,
    progress_fields,
)
from dispatcher.urls import forget_secrets, hide_secret
from tests.helpers import wait_until


class TTY(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def clean_logging() -> Iterator[None]:
    yield
    reset_logging()
    forget_secrets()


def snapshot(**overrides: Any) -> dict[str, Any]:
    snap: dict[str, Any] = {
        "run_id": "r1",
        "state": "running",
        "started_at": "2024-05-01T10:00:00Z",
        "elapsed_s": 5400.0,
        "progress": {"expected": 10_000, "done": 1234, "remaining": 8766, "in_flight": 256},
        "outcomes": {"success": 1234, "timeout_exceeded": 10, "agent_run_error": 2, "cancelled": 3},
        "rollouts_per_hour": 3456.4,
        "latency_s": {"p50": 42.14, "p75": 58.0, "p95": 112.0, "p99": 300.0},
        "drain_margin_s": 58.0,
        "budget_remaining_s": 3725.0,
        "eta_s": 9130.0,
        "in_flight_by_agent": {"a": {"http://127.0.0.1:1": 256}},
        "drained": 0,
    }
    snap.update(overrides)
    return snap


def json_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_parse_and_carry_the_standard_keys() -> None:
    stream = io.StringIO()
    assert configure_logging("json", stream=stream) == "json"
    log = get_logger("dispatcher.run")

    log.info("rollout_finished", rollout_id="3-1-a2", outcome=Outcome.SUCCESS, duration_s=1.5)
    structlog.get_logger("dispatcher.store").warning("torn_tail_repaired", path=Path("x.jsonl"))
    log.debug("dropped_below_info")

    first, second = json_lines(stream)
    assert list(first)[:4] == ["event", "level", "timestamp", "logger"]
    assert first["event"] == "rollout_finished"
    assert first["level"] == "info"
    assert first["logger"] == "dispatcher.run"
    assert first["outcome"] == "success"
    assert first["duration_s"] == 1.5
    assert first["timestamp"].endswith("Z")
    stamp = datetime.fromisoformat(first["timestamp"])
    assert stamp.utcoffset() == timedelta(0)
    assert abs((datetime.now(UTC) - stamp).total_seconds()) < 3600
    assert second["logger"] == "dispatcher.store"
    assert second["level"] == "warning"
    assert second["path"] == "x.jsonl"


@pytest.mark.parametrize("fmt", ["json", "console"])
@pytest.mark.parametrize("level", [logging.INFO, logging.WARNING, logging.ERROR])
def test_log_at_writes_the_line_structlog_writes(fmt: LogFormat, level: int) -> None:
    """The per-rollout shortcut: the same line as ``log.log``, bound and context
    variables included, whatever the format (timestamps aside)."""
    ours, theirs = io.StringIO(), io.StringIO()
    fields = {"rollout_id": "3-1", "duration_s": 0.25, "capture": None, "path": Path("x")}
    structlog.contextvars.bind_contextvars(run_id="r1")
    try:
        for stream in (ours, theirs):
            configure_logging(fmt, stream=stream)
            log = get_logger("dispatcher.run").bind(job="j1")
            if stream is ours:
                log_at(log, level, "rollout_finished", dict(fields))
            else:
                log.log(level, "rollout_finished", **fields)
    finally:
        structlog.contextvars.clear_contextvars()
    if fmt == "json":
        (mine,), (structlogs,) = json_lines(ours), json_lines(theirs)
        assert mine.pop("timestamp") and structlogs.pop("timestamp")
        assert list(mine.items()) == list(structlogs.items())
        assert mine["run_id"] == "r1" and mine["job"] == "j1"
    else:
        # The console leaves per-rollout lines out below debug: the same (empty) text.
        stamp = re.compile(r"\d{4}-\d\d-\d\d[ T][\d:.]+Z?")
        assert stamp.sub("", ours.getvalue()) == stamp.sub("", theirs.getvalue())


def test_log_at_goes_through_structlog_when_events_are_captured() -> None:
    configure_logging("json", stream=io.StringIO())
    log = get_logger("dispatcher.run").bind()
    with structlog.testing.capture_logs() as captured:
        log_at(log, logging.INFO, "rollout_finished", {"rollout_id": "3-1"})
    assert captured == [{"event": "rollout_finished", "rollout_id": "3-1", "log_level": "info"}]


def test_json_lines_carry_exceptions_and_odd_values() -> None:
    stream = io.StringIO()
    configure_logging("json", stream=stream)
    log = structlog.get_logger()
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("unexpected_error", ratio=math.nan, by_quantile={0.5: 1.0})

    (line,) = json_lines(stream)
    assert line["logger"] == "dispatcher"
    assert line["level"] == "error"
    assert line["ratio"] is None
    assert line["by_quantile"] == {"0.5": 1.0}
    assert line["exception"][0]["exc_type"] == "RuntimeError"


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_a_traceback_never_shows_frame_locals(fmt: LogFormat) -> None:
    # A crash's frames held the agent URLs and the API token: rendered with their
    # locals, one run's log held 14 copies of a password.
    stream = io.StringIO()
    configure_logging(fmt, stream=stream)

    def fails(password: str) -> None:
        raise RuntimeError("boom")

    try:
        fails("pw-" + "hidden-in-a-local")
    except RuntimeError:
        structlog.get_logger().exception("unexpected_error")

    text = stream.getvalue()
    assert "boom" in text and "fails" in text
    assert "pw-hidden-in-a-local" not in text
    assert '"locals"' not in text


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_a_secret_made_known_never_reaches_the_log(fmt: LogFormat) -> None:
    # Whatever message carries it (an exception's text, a field): the token and
    # the agents' passwords are masked on their way out.
    stream = io.StringIO()
    configure_logging(fmt, stream=stream)
    hide_secret("s3cr3t-pw/+=")
    try:
        raise OSError("http://u:s3cr3t-pw/+=@host refused")
    except OSError as exc:
        structlog.get_logger().exception("unexpected_error", error=str(exc))
    logging.getLogger("aiohttp.client").warning("to s3cr3t-pw/+=")

    text = stream.getvalue()
    assert "s3cr3t-pw" not in text
    assert text.count("***") >= 3


def test_stdlib_warnings_join_the_json_stream() -> None:
    stream = io.StringIO()
    configure_logging("json", stream=stream)

    logging.getLogger("aiohttp.client").warning("connection %s lost", "x")
    logging.getLogger("aiohttp.access").info("GET /metrics")

    (line,) = json_lines(stream)
    assert line["event"] == "connection x lost"
    assert line["logger"] == "aiohttp.client"
    assert line["level"] == "warning"


def test_configuring_again_replaces_the_previous_setup() -> None:
    old, new = io.StringIO(), io.StringIO()
    configure_logging("json", stream=old)
    configure_logging("json", stream=new, level="warning")

    structlog.get_logger("x").warning("w")
    structlog.get_logger("x").info("i")
    logging.getLogger("lib").warning("from stdlib")

    assert old.getvalue() == ""
    assert [line["event"] for line in json_lines(new)] == ["w", "from stdlib"]


def test_format_defaults_to_console_on_a_terminal_only() -> None:
    assert resolve_log_format(None, io.StringIO()) == "json"
    assert resolve_log_format(None, TTY()) == "console"
    assert resolve_log_format("json", TTY()) == "json"
    with pytest.raises(ValueError, match="json"):
        resolve_log_format("xml", io.StringIO())  # type: ignore[arg-type]


def test_console_format_is_readable_text() -> None:
    stream = io.StringIO()
    configure_logging("console", stream=stream)

    structlog.get_logger("dispatcher.run").info("run_started", expected=12)

    text = stream.getvalue()
    assert "run_started" in text and "expected=12" in text
    assert not text.startswith("{")
    assert "\x1b[" not in text  # no colours off a terminal


def test_format_progress_shows_rate_next_to_latency() -> None:
    line = format_progress(snapshot())

    assert line == (
        "running 1,234/10,000 (12.3%) | 3,456 rollouts/h"
        " | p50 42.1s p75 58.0s p95 1m52s | margin 58.0s | budget left 1h02m"
        " | ETA 2h32m | in flight 256 | failed 12"
    )


def test_format_progress_with_unknown_figures() -> None:
    line = format_progress(
        {
            "state": "draining",
            "progress": {"expected": None, "done": 7, "in_flight": 0},
            "rollouts_per_hour": 2.25,
            "latency_s": {"p50": 0.25, "p75": None, "p95": math.nan},
            "drain_margin_s": None,
            "budget_remaining_s": 0.0,
            "eta_s": None,
            "drained": 5,
        }
    )

    assert line == (
        "draining 7 done | 2.2 rollouts/h | p50 250ms p75 - p95 - | margin -"
        " | budget left 0s | ETA - | in flight 0 | drained 5"
    )
    assert format_progress({}).startswith("- | - rollouts/h")


def test_progress_fields_are_flat_and_rounded() -> None:
    fields = progress_fields(snapshot(rollouts_per_hour=1.23456789))

    assert fields == {
        "state": "running",
        "elapsed_s": 5400.0,
        "done": 1234,
        "expected": 10_000,
        "remaining": 8766,
        "in_flight": 256,
        "limit": None,
        "failed": 12,
        "drained": 0,
        "rollouts_per_hour": 1.235,
        "p50_s": 42.14,
        "p75_s": 58.0,
        "p95_s": 112.0,
        "drain_margin_s": 58.0,
        "budget_remaining_s": 3725.0,
        "eta_s": 9130.0,
    }
    orjson.dumps(fields)


def test_the_progress_line_shows_in_flight_against_the_limit() -> None:
    # The agents' limits summed, within the pool's: 300 + 400 capped at 512.
    snap = snapshot(pool_limit=512, concurrency={"a": {"limit": 300}, "b": {"limit": 400}})

    assert progress_fields(snap)["limit"] == 512
    assert "| in flight 256/512 |" in format_progress(snap)
    assert progress_fields(snapshot(pool_limit=64))["limit"] == 64


@pytest.mark.parametrize(
    ("remaining", "per_hour", "expected"),
    [
        (100, 3600.0, 100.0),
        (1, 0.5, 7200.0),
        (0, 0.0, 0.0),
        (-3, 10.0, 0.0),
        (5, 0.0, None),
        (5, math.nan, None),
        (5, math.inf, None),
    ],
)
def test_estimate_eta(remaining: int, per_hour: float, expected: float | None) -> None:
    assert estimate_eta_s(remaining, per_hour) == expected


def test_progress_line_stays_silent_off_a_terminal() -> None:
    stream = io.StringIO()
    line = ProgressLine(stream, enabled=True)

    line.show(snapshot())
    line.clear()

    assert not line.enabled
    assert stream.getvalue() == ""


def test_progress_line_follows_console_logging_by_default() -> None:
    tty = TTY()
    configure_logging("json", stream=tty)
    assert not ProgressLine(tty).enabled

    configure_logging(None, stream=tty)
    assert ProgressLine(tty).enabled
    assert not ProgressLine(TTY()).enabled


def test_log_lines_print_above_the_live_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # Wide enough for the whole line; fitting it to 80 columns: test_console_view.py.
    monkeypatch.setenv("COLUMNS", "200")
    tty = TTY()
    configure_logging("console", stream=tty)
    line = ProgressLine(tty)

    line.show(snapshot())
    structlog.get_logger("dispatcher.run").warning("agent_slow", agent="a")
    line.show(snapshot(progress={"expected": 10, "done": 10, "remaining": 0, "in_flight": 0}))
    line.clear()

    screen = render_terminal(tty.getvalue())
    assert len(screen) == 2
    assert "agent_slow" in screen[0]
    assert screen[1] == ""  # the live line was cleared at the end
    before_clear = render_terminal(tty.getvalue().rsplit("\r", 1)[0])
    assert before_clear[-1].startswith("running 10/10 (100.0%)")


async def test_progress_line_redraws_from_status_until_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    tty = TTY()
    line = ProgressLine(tty, enabled=True)
    calls = 0

    def status() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        return snapshot(progress={"expected": 10, "done": calls, "in_flight": 1})

    await line.start(status, interval_s=0.01)
    try:
        await wait_until(lambda: calls >= 3)
    finally:
        await line.stop()

    assert "running 3/10 (30.0%)" in tty.getvalue()
    assert render_terminal(tty.getvalue()) == [""]


def render_terminal(raw: str) -> list[str]:
    """What a terminal shows for `raw`: \\r returns to column 0, ESC[K erases to the end."""
    lines = [""]
    column = 0
    i = 0
    while i < len(raw):
        if raw.startswith("\x1b[K", i):
            lines[-1] = lines[-1][:column]
            i += 3
            continue
        char = raw[i]
        i += 1
        if char == "\r":
            column = 0
        elif char == "\n":
            lines.append("")
            column = 0
        else:
            current = lines[-1]
            lines[-1] = current[:column] + char + current[column + 1 :]
            column += 1
    return lines


def test_json_lines_keep_the_order_and_keys_of_the_processor_chain() -> None:
    """The one-step JSON render gives the line the processor chain gave."""
    stream = io.StringIO()
    configure_logging("json", stream=stream)
    structlog.contextvars.bind_contextvars(run_id="r1")
    try:
        log = get_logger("dispatcher.run").bind(job_id="j1")
        log.log(logging.WARNING, "rollout_finished", outcome="agent_run_error", timestamp="x")
        log.warn("deprecated_alias", logger="own")
    finally:
        structlog.contextvars.clear_contextvars()

    first, second = json_lines(stream)
    assert list(first) == ["event", "level", "timestamp", "logger", "job_id", "outcome", "run_id"]
    assert (first["event"], first["level"], first["logger"]) == (
        "rollout_finished",
        "warning",
        "dispatcher.run",
    )
    assert (first["job_id"], first["run_id"]) == ("j1", "r1")
    assert (second["level"], second["logger"]) == ("warning", "own")
