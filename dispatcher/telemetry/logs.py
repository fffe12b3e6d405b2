"""structlog setup: JSON lines for machines, a readable console for people.

JSON lines carry `event`, `level`, `timestamp` (ISO 8601, UTC), `logger` and
the event's fields, serialized with orjson. Records of the stdlib `logging`
module (aiohttp, asyncio) at WARNING and above go through the same renderer,
so an "exception was never retrieved" shows up in the JSON stream too.

Logging never stops dispatch: a log stream that cannot be written (a full
disk, ``2>/dev/full``, a closed pipe as in ``| head -c 100``) loses log lines,
never rollouts. Every stream is wrapped so that its write errors are counted
(``dropped_log_writes``) and swallowed.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import logging
import sys
import time
from typing import Any, ClassVar, Literal, TextIO, cast

import orjson
import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from dispatcher.telemetry.console import ConsoleFolding
from dispatcher.telemetry.progress import is_terminal, live_terminal, set_console_stream
from dispatcher.urls import scrub

LogFormat = Literal["json", "console"]
DEFAULT_LOGGER = "dispatcher"
# Shown at every log level: a run must always end by saying how it went.
ALWAYS_SHOWN = frozenset({"run_summary"})
# One line per rollout: on the console only at debug, where they scroll above
# the live progress line instead of burying it.
PER_ROLLOUT = frozenset({"rollout_finished"})
_FIRST_KEYS = ("event", "level", "timestamp", "logger")


def get_logger(name: str) -> Any:
    """A structlog logger whose events carry `logger=name`; same as `structlog.get_logger(name)`.

    The proxy resolves the configuration on each call, so a module-level
    logger follows a later `configure_logging`. On a hot path, bind it once
    after configuration (`get_logger(...).bind()`) to skip that lookup.
    """
    return structlog.get_logger(name)


def resolve_log_format(fmt: LogFormat | None, stream: TextIO) -> LogFormat:
    """The explicit format, else console on a terminal and JSON everywhere else."""
    if fmt is not None:
        if fmt not in ("json", "console"):
            raise ValueError(f"log format must be 'json' or 'console', got {fmt!r}")
        return fmt
    return "console" if is_terminal(stream) else "json"


def configure_logging(
    fmt: LogFormat | None,
    *,
    stream: TextIO | None = None,
    level: int | str = logging.INFO,
) -> LogFormat:
    """Route structlog (and stdlib warnings) to `stream` (default: stderr); returns the format.

    Safe to call again: each call replaces the previous configuration.
    """
    stream = sys.stderr if stream is None else stream
    resolved = resolve_log_format(fmt, stream)
    level_no = _level_number(level)
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _utc_timestamp,
        _add_logger_name,
    ]
    renderer, out = _renderer_and_output(resolved, stream)
    # JSON lines take one step that does what ``shared`` and ``renderer`` do:
    # the same line, without a call per processor (it runs once per rollout).
    chain = [json_line] if resolved == "json" else [*shared, *renderer]
    folding = _console_folding(resolved, level_no, stream, out)
    structlog.configure(
        processors=[*_event_filters(resolved, level_no, folding), *chain],
        # Info passes the wrapper even at warning, so the summary can; the
        # filters above drop the rest of it.
        wrapper_class=structlog.make_filtering_bound_logger(min(level_no, logging.INFO)),
        logger_factory=_NamedWriteLoggerFactory(out),
        # Caching would pin loggers to the first configuration.
        cache_logger_on_first_use=False,
    )
    _route_stdlib(out, shared, renderer)
    set_console_stream(stream if resolved == "console" else None)
    return resolved


def _level_number(level: int | str) -> int:
    """A level's number, from its number or its name in any case."""
    level_no = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(level_no, int):
        raise ValueError(f"unknown log level {level!r}")
    return level_no


def _renderer_and_output(resolved: LogFormat, stream: TextIO) -> tuple[list[Processor], TextIO]:
    """The processors that render a line in ``resolved``, and the unfailing stream it goes to."""
    renderer: list[Processor]
    out: TextIO = stream
    if resolved == "json":
        renderer = [_TRACEBACKS, _first_keys, _json_renderer()]
        if stream is sys.stderr:
            out = _coalescing_stderr()
    else:
        renderer = [
            structlog.dev.ConsoleRenderer(
                colors=is_terminal(stream), exception_formatter=structlog.dev.plain_traceback
            )
        ]
        if is_terminal(stream):
            # Shares the stream with the live progress line, which it redraws.
            out = cast(TextIO, live_terminal(stream))
    return renderer, cast(TextIO, _Unfailing(out))


# Tracebacks as data, without their frames' locals: those held agent URLs and the
# API token (structlog's ``dict_tracebacks`` renders them).
_TRACEBACKS = structlog.processors.ExceptionRenderer(
    structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
)


class _Unfailing:
    """A stream whose write and flush errors are counted and swallowed, and whose
    lines never show a secret the process knows (``urls.scrub``): every log line,
    ours or the stdlib's, goes through it.

    Not marked broken for good after one error: a full disk may get space back.
    """

    dropped = 0  # across every wrapped stream of the process

    def __init__(self, raw: TextIO | _CoalescingStream) -> None:
        self._raw = raw

    def write(self, text: str) -> int:
        try:
            return self._raw.write(scrub(text))
        except (OSError, ValueError):
            _Unfailing.dropped += 1
            return len(text)

    def flush(self) -> None:
        try:
            self._raw.flush()
        except (OSError, ValueError):
            _Unfailing.dropped += 1

    def isatty(self) -> bool:
        return is_terminal(self._raw)


def dropped_log_writes() -> int:
    """Log writes (or flushes) lost because the log stream could not be written."""
    return _Unfailing.dropped


def _event_filters(fmt: LogFormat, level_no: int, folding: Processor | None) -> list[Processor]:
    # Only installed when they can drop something: at the default level the
    # per-rollout path pays nothing for them.
    filters: list[Processor] = []
    if level_no > logging.INFO:
        filters.append(_BelowLevelButSummary(level_no))
    if fmt == "console" and level_no > logging.DEBUG:
        filters.append(folding or _drop_per_rollout)
    return filters


def _console_folding(
    fmt: LogFormat, level_no: int, stream: TextIO, out: TextIO
) -> Processor | None:
    """On a terminal below debug: failures folded by class, retries counted, a short
    summary (``telemetry/console.py``); it also drops the per-rollout lines."""
    if fmt != "console" or level_no <= logging.DEBUG or not is_terminal(stream):
        return None
    return ConsoleFolding(out, colors=True)


class _BelowLevelButSummary:
    """Drops events below the configured level, except those of ``ALWAYS_SHOWN``."""

    _LEVELS: ClassVar[dict[str, int]] = {
        "debug": logging.DEBUG,
        "info": logging.INFO,
        "warning": logging.WARNING,
    }

    def __init__(self, level_no: int) -> None:
        self._level_no = level_no

    def __call__(self, _: WrappedLogger, method: str, event_dict: EventDict) -> EventDict:
        below = self._LEVELS.get(method, logging.CRITICAL) < self._level_no
        if below and event_dict.get("event") not in ALWAYS_SHOWN:
            raise structlog.DropEvent
        return event_dict


def _drop_per_rollout(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    if event_dict.get("event") in PER_ROLLOUT:
        raise structlog.DropEvent
    return event_dict


class _CoalescingStream:
    """stderr for JSON lines, flushed at most every 50 ms while an event loop runs.

    A write(2) per line costs more than rendering the line, at thousands of
    rollouts a second; coalesced, lines still reach a tailed file within
    50 ms. Without a running loop (startup, errors) every line is flushed at
    once, and whatever is buffered is flushed at exit.
    """

    _DELAY_S = 0.05

    def __init__(self, raw: TextIO) -> None:
        self._raw = raw
        self._scheduled = False

    def write(self, text: str) -> int:
        return self._raw.write(text)

    def flush(self) -> None:
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._raw.flush()
            return
        self._scheduled = True
        loop.call_later(self._DELAY_S, self.flush_now)

    def flush_now(self) -> None:
        self._scheduled = False
        with contextlib.suppress(ValueError, OSError):
            self._raw.flush()

    def isatty(self) -> bool:
        return False


_coalescing: _CoalescingStream | None = None


def _coalescing_stderr() -> TextIO:
    global _coalescing
    if _coalescing is None:
        # Its own buffer on fd 2: sys.stderr is line-buffered, one write per line.
        raw = open(  # noqa: SIM115 - lives as long as the process
            sys.stderr.fileno(), "w", buffering=1 << 16, encoding="utf-8", closefd=False
        )
        _coalescing = _CoalescingStream(raw)
        atexit.register(_coalescing.flush_now)
    return cast(TextIO, _coalescing)


def flush_logs() -> None:
    """Write out buffered log lines now (before other output on stderr)."""
    if _coalescing is not None:
        _coalescing.flush_now()


def reset_logging() -> None:
    """Undo `configure_logging`: structlog defaults, our stdlib handler removed."""
    structlog.reset_defaults()
    _remove_stdlib_handler()
    set_console_stream(None)


def _json_renderer() -> Processor:
    def dumps(obj: Any, **_: Any) -> str:
        # default=str: a Path or an exception in a field must not lose the line.
        return orjson.dumps(obj, default=str, option=orjson.OPT_NON_STR_KEYS).decode()

    return structlog.processors.JSONRenderer(serializer=dumps)


class NamedWriteLogger(structlog.WriteLogger):
    """A WriteLogger that remembers the name given to `structlog.get_logger(name)`."""

    def __init__(self, file: TextIO, name: str) -> None:
        super().__init__(file)
        self.name = name
        self.out = file


class _NamedWriteLoggerFactory:
    # structlog's own factory drops the positional name; keep it for `logger`.
    def __init__(self, file: TextIO) -> None:
        self._file = file

    def __call__(self, *args: Any) -> NamedWriteLogger:
        name = args[0] if args and isinstance(args[0], str) else DEFAULT_LOGGER
        return NamedWriteLogger(self._file, name)


def _add_logger_name(logger: WrappedLogger, _: str, event_dict: EventDict) -> EventDict:
    # Stdlib records already carry their logger's name (added before this runs).
    if "logger" not in event_dict:
        event_dict["logger"] = getattr(logger, "name", None) or DEFAULT_LOGGER
    return event_dict


class _TimestampCache:
    second = -1
    prefix = ""


_DIGITS3 = tuple(f"{n:03d}" for n in range(1000))


def now_iso() -> str:
    """Now in ISO 8601 UTC with microseconds, like TimeStamper(fmt="iso", utc=True),
    4x cheaper: the date part is formatted once a second, not on every event."""
    now = time.time()
    second = int(now)
    if second != _TimestampCache.second:
        _TimestampCache.second = second
        _TimestampCache.prefix = time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(second))
    micros = int((now - second) * 1_000_000)
    return _TimestampCache.prefix + _DIGITS3[micros // 1000] + _DIGITS3[micros % 1000] + "Z"


def _utc_timestamp(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    """The event's ``timestamp`` (``now_iso``); it runs once per event."""
    event_dict["timestamp"] = now_iso()
    return event_dict


# structlog's ``add_log_level`` names these two methods by their level.
_LEVEL_OF_METHOD = {"warn": "warning", "exception": "error"}
_CONTEXT_PREFIX = "structlog_"
_CONTEXT_PREFIX_CHARS = len(_CONTEXT_PREFIX)


def context_fields() -> list[tuple[str, Any]]:
    """The fields bound by ``structlog.contextvars``, in ``merge_contextvars``'s order."""
    keys = _CONTEXT_KEYS
    return [
        (key, value)
        for var, value in contextvars.copy_context().items()
        if (key := keys[var] if var in keys else _context_key(var)) is not None
        and value is not Ellipsis
    ]


# The field each context variable is bound to (None: not structlog's); there are few.
_CONTEXT_KEYS: dict[contextvars.ContextVar[Any], str | None] = {}


def _context_key(var: contextvars.ContextVar[Any]) -> str | None:
    name = var.name
    key = name[_CONTEXT_PREFIX_CHARS:] if name.startswith(_CONTEXT_PREFIX) else None
    _CONTEXT_KEYS[var] = key
    return key


def json_line(logger: WrappedLogger, method: str, event_dict: EventDict) -> str:
    """The JSON chain in one step: ``merge_contextvars``, ``add_log_level``,
    ``_utc_timestamp``, ``_add_logger_name``, ``_TRACEBACKS``, ``_first_keys``
    and the orjson renderer give this same line."""
    for key, value in context_fields():
        event_dict.setdefault(key, value)
    event_dict["level"] = _LEVEL_OF_METHOD.get(method, method)
    _utc_timestamp(logger, method, event_dict)
    if "logger" not in event_dict:
        event_dict["logger"] = getattr(logger, "name", None) or DEFAULT_LOGGER
    if "exc_info" in event_dict:
        event_dict = _TRACEBACKS(logger, method, event_dict)
    line = {"event": event_dict.get("event")} if "event" in event_dict else {}
    line["level"] = event_dict["level"]
    line["timestamp"] = event_dict["timestamp"]
    line["logger"] = event_dict["logger"]
    line.update(event_dict)
    return orjson.dumps(line, default=str, option=orjson.OPT_NON_STR_KEYS).decode()


def _first_keys(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    """Put event, level, timestamp and logger first, for people reading raw lines."""
    ordered = {k: event_dict[k] for k in _FIRST_KEYS if k in event_dict}
    ordered.update(event_dict)
    return ordered


class _StdlibHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the handler this module installs, so a reconfiguration replaces it."""


def _route_stdlib(out: TextIO, shared: list[Processor], renderer: list[Processor]) -> None:
    _remove_stdlib_handler()
    handler = _StdlibHandler(out)
    # Third-party INFO chatter stays out; the root logger's own level is left alone.
    handler.setLevel(logging.WARNING)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
        )
    )
    logging.getLogger().addHandler(handler)


def _remove_stdlib_handler() -> None:
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _StdlibHandler)]:
        root.removeHandler(handler)
