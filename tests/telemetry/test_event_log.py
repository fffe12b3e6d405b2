"""The per-rollout JSON line written without structlog's steps: the line structlog writes."""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
import structlog

from dispatcher.telemetry.event_log import EventLog
from dispatcher.telemetry.logs import configure_logging, get_logger, now_iso, reset_logging


@pytest.fixture(autouse=True)
def clean_logging() -> Iterator[None]:
    yield
    structlog.contextvars.clear_contextvars()
    reset_logging()


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in stream.getvalue().splitlines()]


def without_timestamps(found: list[dict[str, Any]]) -> list[list[tuple[str, Any]]]:
    for line in found:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", line.pop("timestamp"))
    return [list(line.items()) for line in found]


def both_ways(write: Any, **bound: Any) -> tuple[list[Any], list[Any]]:
    """The lines ``write(event_log)`` gives and those ``log.log`` gives for the same fields."""
    ours, theirs = io.StringIO(), io.StringIO()
    configure_logging("json", stream=ours)
    write(EventLog(get_logger("dispatcher.run").bind(**bound), "rollout_finished"))
    configure_logging("json", stream=theirs)
    log = get_logger("dispatcher.run").bind(**bound)
    write(lambda level, fields: log.log(level, "rollout_finished", **fields))
    return without_timestamps(lines(ours)), without_timestamps(lines(theirs))


FIELDS = {"rollout_id": "3-1", "duration_s": 0.25, "capture": None, "replica": 'http://a\n"b'}


def test_fields_and_context_make_the_line_structlog_makes() -> None:
    structlog.contextvars.bind_contextvars(run_id="r1", job_id="j1", rollout_id="shadowed")

    def write(event_log: Any) -> None:
        for level in (logging.INFO, logging.WARNING, logging.ERROR):
            event_log(level, dict(FIELDS))

    ours, theirs = both_ways(write)
    assert ours == theirs
    assert [dict(line)["level"] for line in ours] == ["info", "warning", "error"]
    assert dict(ours[0])["rollout_id"] == "3-1" and dict(ours[0])["job_id"] == "j1"


def test_rendered_fields_make_the_line_structlog_makes() -> None:
    """``write_json``: the caller's rendering of the fields, the context added after."""
    keys = frozenset(FIELDS)
    structlog.contextvars.bind_contextvars(run_id="r1", rollout_id="shadowed")

    def write(event_log: Any) -> None:
        for run_id in ("r1", "r1", "r2", 1, 1.0):
            structlog.contextvars.bind_contextvars(run_id=run_id)
            if isinstance(event_log, EventLog):
                assert event_log.write_json(logging.INFO, orjson.dumps(FIELDS), keys)
            else:
                event_log(logging.INFO, dict(FIELDS))

    ours, theirs = both_ways(write)
    assert ours == theirs
    assert [dict(line)["run_id"] for line in ours] == ["r1", "r1", "r2", 1, 1.0]
    assert [type(dict(line)["run_id"]) for line in ours][-2:] == [int, float]


def test_a_bound_logger_or_an_odd_context_takes_structlogs_path() -> None:
    configure_logging("json", stream=io.StringIO())
    rendered = orjson.dumps(FIELDS)
    bound = EventLog(get_logger("dispatcher.run").bind(job="j1"), "rollout_finished")
    assert not bound.write_json(logging.INFO, rendered, frozenset(FIELDS))
    plain = EventLog(get_logger("dispatcher.run").bind(), "rollout_finished")
    structlog.contextvars.bind_contextvars(logger="own")
    assert not plain.write_json(logging.INFO, rendered, frozenset(FIELDS))

    def write(event_log: Any) -> None:
        event_log(logging.INFO, dict(FIELDS))

    ours, theirs = both_ways(write, job="j1")
    assert ours == theirs and dict(ours[0])["logger"] == "own"


def test_events_captured_after_binding_take_structlogs_path() -> None:
    configure_logging("json", stream=io.StringIO())
    event_log = EventLog(get_logger("dispatcher.run").bind(), "rollout_finished")
    with structlog.testing.capture_logs() as captured:
        assert not event_log.write_json(logging.INFO, b'{"a":1}', frozenset({"a"}))
        event_log(logging.INFO, {"a": 1})
    assert captured == [{"event": "rollout_finished", "a": 1, "log_level": "info"}]


def test_now_is_iso_8601_utc_with_microseconds() -> None:
    stamp = now_iso()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", stamp)
    assert abs((datetime.now(UTC) - datetime.fromisoformat(stamp)).total_seconds()) < 60
