"""The JSON lines of service mode that several modules read, typed and defined once.

- ``GroupLine``: a line of a job's ``groups.jsonl`` (``groups.py`` writes and
  reads it back on open, the results stream reads it per group).
- ``EndLine``: the last line of a ``wait=true`` results stream,
  ``{"end": STATE}`` (with ``error`` for a failed job); the client reads it.

They are ``msgspec`` structs: read per line on the stream's path, strictly
(a bool is not an int, a missing field is an error).
"""

from __future__ import annotations

import msgspec


class GroupLine(msgspec.Struct, omit_defaults=True):
    """A complete group: every repeat of ``task_index`` is final (contracts §12)."""

    task_index: int
    # The line numbers of its rows in the job's rollouts.jsonl, ascending.
    rows: list[int]
    failures: int
    # Step control (contracts §13): a group the job's filter left out.
    filtered: bool = False
    # With a target that reads them (per-agent quotas, a token target): the task's
    # agent and the generated tokens of its rows.
    agent: str | None = None
    tokens: int | None = None
    # Per-agent quotas: a kept group of an agent whose quota was already met, left out
    # of grouped streams like a filtered one.
    surplus: bool = False


class EndLine(msgspec.Struct, omit_defaults=True):
    """The end of a ``wait=true`` stream: the job's final state (and why it failed)."""

    end: str
    error: str | None = None


_GROUP_DECODER = msgspec.json.Decoder(GroupLine)
_END_DECODER = msgspec.json.Decoder(EndLine)
_ENCODER = msgspec.json.Encoder()

BadLine = msgspec.DecodeError


def read_group(line: bytes) -> GroupLine:
    """The group a line holds; ``BadLine`` when it is not one."""
    return _GROUP_DECODER.decode(line)


def read_end(line: bytes) -> EndLine:
    """The end line a stream's last line holds; ``BadLine`` when it is not one."""
    return _END_DECODER.decode(line)


def encode(line: GroupLine | EndLine) -> bytes:
    """The line, newline ended."""
    return _ENCODER.encode(line) + b"\n"
