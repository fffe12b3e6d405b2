"""The rows of ``X_aggregate_metrics.json``'s requests (``aggregate.py``): each agent's
rows as Gym's collector sends them to ``POST /aggregate_metrics``, stripped of the
heavy keys (and any value over 64 KiB, such as per-token lists).

The rows are read once from the output file, after every row is durable. A big
output's stripped rows are spooled by agent to temporary files beside it, in a
pass that goes only as far as the bodies being sent need, so memory does not
grow with the run; a small one's (``SMALL_OUTPUT_BYTES``) are read in memory in
one pass and each body is sent whole.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import tempfile
import threading
from collections.abc import Container, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import msgspec
import orjson

from dispatcher.files.contracts import DISPATCH_KEY
from dispatcher.tasks.keys import ENVIRONMENT_SERVER, split_row
from dispatcher.tasks.schema import AGENT_OBSERVATIONS, MODEL_CALL_CAPTURE, TRAJECTORY

# What Gym's collector leaves out before sending rows to /aggregate_metrics.
_HEAVY_KEYS = frozenset(
    {
        "response",
        "responses_create_params",
        AGENT_OBSERVATIONS,
        MODEL_CALL_CAPTURE,
        TRAJECTORY,
    }
)

# A kept value bigger than this (a per-token list, say) is left out: metrics
# are computed from scalars, and a run of megabyte rows must not be held whole.
MAX_VALUE_BYTES = 64 * 1024


# A spooled body is sent in chunks of this size.
CHUNK_BYTES = 1 << 20
# An output file up to this size is passed over in memory in one thread hop and
# each body sent whole (a job of a few rows had six hops, and a new connection
# to each agent that answered 404 before its body was streamed).
SMALL_OUTPUT_BYTES = 256 * 1024
# One this small (a job of a few rows, just written: in the page cache) is passed
# over on the loop, where a thread hop would cost more than the pass.
ON_LOOP_BYTES = 32 * 1024
# The pass over the output file goes on this many lines at a time.
PASS_LINES = 1024


@dataclass
class AgentRows:
    """One agent's rows as ``/aggregate_metrics`` takes them (stripped, comma
    separated), spooled to an unnamed file, and the replica of its last row."""

    spool: BinaryIO
    rows: int = 0
    last_replica: str | None = None
    # Off for an agent of one replica: there is no other to ask first, and
    # decoding every row's stamp for it was a third of the pass.
    track_replica: bool = True
    # The Gym environment server its rows name (contracts §15), which its entry names.
    environment_server: str | None = None

    def add(self, row: Mapping[str, msgspec.Raw]) -> None:
        self.spool.write((b"," if self.rows else b"") + stripped(row))
        self.rows += 1
        if self.track_replica:
            self.last_replica = _replica(row) or self.last_replica
        if self.environment_server is None and ENVIRONMENT_SERVER in row:
            self.environment_server = _small_string(row[ENVIRONMENT_SERVER])

    def body_chunks(
        self, rows: RowSpools | None = None, chunk_bytes: int = CHUNK_BYTES
    ) -> Iterator[bytes]:
        """The request body, a chunk at a time (blocking): the spool, and, while the
        pass of ``rows`` is not over, the rows it spools as it goes on."""
        yield b'{"verify_responses":['
        offset = 0
        while True:
            if rows is None:
                chunk, over = os.pread(self.spool.fileno(), chunk_bytes, offset), True
            else:
                chunk, over = rows.read(self, offset, chunk_bytes)
            if chunk:
                offset += len(chunk)
                yield chunk
            elif over:
                break
            else:
                assert rows is not None
                rows.advance()
        yield b"]}"


class RowSpools:
    """The output file's rows, stripped and spooled by agent in one pass that goes
    only as far as the bodies being sent need (blocking: call it in a thread).

    An agent that answers before it has read its body (a 404 from one that does
    not aggregate) spares the rest of the pass. Only the rows of ``wanted``
    agents (default: all) are spooled; the agents named in ``single_replica``
    get no ``last_replica``. Rows are split at their top level without decoding
    the values, and only the kept, small values are copied, so memory stays flat
    however large the run. The spools are files beside ``output`` that
    ``spools`` closes.
    """

    def __init__(
        self,
        output: Path,
        spools: contextlib.ExitStack,
        single_replica: Container[str] = (),
        wanted: Container[str] | None = None,
        in_memory: bool = False,
    ) -> None:
        self._dir = output.parent
        self._spools = spools
        self._in_memory = in_memory
        self._single = single_replica
        self._wanted = wanted
        self._lines = spools.enter_context(output.open("rb"))
        # The agent of each ``agent_ref`` as written: a run's rows repeat a few of them.
        self._names: dict[bytes, str | None] = {}
        # A body's generator may be left running in its thread when its request
        # ends early, while the next body goes on with the pass.
        self._lock = threading.Lock()
        self.agents: dict[str, AgentRows] = {}
        self.over = False

    def advance(self, lines: int = PASS_LINES) -> None:
        """Spool the next ``lines`` rows of the file."""
        with self._lock:
            read = 0
            if not self.over:
                for line in itertools.islice(self._lines, lines):
                    read += 1
                    self._add(line)
                self.over = read < lines
            for agent in self.agents.values():
                agent.spool.flush()

    def finish(self) -> None:
        """The pass, to the end of the file."""
        while not self.over:
            self.advance()

    def rows_of(self, name: str) -> AgentRows | None:
        """The agent's rows once the pass has found its first one; None if it has none."""
        while name not in self.agents and not self.over:
            self.advance()
        return self.agents.get(name)

    def read(self, agent: AgentRows, offset: int, size: int) -> tuple[bytes, bool]:
        """Up to ``size`` bytes of the agent's spool from ``offset``, and whether the
        pass is over (so that no bytes then means the end of its body)."""
        with self._lock:
            return os.pread(agent.spool.fileno(), size, offset), self.over

    def close(self) -> None:
        """End the pass: once a body left running in its thread has spooled its lines."""
        with self._lock:
            self.over = True

    def _add(self, line: bytes) -> None:
        row = split_row(line)
        ref = row.get("agent_ref") if row is not None else None
        if row is None or ref is None:
            return
        written = bytes(ref)
        name = self._names.get(written, _UNSEEN)
        if name is _UNSEEN:
            name = _agent_name(ref)
            if len(self._names) < _MAX_MEMBERS:
                self._names[written] = name
        if name is None or (self._wanted is not None and name not in self._wanted):
            return
        agent = self.agents.get(name)
        if agent is None:
            spool: BinaryIO = (
                io.BytesIO() if self._in_memory else tempfile.TemporaryFile(dir=self._dir)  # noqa: SIM115 (spools closes it)
            )
            self._spools.enter_context(spool)
            agent = self.agents[name] = AgentRows(spool, track_replica=name not in self._single)
        agent.add(row)


def spool_by_agent(
    output: Path, spools: contextlib.ExitStack, single_replica: Container[str] = ()
) -> dict[str, AgentRows]:
    """Each agent's rows, stripped and spooled to the end of the file (blocking)."""
    rows = RowSpools(output, spools, single_replica)
    rows.finish()
    return rows.agents


def small_bodies(
    output: Path,
    wanted: Container[str],
    single_replica: Container[str] = (),
    limit: int = SMALL_OUTPUT_BYTES,
) -> dict[str, tuple[AgentRows, bytes]] | None:
    """Each agent's rows and its whole body, for an output of at most ``limit`` bytes
    (else None), in one pass in memory (blocking)."""
    if output.stat().st_size > limit:
        return None
    with contextlib.ExitStack() as spools:
        rows = RowSpools(output, spools, single_replica, wanted, in_memory=True)
        rows.finish()
        return {
            name: (agent, b'{"verify_responses":[' + _spooled(agent) + b"]}")
            for name, agent in rows.agents.items()
        }


def _spooled(agent: AgentRows) -> bytes:
    spool = agent.spool
    assert isinstance(spool, io.BytesIO)
    return spool.getvalue()


_UNSEEN: Any = object()


def _agent_name(ref: msgspec.Raw) -> str | None:
    agent = _small_object(ref)
    name = agent.get("name") if agent else None
    return name if isinstance(name, str) else None


def _replica(row: Mapping[str, msgspec.Raw]) -> str | None:
    stamp = _small_object(row.get(DISPATCH_KEY))
    replica = stamp.get("replica") if stamp else None
    return replica if isinstance(replica, str) else None


def _small_string(raw: msgspec.Raw) -> str | None:
    value = orjson.loads(bytes(raw)) if len(raw) <= MAX_VALUE_BYTES else None
    return value if isinstance(value, str) else None


def _small_object(raw: msgspec.Raw | None) -> dict[str, Any] | None:
    if raw is None or len(raw) > MAX_VALUE_BYTES:
        return None
    value = orjson.loads(bytes(raw))
    return value if isinstance(value, dict) else None


def stripped(row: Mapping[str, msgspec.Raw]) -> bytes:
    """A row without payloads (keeping the response's usage and incomplete_details)
    and without outsized values, serialized."""
    # Every row of a run has the same keys: each one's JSON is encoded once. A
    # kept value is joined from the row's own bytes, without a copy first.
    known = _MEMBERS.get
    parts = [
        (known(key) or _member(key)) + raw
        for key, raw in row.items()
        if key not in _HEAVY_KEYS and len(raw) <= MAX_VALUE_BYTES
    ]
    response = _response_kept(row.get("response"))
    if response:
        parts.append(response)
    return b"{" + b",".join(parts) + b"}"


# The members' JSON, by key: a run's rows share their keys. Bounded, as rows are
# other people's data and could each bring keys of their own.
_MEMBERS: dict[str, bytes] = {}
_MAX_MEMBERS = 1024


def _member(key: str) -> bytes:
    """``"key":``, as JSON."""
    member = _MEMBERS.get(key)
    if member is None:
        member = orjson.dumps(key) + b":"
        if len(_MEMBERS) < _MAX_MEMBERS:
            _MEMBERS[key] = member
    return member


class _ResponseKept(msgspec.Struct):
    """The response's keys an aggregate row keeps, each as its bytes (empty: absent)."""

    usage: msgspec.Raw = msgspec.Raw()
    incomplete_details: msgspec.Raw = msgspec.Raw()


# Decodes those two keys and skips the rest of the response (its output, the
# bulk of it) without building it.
_RESPONSE_KEPT = msgspec.json.Decoder(_ResponseKept)


def _response_kept(raw: msgspec.Raw | None) -> bytes | None:
    """``"response":{...}`` with the response's kept keys, their values the row's own
    bytes; None when it keeps none (or is no object)."""
    if raw is None:
        return None
    try:
        kept = _RESPONSE_KEPT.decode(raw)
    except msgspec.DecodeError:
        return None  # not an object
    members = [
        _member(key) + value
        for key, value in (("usage", kept.usage), ("incomplete_details", kept.incomplete_details))
        if value
    ]
    return b'"response":{' + b",".join(members) + b"}" if members else None
