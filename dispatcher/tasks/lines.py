"""A task file read a line at a time (contracts §1): every line's bytes hashed, each
non-blank line parsed into a row, a line longer than ``--max-task-line-bytes`` a
``file:line`` error. A line may be hundreds of megabytes: it is read into one buffer
and handed on as a view, never copied to strip it.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import orjson
import structlog

from dispatcher import jsonx
from dispatcher.errors import ConfigError

log = structlog.get_logger(__name__)

# A task line's bytes at most (``--max-task-line-bytes``): reading and parsing one
# costs about twice its size, and materializing it (and each repeat) as much again.
DEFAULT_MAX_LINE_BYTES = 64 * 1024 * 1024
# The task file is read a line at a time up to this size; a longer line is gathered.
READ_BLOCK_BYTES = 1 << 20
_WHITE = frozenset(b" \t\n\r\x0b\x0c")
_NOT_WHITE = re.compile(rb"[^ \t\n\r\x0b\x0c]")
# A task line as read: a block's slice, a long line's own buffer, or a view of either.
Buffer = bytes | bytearray | memoryview


def iter_input_rows(
    path: Path,
    limit: int | None,
    skip_invalid: bool,
    hasher: Any,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Iterator[tuple[str, Buffer, dict[str, Any]]]:
    """Yield ``(where, raw, row)`` per task line, streaming; ``hasher`` sees every byte read.
    ``raw`` is the line without its surrounding white space, valid until the next one."""
    taken = 0
    # The newline does not count: a line of exactly the bound is fine.
    longest = min(max_line_bytes + 1, READ_BLOCK_BYTES)
    name = str(path)
    with _open_input(path) as f:
        lines = iter(functools.partial(f.readline, READ_BLOCK_BYTES), b"")
        for line_no, read in enumerate(lines, 1):
            if limit is not None and taken >= limit:
                return
            if len(read) < longest:
                hasher.update(read)
                raw: Buffer = read.strip()
            else:
                line = _long_line(f, read, max_line_bytes, f"{path}:{line_no}")
                hasher.update(line)
                raw = _stripped(line)
            if not raw:
                continue
            where = f"{name}:{line_no}"
            row = _parse_row(raw, where, skip_invalid)
            if row is None:
                continue
            taken += 1
            yield where, raw, row


def iter_rows_in_memory(
    lines: list[bytes],
    name: str,
    limit: int | None,
    hasher: Any,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Iterator[tuple[str, Buffer, dict[str, Any]]]:
    """``iter_input_rows`` of a task file of ``lines`` (each one JSON object, without its
    newline), read from no file; ``name`` stands for the file's in ``where``."""
    for line_no, raw in enumerate(itertools.islice(lines, limit), 1):
        hasher.update(raw)
        hasher.update(b"\n")
        where = f"{name}:{line_no}"
        _check_length(len(raw) + 1, max_line_bytes, where)
        # Parsed again, as from a file: materializing changes the row it is given.
        row = _parse_row(raw, where, skip_invalid=False)
        assert row is not None
        yield where, raw, row


def _long_line(f: BinaryIO, first: bytes, max_bytes: int, where: str) -> bytes | bytearray:
    """A line whose ``first`` read filled a block or passed the bound: checked, and
    read on into one buffer grown in place when it goes on. Read whole by
    ``readline``, a long line was joined from its pieces (two copies of it at
    once), and ``strip`` made a third."""
    if first.endswith(b"\n"):
        _check_length(len(first), max_bytes, where)
        return first
    line = bytearray(first)
    while not line.endswith(b"\n"):
        _check_length(len(line), max_bytes, where)
        more = f.readline(READ_BLOCK_BYTES)
        if not more:
            break
        line += more
    _check_length(len(line), max_bytes, where)
    return line


def _check_length(size: int, max_bytes: int, where: str) -> None:
    # The newline does not count: a line of exactly the bound is fine.
    if size > max_bytes + 1:
        raise ConfigError(
            f"{where}: a task line is longer than --max-task-line-bytes ({max_bytes} bytes)"
        )


def _stripped(line: bytes | bytearray) -> Buffer:
    """``line`` without its surrounding white space, as ``bytes.strip`` would cut it, but
    a view rather than a copy (a task line may be hundreds of megabytes)."""
    found = _NOT_WHITE.search(line)
    if found is None:
        return b""
    end = len(line)
    while line[end - 1] in _WHITE:
        end -= 1
    return memoryview(line)[found.start() : end]


def _open_input(path: Path) -> BinaryIO:
    try:
        return path.open("rb")
    except FileNotFoundError:
        raise ConfigError(f"{path}: input file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read input: {exc.strerror}") from None


def _parse_row(raw: Buffer, where: str, skip_invalid: bool) -> dict[str, Any] | None:
    try:
        row = jsonx.loads(raw)
        problem = None if isinstance(row, dict) else "line is not a JSON object"
    except orjson.JSONDecodeError as exc:
        problem = f"line is not valid JSON ({exc})"
    if problem is None:
        return row  # type: ignore[no-any-return]
    if skip_invalid:
        log.warning("input_row_skipped", where=where, reason=problem)
        return None
    raise ConfigError(f"{where}: {problem}")


def file_digest(path: Path) -> str | None:
    """sha256 of a file (a materialized file's ``materialized_digest``); None if missing."""
    hasher = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                hasher.update(chunk)
    except FileNotFoundError:
        return None
    return hasher.hexdigest()
