"""What a person at a terminal reads besides the progress line (console logs on a tty).

A run against agents that answer some 429s and 500s used to print a line
per retry (harmless: the retry rule handles them) and nothing for the task
failures (what the operator must see). On a terminal, below ``--log-level
debug``, ``ConsoleFolding`` turns that around:

- a task failure (``rollout_finished`` with an outcome that wrote a failure
  row) is shown as it happens, folded with the others of its class: at most
  one line per class a second (``FailureFeed``);
- ``rollout_retry`` lines are dropped: the progress line counts retries by
  reason;
- ``run_summary`` becomes one short line; ``dispatcher run`` follows it with
  the ``status`` table and what to do next (``ops/ending.py``).

Off a terminal nothing here runs: the JSON lines stay one event each.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, WrappedLogger

from dispatcher.outcome import Outcome
from dispatcher.telemetry.progress import duration_text, retries_text

# ``loop.call_later``'s shape.
CallLater = Callable[[float, Callable[[str], None], str], object]
FOLD_WINDOW_S = 1.0
# Rollout ids named on one line; the rest are counted.
SHOWN_IDS = 8
MESSAGE_CHARS = 160
_FAILED = frozenset(o.value for o in Outcome if o.writes_failure_row)
_ERRORS = frozenset({"error", "exception", "critical", "fatal"})
# One line each at debug only: the progress line counts them.
FOLDED_AWAY = frozenset({"rollout_retry"})
_RED, _BOLD, _DIM, _RESET = "\x1b[31;1m", "\x1b[1m", "\x1b[2m", "\x1b[0m"


@dataclass
class _Held:
    """Failures of one class waiting for their class's next line."""

    ids: list[str] = field(default_factory=list)
    count: int = 0
    message: str | None = None


@dataclass
class FailureFeed:
    """Task failures folded by class: a class prints at most once per ``window_s``.

    Pure bookkeeping on a clock the caller passes: ``add`` returns the line to
    print now (the class was quiet for a window) or None (held for
    ``take``, due at ``due_at``). Called on failures only, never per rollout.
    """

    window_s: float = FOLD_WINDOW_S
    _last: dict[str, float] = field(default_factory=dict, init=False)
    _held: dict[str, _Held] = field(default_factory=dict, init=False)

    def add(self, label: str, rollout_id: str, message: str | None, now: float) -> str | None:
        held = self._held.setdefault(label, _Held())
        held.count += 1
        if len(held.ids) < SHOWN_IDS:
            held.ids.append(rollout_id)
        if held.message is None:
            held.message = message
        if held.count == 1 and now >= self.due_at(label):
            return self.take(label, now)
        return None

    def due_at(self, label: str) -> float:
        """When ``label`` may print its next line."""
        last = self._last.get(label)
        return float("-inf") if last is None else last + self.window_s

    def holds(self, label: str) -> bool:
        """Whether failures of ``label`` wait for their line."""
        return label in self._held

    def take(self, label: str, now: float) -> str | None:
        """The line of the failures held for ``label`` (None if there are none)."""
        held = self._held.pop(label, None)
        if held is None:
            return None
        last = self._last.get(label)
        self._last[label] = now
        since = None if last is None else now - last
        return failure_line(label, held, since)

    def take_all(self, now: float) -> list[str]:
        """Every held line, whatever the window: the end of a job."""
        return [line for label in list(self._held) if (line := self.take(label, now))]


def failure_line(label: str, held: _Held, since_s: float | None) -> str:
    """``3 agent_run_error (HTTP 500) in the last 1.0s: 12-0, 14-3, 15-1 — first message: ...``"""
    what = f"{held.count} {label}"
    if held.count > 1 and since_s is not None:
        what += f" in the last {since_s:.1f}s"
    ids = ", ".join(held.ids)
    if held.count > len(held.ids):
        ids += f", +{held.count - len(held.ids)} more"
    line = f"failed: {what}: {ids}"
    if held.message:
        first = "first message" if held.count > 1 else "message"
        line += f" — {first}: {_one_line(held.message)}"
    return line


def failure_label(event: Mapping[str, Any]) -> str:
    """A failure's class as a person reads it: ``agent_run_error (HTTP 500)``."""
    status = event.get("http_status")
    outcome = str(event.get("outcome"))
    return f"{outcome} (HTTP {status})" if status else outcome


def summary_line(event: Mapping[str, Any], job_id: str | None = None) -> str:
    """``run_summary`` in one line: outcomes, time, rate, latency, retries (a serve
    job's names its job)."""
    outcomes: Mapping[str, int] = event.get("outcomes") or {}
    failed = sum(n for name, n in outcomes.items() if name in _FAILED)
    parts = [f"{outcomes.get(Outcome.SUCCESS.value, 0):,} succeeded", f"{failed:,} failed"]
    parts += [
        f"{n:,} {name}"
        for name, n in outcomes.items()
        if n and name != Outcome.SUCCESS.value and name not in _FAILED
    ]
    line = ("run ended: " if job_id is None else f"job {job_id} ended: ") + ", ".join(parts)
    line += f" in {duration_text(event.get('elapsed_s'))}"
    rate = event.get("rollouts_per_hour")
    if isinstance(rate, int | float):
        line += f"; {rate:,.0f} rollouts/h"
    latency = event.get("latency_s") or {}
    line += f"; p50 {duration_text(latency.get('p50'))} p95 {duration_text(latency.get('p95'))}"
    retries = retries_text(event.get("retries") or {})
    return line + (f"; {retries}" if retries else "")


def _one_line(message: str) -> str:
    text = " ".join(message.split())
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 1] + "…"


class ConsoleFolding:
    """The structlog step of console logs on a terminal; see the module docstring.

    It writes its lines straight to the terminal's stream (the ``LiveTerminal``,
    which keeps them above the live line; write errors are the caller's to
    swallow, as logs.py's wrapper does) and
    drops the events it replaced. Held failures are written by a timer at
    their class's next slot, or at the job's ``run_summary``.
    """

    def __init__(
        self,
        terminal: TextIO,
        *,
        colors: bool,
        clock: Callable[[], float] = time.monotonic,
        call_later: CallLater | None = None,
    ) -> None:
        self._terminal = terminal
        self._colors = colors
        self._clock = clock
        # The running loop's, unless a test drives the clock.
        self._call_later = call_later
        self._feed = FailureFeed()
        self._timers: set[str] = set()
        # Events come from the loop; stdlib records and threads may log too.
        self._lock = threading.Lock()

    def __call__(self, _: WrappedLogger, method: str, event_dict: EventDict) -> EventDict:
        event = event_dict.get("event")
        if event == "rollout_finished":
            if event_dict.get("outcome") in _FAILED:
                self._failed(event_dict)
            raise structlog.DropEvent
        if event in FOLDED_AWAY:
            raise structlog.DropEvent
        if event == "run_summary":
            self.flush()
            job_id = structlog.contextvars.get_contextvars().get("job_id")
            self._write("info", summary_line(event_dict, job_id))
            raise structlog.DropEvent
        if method in _ERRORS:
            # An error often ends the run: the failures before it come first.
            self.flush()
        return event_dict

    def flush(self) -> None:
        """Write every held failure now."""
        with self._lock:
            lines = self._feed.take_all(self._clock())
        for line in lines:
            self._write("warning", line)

    def _failed(self, event: EventDict) -> None:
        label = failure_label(event)
        message = event.get("failure_message")
        if message == f"agent answered HTTP {event.get('http_status')}":
            message = None  # the label says it already
        with self._lock:
            line = self._feed.add(label, str(event.get("rollout_id")), message, self._clock())
            wait_s = None if line is not None else self._feed.due_at(label) - self._clock()
        if line is not None:
            self._write("warning", line)
        elif wait_s is not None:
            self._wake(label, wait_s)

    def _wake(self, label: str, wait_s: float) -> None:
        """Write ``label``'s held failures once its window has passed."""
        if label in self._timers:
            return
        call_later = self._call_later
        if call_later is None:
            try:
                call_later = asyncio.get_running_loop().call_later
            except RuntimeError:  # no loop to wait on (a thread): show them now
                self._write_held(label)
                return
        self._timers.add(label)
        call_later(max(wait_s, 0.0), self._on_due, label)

    def _on_due(self, label: str) -> None:
        """A timer's end: the held failures, unless the window moved on since it was set
        (a summary wrote them, and newer ones wait for a window of their own)."""
        self._timers.discard(label)
        with self._lock:
            wait_s = self._feed.due_at(label) - self._clock()
        if wait_s > 0:
            if self._feed.holds(label):
                self._wake(label, wait_s)
            return
        self._write_held(label)

    def _write_held(self, label: str) -> None:
        with self._lock:
            line = self._feed.take(label, self._clock())
        if line is not None:
            self._write("warning", line)

    def _write(self, level: str, text: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        if self._colors:
            color = _RED if level == "warning" else _BOLD
            text = f"{_DIM}{stamp}{_RESET} {color}{text}{_RESET}"
        else:
            text = f"{stamp} {text}"
        self._terminal.write(text + "\n")
        self._terminal.flush()
