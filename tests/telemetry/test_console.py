"""telemetry/console.py: task failures folded by class at most once a second (on a fake
clock), retries folded away, a one-line summary; JSON and non-terminal logs untouched."""

from __future__ import annotations

import io
import itertools
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
import structlog

from dispatcher.telemetry.console import ConsoleFolding, FailureFeed, summary_line
from dispatcher.telemetry.logs import configure_logging, reset_logging
from tests.telemetry.test_logs import TTY, render_terminal

HTTP_500 = "agent_run_error (HTTP 500)"
TIMEOUT = "timeout_exceeded"


@pytest.fixture(autouse=True)
def clean_logging() -> Iterator[None]:
    yield
    reset_logging()


def test_a_first_failure_shows_at_once_and_the_next_ones_wait_for_the_window() -> None:
    feed = FailureFeed(window_s=1.0)

    first = feed.add(HTTP_500, "3-0", "agent answered HTTP 500", now=10.0)
    held = [feed.add(HTTP_500, rid, "boom", now=t) for rid, t in (("4-0", 10.2), ("9-1", 10.7))]

    assert first == f"failed: 1 {HTTP_500}: 3-0 — message: agent answered HTTP 500"
    assert held == [None, None]
    assert feed.due_at(HTTP_500) == 11.0
    assert feed.take(HTTP_500, now=11.0) == (
        f"failed: 2 {HTTP_500} in the last 1.0s: 4-0, 9-1 — first message: boom"
    )
    assert feed.take(HTTP_500, now=11.0) is None  # nothing held any more


def test_a_class_quiet_for_a_window_shows_its_next_failure_at_once() -> None:
    feed = FailureFeed(window_s=1.0)
    feed.add(HTTP_500, "1-0", None, now=0.0)
    assert feed.add(HTTP_500, "2-0", None, now=0.5) is None
    assert feed.take(HTTP_500, now=1.0) is not None
    # Held again: its line at 1.0 opened a new window.
    assert feed.add(HTTP_500, "3-0", None, now=1.5) is None
    assert feed.add(HTTP_500, "4-0", None, now=2.5) is None  # still held: one line per window
    assert feed.take(HTTP_500, now=2.5) == f"failed: 2 {HTTP_500} in the last 1.5s: 3-0, 4-0"
    assert feed.add(HTTP_500, "5-0", None, now=3.6) == f"failed: 1 {HTTP_500}: 5-0"


def test_classes_have_windows_of_their_own() -> None:
    feed = FailureFeed(window_s=1.0)
    assert feed.add(HTTP_500, "1-0", None, now=0.0) is not None
    assert feed.add(TIMEOUT, "2-0", None, now=0.1) == f"failed: 1 {TIMEOUT}: 2-0"
    assert feed.add(HTTP_500, "3-0", None, now=0.2) is None


def test_a_line_names_eight_ids_and_counts_the_rest() -> None:
    feed = FailureFeed(window_s=1.0)
    feed.add(HTTP_500, "0-0", None, now=0.0)
    for i in range(1, 21):
        feed.add(HTTP_500, f"{i}-0", "x\n" * 200, now=0.01 * i)

    line = feed.take(HTTP_500, now=1.0)

    assert line is not None and "\n" not in line
    assert line.startswith(f"failed: 20 {HTTP_500} in the last 1.0s: 1-0, 2-0,")
    assert ", 8-0, +12 more — first message: x x x" in line
    assert len(line) < 300


def test_the_end_takes_every_held_class() -> None:
    feed = FailureFeed(window_s=1.0)
    for label in (HTTP_500, TIMEOUT):
        feed.add(label, "1-0", None, now=0.0)
        feed.add(label, "2-0", None, now=0.1)
    assert feed.take_all(now=0.2) == [
        f"failed: 1 {HTTP_500}: 2-0",
        f"failed: 1 {TIMEOUT}: 2-0",
    ]


def test_a_stream_of_failures_prints_each_class_at_most_once_a_window() -> None:
    """The rule itself: a thousand failures of three classes at random times, a driver
    that takes a class when it is due, as the console's timers do."""
    rng = random.Random(7)
    feed, now = FailureFeed(window_s=1.0), 0.0
    printed: list[tuple[float, str]] = []
    for i in range(1000):
        now += rng.expovariate(50.0)
        for label in (HTTP_500, TIMEOUT, "protocol_violation"):
            if feed.due_at(label) <= now and (line := feed.take(label, now)):
                printed.append((now, line))
        label = rng.choice((HTTP_500, TIMEOUT, "protocol_violation"))
        if line := feed.add(label, f"{i}-0", None, now):
            printed.append((now, line))
    end = feed.take_all(now)

    counts = [int(line.split()[1]) for line in [line for _, line in printed] + end]
    assert sum(counts) == 1000  # every failure on exactly one line
    for label in (HTTP_500, TIMEOUT, "protocol_violation"):
        times = [t for t, line in printed if f" {label}" in line]
        assert all(b - a >= 1.0 for a, b in itertools.pairwise(times)), label
        assert len(times) < 20 * 1.5  # ~20 s of failures: about a line a second


class Timers:
    """Stands for ``loop.call_later``: the test fires what is due on its fake clock."""

    def __init__(self) -> None:
        self.now = 100.0
        self.pending: list[tuple[float, Callable[[], None]]] = []

    def clock(self) -> float:
        return self.now

    def call_later(self, delay_s: float, callback: Callable[..., None], *args: Any) -> None:
        self.pending.append((self.now + delay_s, lambda: callback(*args)))

    def advance(self, to: float) -> None:
        self.now = to
        due = [p for p in self.pending if p[0] <= to]
        self.pending = [p for p in self.pending if p[0] > to]
        for _, callback in due:
            callback()


def console(timers: Timers) -> tuple[TTY, Any]:
    tty = TTY()
    folding = ConsoleFolding(tty, colors=False, clock=timers.clock, call_later=timers.call_later)
    structlog.configure(
        processors=[folding, structlog.dev.ConsoleRenderer(colors=False)],
        logger_factory=structlog.WriteLoggerFactory(tty),
    )
    return tty, structlog.get_logger("dispatcher.run")


def failed(log: Any, rollout_id: str, status: int | None = 500) -> None:
    log.warning(
        "rollout_finished",
        rollout_id=rollout_id,
        outcome="agent_run_error" if status else "timeout_exceeded",
        http_status=status,
        failure_message=f"agent answered HTTP {status}" if status else "no answer within 30 s",
    )


def shown(tty: TTY) -> list[str]:
    # The stamp first: the rest is the line.
    return [line.split(" ", 1)[1] for line in render_terminal(tty.getvalue()) if line]


def test_the_console_shows_failures_folded_and_no_retries() -> None:
    timers = Timers()
    tty, log = console(timers)
    failed(log, "1-0")
    for i in range(2, 6):
        log.warning("rollout_retry", rollout_id=f"{i}-0", reason="http_503", retry=1)
        failed(log, f"{i}-0")
    log.info("rollout_finished", rollout_id="9-0", outcome="success")
    # "agent answered HTTP 500" says no more than the class: left out.
    assert shown(tty) == [f"failed: 1 {HTTP_500}: 1-0"]

    timers.advance(100.5)
    assert len(shown(tty)) == 1  # held: its window has not passed
    timers.advance(101.0)

    assert shown(tty)[1] == f"failed: 4 {HTTP_500} in the last 1.0s: 2-0, 3-0, 4-0, 5-0"
    assert "rollout_retry" not in tty.getvalue() and "9-0" not in tty.getvalue()


def test_the_summary_writes_what_is_held_then_one_short_line() -> None:
    timers = Timers()
    tty, log = console(timers)
    failed(log, "1-0")
    failed(log, "2-0", status=None)
    failed(log, "3-0")
    log.info(
        "run_summary",
        outcomes={"success": 7, "agent_run_error": 2, "timeout_exceeded": 1, "drained": 3},
        elapsed_s=128.4,
        rollouts_per_hour=3456.7,
        latency_s={"p50": 1.25, "p95": 4.5},
        retries={"sim": {"http_503": 500, "http_429": 431}, "b": {"http_503": 2}},
        remaining=3,
    )

    assert shown(tty)[1] == f"failed: 1 {TIMEOUT}: 2-0 — message: no answer within 30 s"
    assert shown(tty)[2:] == [
        f"failed: 1 {HTTP_500}: 3-0",
        "run ended: 7 succeeded, 3 failed, 3 drained in 2m08s; 3,457 rollouts/h; "
        "p50 1.2s p95 4.5s; retries 933 (503 502, 429 431)",
    ]
    assert "outcomes=" not in tty.getvalue()
    timers.advance(200.0)  # its timer finds nothing left
    assert len(shown(tty)) == 4


def test_a_timer_set_before_a_summary_does_not_cut_the_next_window_short() -> None:
    # Serve: one job's summary writes every held failure; another job's go on.
    timers = Timers()
    tty, log = console(timers)
    failed(log, "1-0")  # at 100.0: at once
    failed(log, "2-0")  # held; a timer for 101.0
    timers.advance(100.6)
    log.info("run_summary", outcomes={})  # writes 2-0 at 100.6: the next line at 101.6
    failed(log, "3-0")

    timers.advance(101.0)  # the first timer: too early for 3-0
    assert [line for line in shown(tty) if "3-0" in line] == []
    timers.advance(101.6)
    assert shown(tty)[-1] == f"failed: 1 {HTTP_500}: 3-0"


def test_an_error_comes_after_the_failures_held_before_it() -> None:
    timers = Timers()
    tty, log = console(timers)
    failed(log, "1-0")
    failed(log, "2-0")
    log.warning("replica_opened", replica="http://a")  # a warning waits its turn
    log.error("run_failed", error="no rollout succeeded")

    rows = [row for row in render_terminal(tty.getvalue()) if row]
    assert "replica_opened" in rows[1]
    assert rows[2].endswith(f" failed: 1 {HTTP_500}: 2-0")
    assert "run_failed" in rows[3]


def test_summary_line_without_figures() -> None:
    assert summary_line({"outcomes": {}}) == "run ended: 0 succeeded, 0 failed in -; p50 - p95 -"
    assert summary_line({}, "j7").startswith("job j7 ended: 0 succeeded")


def test_console_on_a_terminal_installs_the_folding_and_debug_does_not() -> None:
    tty = TTY()
    configure_logging("console", stream=tty, level="info")
    log = structlog.get_logger("dispatcher.run")
    log.warning("rollout_retry", rollout_id="1-0", reason="http_503")
    failed(log, "2-0")
    screen = render_terminal(tty.getvalue())
    assert "rollout_retry" not in tty.getvalue()
    assert re.search(rf"failed: 1 {re.escape(HTTP_500)}: 2-0", screen[0])

    tty = TTY()
    configure_logging("console", stream=tty, level="debug")
    log.warning("rollout_retry", rollout_id="1-0", reason="http_503")
    failed(log, "2-0")
    screen = render_terminal(tty.getvalue())
    assert "rollout_retry" in screen[0] and "rollout_finished" in screen[1]


def test_console_off_a_terminal_is_as_it_was() -> None:
    stream = io.StringIO()  # not a tty: console format written to a file
    configure_logging("console", stream=stream, level="info")
    log = structlog.get_logger("dispatcher.run")
    log.warning("rollout_retry", rollout_id="1-0", reason="http_503")
    failed(log, "2-0")
    log.info("run_summary", outcomes={"success": 1})
    text = stream.getvalue()
    assert "rollout_retry" in text and "run_summary" in text and "failed:" not in text


def test_json_lines_keep_every_event() -> None:
    stream = TTY()  # JSON even on a terminal when asked for
    configure_logging("json", stream=stream, level="info")
    log = structlog.get_logger("dispatcher.run")
    log.warning("rollout_retry", rollout_id="1-0", reason="http_503")
    failed(log, "2-0")
    log.info("run_summary", outcomes={"success": 1})
    events = [orjson.loads(line) for line in stream.getvalue().splitlines()]
    assert [e["event"] for e in events] == ["rollout_retry", "rollout_finished", "run_summary"]
    assert events[1]["rollout_id"] == "2-0" and events[1]["http_status"] == 500
