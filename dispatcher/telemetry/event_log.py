"""The per-rollout JSON line, written without structlog's steps (``EventLog``).

``configure_logging`` (``logs.py``) renders a JSON line in one step, ``json_line``;
on a path taken once per rollout even that step's generality costs: a processor
chain of one, a context merged from scratch, a dict put in order for the first
keys. ``EventLog`` settles what it can once per bound logger and renders the
same line: the first keys from text made once, the fields by one dumps.
"""

from __future__ import annotations

import logging
from typing import Any, TextIO

import orjson
from structlog.typing import Processor

from dispatcher.telemetry.logs import (
    DEFAULT_LOGGER,
    NamedWriteLogger,
    context_fields,
    json_line,
    now_iso,
)

_METHOD_OF_LEVEL = {
    logging.DEBUG: "debug",
    logging.INFO: "info",
    logging.WARNING: "warning",
    logging.ERROR: "error",
    logging.CRITICAL: "critical",
}
# The keys ``json_line`` sets or acts on itself: an event carrying one takes structlog's path.
_OWN_KEYS = frozenset({"event", "level", "timestamp", "logger", "exc_info"})
_LINE_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_APPEND_NEWLINE


class EventLog:
    """``log.log(level, event, **fields)`` for one event of one bound logger, without
    structlog's steps where they add nothing. When the chain is ``json_line`` alone
    and the logger binds nothing, the line is rendered and written at once: its first
    keys from text made once, the rest by one ``orjson.dumps`` of ``fields`` (which it
    takes over). The line is ``json_line``'s; it runs once per rollout. Any other
    chain (console, a filter, a test capturing events) takes structlog's path.

    A bound logger keeps its processors, context and sink, so they are looked at
    once; the processors are still read on each call, as a test capturing events
    swaps them in place.
    """

    __slots__ = (
        "_context",
        "_event",
        "_heads",
        "_keys",
        "_log",
        "_logger",
        "_out",
        "_processors",
        "_tail",
    )

    def __init__(self, log: Any, event: str) -> None:
        self._log, self._event = log, event
        processors = getattr(log, "_processors", None)
        sink = getattr(log, "_logger", None)
        self._processors: list[Processor] = processors if isinstance(processors, list) else []
        self._out: TextIO | None = None
        name = DEFAULT_LOGGER
        if isinstance(sink, NamedWriteLogger):
            name = sink.name
            if not getattr(log, "_context", None):
                self._out = sink.out
        # The line up to its timestamp, by level; from the timestamp to the fields.
        self._heads = {
            level: orjson.dumps({"event": event, "level": method}).decode()[:-1] + ',"timestamp":"'
            for level, method in _METHOD_OF_LEVEL.items()
        }
        self._logger = '","logger":' + orjson.dumps(name).decode() + ","
        # ``write_json``'s last context (its values all strings), fields and line end.
        self._context: list[tuple[str, Any]] = []
        self._keys: frozenset[str] = frozenset()
        self._tail: str | None = None

    def __call__(self, level: int, fields: dict[str, Any]) -> None:
        out = self._shortcut()
        if out is None or not fields or not fields.keys().isdisjoint(_OWN_KEYS):
            self._log.log(level, self._event, **fields)
            return
        for key, value in context_fields():
            if key in _OWN_KEYS:
                self._log.log(level, self._event, **fields)
                return
            fields.setdefault(key, value)
        body = orjson.dumps(fields, default=str, option=_LINE_OPTIONS).decode()
        out.write(f"{self._heads[level]}{now_iso()}{self._logger}{body[1:]}")
        out.flush()

    def write_json(self, level: int, body: bytes, keys: frozenset[str]) -> bool:
        """Write the line of the fields ``body`` holds, rendered by the caller: a JSON
        object of ``keys`` (none of ``event``, ``level``, ``timestamp``, ``logger``,
        ``exc_info``), as orjson renders it. False, writing nothing, where the shortcut
        does not apply: then the caller calls the ``EventLog`` with the fields."""
        out = self._shortcut()
        if out is None:
            return False
        context = context_fields()
        tail = self._tail
        if tail is None or context != self._context or keys is not self._keys:
            tail = _context_tail(context, keys)
            if tail is None:
                return False
            # Strings equal are rendered alike (1 and 1.0 are equal, not alike).
            if all(type(value) is str for _, value in context):
                self._context, self._keys, self._tail = context, keys, tail
        fields = body.decode()
        out.write(f"{self._heads[level]}{now_iso()}{self._logger}{fields[1:-1]}{tail}")
        out.flush()
        return True

    def _shortcut(self) -> TextIO | None:
        """The stream to write to, when the chain is ``json_line`` alone."""
        processors = self._processors
        if len(processors) != 1 or processors[0] is not json_line:
            return None
        return self._out


def _context_tail(context: list[tuple[str, Any]], keys: frozenset[str]) -> str | None:
    """The end of a line whose fields are ``keys``: the context's other fields and
    the closing brace; None if the context binds a key ``json_line`` sets."""
    extra: dict[str, Any] = {}
    for key, value in context:
        if key in _OWN_KEYS:
            return None
        if key not in keys:
            extra.setdefault(key, value)
    if not extra:
        return "}\n"
    return "," + orjson.dumps(extra, default=str, option=_LINE_OPTIONS).decode()[1:]


def log_at(log: Any, level: int, event: str, fields: dict[str, Any]) -> None:
    """``log.log(level, event, **fields)`` by ``EventLog``'s path (for one-off events,
    a bound ``EventLog`` settles its checks once)."""
    EventLog(log, event)(level, fields)
