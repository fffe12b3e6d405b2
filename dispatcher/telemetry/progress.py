"""Progress figures for humans: the `progress` event fields and a live terminal line.

Everything reads the run-status snapshot (the `/status` body), so
the log event, the terminal line and the endpoint always agree.
"""

from __future__ import annotations

import asyncio
import io
import math
import os
import shutil
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from dispatcher.aio import cancel_and_wait
from dispatcher.outcome import Outcome

UNKNOWN = "-"
# Erase from the cursor to the end of the line (ANSI, understood by every
# terminal a training job is watched from).
_ERASE_TO_EOL = "\x1b[K"
# Outcomes that wrote no failure row: cancelled, drained and kill-shaped ones
# run again on resume, so they are not counted as failed.
_NOT_FAILURES = frozenset(o.value for o in Outcome if not o.writes_failure_row)


def estimate_eta_s(remaining: int, rollouts_per_hour: float) -> float | None:
    """Seconds until `remaining` rollouts finish at the current rate; None when unknowable."""
    if remaining <= 0:
        return 0.0
    if not rollouts_per_hour > 0 or not math.isfinite(rollouts_per_hour):
        return None
    return remaining * 3600.0 / rollouts_per_hour


def progress_fields(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """Flat fields of the `progress` log event, taken from a status snapshot."""
    progress = snapshot.get("progress") or {}
    latency = snapshot.get("latency_s") or {}
    return {
        "state": snapshot.get("state"),
        "elapsed_s": _round(snapshot.get("elapsed_s")),
        "done": progress.get("done"),
        "expected": progress.get("expected"),
        "remaining": progress.get("remaining"),
        "in_flight": progress.get("in_flight"),
        "limit": _limit(snapshot),
        "failed": _failed(snapshot.get("outcomes") or {}),
        "drained": snapshot.get("drained"),
        "rollouts_per_hour": _round(snapshot.get("rollouts_per_hour")),
        "p50_s": _round(latency.get("p50")),
        "p75_s": _round(latency.get("p75")),
        "p95_s": _round(latency.get("p95")),
        "drain_margin_s": _round(snapshot.get("drain_margin_s")),
        "budget_remaining_s": _round(snapshot.get("budget_remaining_s")),
        "eta_s": _round(snapshot.get("eta_s")),
    }


def format_progress(snapshot: Mapping[str, Any]) -> str:
    """One line: done/total, rate, p50/p75/p95, drain margin, budget left, ETA.

    Rate and latency sit next to each other on purpose: a rising rate with a
    rising p95 means rollouts are slowing down, not the run speeding up.
    """
    return _compose(_line_fields(snapshot), frozenset())


def _line_fields(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    # Retries are the line's own: the `progress` event's fields stay as they were.
    return {**progress_fields(snapshot), "retries": retries_text(snapshot.get("retries") or {})}


def retries_text(retries: Mapping[str, Mapping[str, int]]) -> str:
    """Retries of every agent by reason, most first: ``retries 931 (503 520, 429 411)``.

    The reasons are the retry rule's (``http_503`` reads ``503``); "" without retries.
    """
    by_reason: dict[str, int] = {}
    for reasons in retries.values():
        for reason, n in reasons.items():
            # http_409_admission_closed reads 409
            short = reason.split("_")[1] if reason.startswith("http_") else reason
            by_reason[short] = by_reason.get(short, 0) + n
    total = sum(by_reason.values())
    if not total:
        return ""
    ranked = sorted(by_reason.items(), key=lambda item: -item[1])
    return f"retries {total:,} (" + ", ".join(f"{r} {n:,}" for r, n in ranked) + ")"


# What a narrow terminal loses first. Done, budget left and ETA are never
# dropped: they are what someone glancing at a job's terminal needs. The
# state goes only while it is the unremarkable "running".
_DROP_ORDER = (
    "in_flight",
    "state",
    "p50_p75",
    "margin",
    "drained",
    "rate_label",
    "retries",
    "failed",
    "p95",
    "rate",
)


def fit_progress(snapshot: Mapping[str, Any], width: int) -> str:
    """`format_progress` shortened to `width` columns by dropping its least useful parts."""
    fields = _line_fields(snapshot)
    dropped: frozenset[str] = frozenset()
    line = _compose(fields, dropped)
    for name in _DROP_ORDER:
        if len(line) <= width:
            return line
        dropped |= {name}
        line = _compose(fields, dropped)
    # Narrower than done + budget + ETA: a wrapped line cannot be redrawn with \r.
    return line[:width]


def _compose(f: Mapping[str, Any], dropped: frozenset[str]) -> str:
    state = None if "state" in dropped and f["state"] == "running" else f["state"]
    parts = [" ".join(p for p in (state, _done(f["done"], f["expected"])) if p)]
    if "rate" not in dropped:
        label = "/h" if "rate_label" in dropped else " rollouts/h"
        parts.append(f"{_rate(f['rollouts_per_hour'])}{label}")
    if "p95" not in dropped:
        parts.append(_latency(f, full="p50_p75" not in dropped))
    if "margin" not in dropped:
        parts.append(f"margin {duration_text(f['drain_margin_s'])}")
    parts.append(f"budget left {duration_text(f['budget_remaining_s'])}")
    parts.append(f"ETA {duration_text(f['eta_s'])}")
    if "in_flight" not in dropped:
        limit = f"/{f['limit']:,}" if f["limit"] is not None else ""
        parts.append(f"in flight {_count(f['in_flight'])}{limit}")
    if f["failed"] and "failed" not in dropped:
        parts.append(f"failed {f['failed']:,}")
    if f["drained"] and "drained" not in dropped:
        parts.append(f"drained {f['drained']:,}")
    if f["retries"] and "retries" not in dropped:
        parts.append(f["retries"])
    return " | ".join(parts)


def _latency(f: Mapping[str, Any], *, full: bool) -> str:
    p95 = f"p95 {duration_text(f['p95_s'])}"
    if not full:
        return p95
    return f"p50 {duration_text(f['p50_s'])} p75 {duration_text(f['p75_s'])} {p95}"


def _limit(snapshot: Mapping[str, Any]) -> int | None:
    """Rollouts allowed in flight now: the agents' limits summed, within the pool's."""
    pool = snapshot.get("pool_limit")
    agents = snapshot.get("concurrency") or {}
    limits = [a.get("limit") for a in agents.values()]
    pool_limit = pool if type(pool) is int else None
    if not limits or not all(type(n) is int for n in limits):
        return pool_limit
    total = sum(int(n) for n in limits)
    return total if pool_limit is None else min(total, pool_limit)


def _failed(outcomes: Mapping[str, int]) -> int:
    return sum(n for outcome, n in outcomes.items() if outcome not in _NOT_FAILURES)


def _round(value: Any) -> float | None:
    if isinstance(value, int | float) and math.isfinite(value):
        return round(float(value), 3)
    return None


def _done(done: int | None, expected: int | None) -> str:
    if done is None:
        return UNKNOWN
    if not expected:
        return f"{done:,} done"
    return f"{done:,}/{expected:,} ({100.0 * done / expected:.1f}%)"


def _count(value: int | None) -> str:
    return UNKNOWN if value is None else f"{value:,}"


def _rate(per_hour: float | None) -> str:
    if per_hour is None:
        return UNKNOWN
    return f"{per_hour:,.1f}" if per_hour < 10 else f"{per_hour:,.0f}"


def duration_text(seconds: float | None) -> str:
    """Compact human duration: 850ms, 42.1s, 12m05s, 2h31m ("-" when unknown)."""
    if seconds is None:
        return UNKNOWN
    if seconds <= 0:
        return "0s"  # a spent budget can read slightly negative
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = round(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


class LiveTerminal(io.TextIOBase):
    """A terminal stream with one live line kept below everything written.

    A line written through it first erases the live line, which is redrawn
    after the newline, so progress and log output never garble each other.
    Writers are the loop, stdlib log handlers and worker threads: one lock.
    """

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self._stream = stream
        self._live = ""
        self._live_shown = False
        self._lock = threading.Lock()

    def isatty(self) -> bool:
        return is_terminal(self._stream)

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        stream = self._stream
        with self._lock:
            if self._live_shown:
                stream.write("\r" + _ERASE_TO_EOL)
                self._live_shown = False
            stream.write(text)
            if self._live and text.endswith("\n"):
                stream.write(self._live)
                self._live_shown = True
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def write_beside(self, other: TextIO, text: str) -> None:
        """Write whole lines to another stream on the same terminal (stdout beside
        stderr): the live line is erased first and redrawn below them, or the
        two would share a row."""
        with self._lock:
            if self._live_shown:
                self._stream.write("\r" + _ERASE_TO_EOL)
                self._stream.flush()
            other.write(text)
            other.flush()
            self._live_shown = bool(self._live)
            if self._live:
                self._stream.write(self._live)
                self._stream.flush()

    def set_live(self, line: str) -> None:
        """Replace the live line ("" removes it)."""
        with self._lock:
            self._live = line
            self._live_shown = bool(line)
            self._stream.write("\r" + line + _ERASE_TO_EOL)
            self._stream.flush()


_terminals: weakref.WeakKeyDictionary[TextIO, LiveTerminal] = weakref.WeakKeyDictionary()
# Streams console logging currently writes to (set by `configure_logging`).
_console_streams: weakref.WeakSet[TextIO] = weakref.WeakSet()


def set_console_stream(stream: TextIO | None) -> None:
    """Record which stream console logging uses (None: logging is not console)."""
    _console_streams.clear()
    if stream is not None:
        _console_streams.add(stream)


def console_on_terminal(stream: TextIO) -> bool:
    """Whether console logging writes to ``stream`` and it is a terminal: a person reads it."""
    return stream in _console_streams and is_terminal(stream)


def live_terminal(stream: TextIO) -> LiveTerminal:
    """The one `LiveTerminal` of a stream, shared by console logging and `ProgressLine`."""
    terminal = _terminals.get(stream)
    if terminal is None:
        terminal = _terminals[stream] = LiveTerminal(stream)
    return terminal


def write_line(stream: TextIO, line: str) -> None:
    """Write ``line`` (and a newline) to ``stream``, off the live line's row when both
    are on a terminal: `serve`'s "listening on" (stdout) beside the progress line (stderr)."""
    terminals = [_terminals[s] for s in _console_streams if s in _terminals]
    if terminals and is_terminal(stream):
        terminals[0].write_beside(stream, line + "\n")
        return
    stream.write(line + "\n")
    stream.flush()


def is_terminal(stream: Any) -> bool:
    """Whether a stream says it is a terminal (streams without `isatty` are not)."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty()) if callable(isatty) else False


def _columns(stream: TextIO) -> int:
    # The stream's own terminal: stdout may be redirected while stderr is not.
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        columns = 0
    # 0 is what a fresh pty reports before anyone sets its size.
    return columns if columns > 0 else shutil.get_terminal_size().columns


class ProgressLine:
    """The live progress line of console mode; never drawn unless the stream is a tty.

    `enabled=None` draws it when console logging writes to the same stream;
    next to JSON lines it would garble them. Off a terminal the `progress` log
    events carry the same figures, and `\\r` rewrites would litter a log file.
    """

    def __init__(self, stream: TextIO | None = None, *, enabled: bool | None = None) -> None:
        stream = sys.stderr if stream is None else stream
        wanted = stream in _console_streams if enabled is None else enabled
        self.enabled = wanted and is_terminal(stream)
        self._stream = stream
        self._terminal = live_terminal(stream)
        self._task: asyncio.Task[None] | None = None

    def show(self, snapshot: Mapping[str, Any]) -> None:
        if self.enabled:
            # A wrapped line cannot be rewritten with \r: fit it to the width.
            width = max(_columns(self._stream) - 1, 20)
            self._terminal.set_live(fit_progress(snapshot, width))

    def clear(self) -> None:
        if self.enabled:
            self._terminal.set_live("")

    async def start(self, status: Callable[[], Mapping[str, Any]], interval_s: float = 1.0) -> None:
        """Redraw from `status()` every `interval_s` until `stop()`."""
        if self.enabled and self._task is None:
            self._task = asyncio.create_task(self.run(status, interval_s), name="progress")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        self.clear()

    async def run(self, status: Callable[[], Mapping[str, Any]], interval_s: float = 1.0) -> None:
        """Redraw until cancelled (then clear the line): the body of the owner's task."""
        if not self.enabled:
            return
        try:
            while True:
                self.show(status())
                await asyncio.sleep(interval_s)
        finally:
            self.clear()
