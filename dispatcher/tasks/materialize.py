"""Task file → materialized rollouts (contracts §1, §2).

The task file may be far larger than memory, so it is streamed twice at most:
once to validate and materialize into ``X_materialized_inputs.jsonl`` (before
anything is dispatched, so a bad line stops the run with nothing sent), and
the dispatcher then streams that file. Memory stays flat: the only per-task
state is a compact open-addressing table of row digests (12 bytes a slot),
needed because identical input rows share one task index.

How a rollout is named and keyed (ids, the integer key, their bounds) is
``keys.py``'s; this module applies it to each row.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from array import array
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import structlog

from dispatcher import jsonx
from dispatcher.errors import ConfigError
from dispatcher.tasks.keys import (
    AGENT_REF,
    ATTEMPT_INDEX,
    CAPTURE_ID,
    MAX_ROLLOUT_INDEX,
    RESERVED_INPUT_KEYS,
    ROLLOUT_ID,
    ROLLOUT_INDEX,
    TASK_INDEX,
    own_rollout_id_problem,
    rollout_id_for,
    rollout_key,
    task_index_problem,
)
from dispatcher.tasks.lines import (
    DEFAULT_MAX_LINE_BYTES,
    Buffer,
    file_digest,
    iter_input_rows,
    iter_rows_in_memory,
)

log = structlog.get_logger(__name__)

RESPONSES_CREATE_PARAMS = "responses_create_params"
DEFAULT_REPEATS_KEY = "_default"


@dataclass(slots=True)
class Rollout:
    """One attempt to run: what is POSTed to the agent and how it is named. Never
    changed once made; not ``frozen``, whose ``__init__`` sets each field through
    ``object.__setattr__`` (a rollout of every line started).

    ``capture_id`` scopes model-call capture to this attempt of this hop. The
    rollout id (§2) is the same on every hop, so an agent request of a killed
    hop that is still calling the model would otherwise add its calls to the
    rerun's row. With a capture token (one per hop), the body carries
    ``_ng_capture_id = "<rollout_id>.<token>"``; agents call the model under
    that id, and the row reads only that id's captures.
    """

    task_index: int
    rollout_index: int
    attempt_index: int
    rollout_id: str
    agent: str
    body: dict[str, Any]
    capture_id: str | None = None
    # ``body`` as JSON when it is its materialized line unchanged (the line's own
    # bytes: not encoded again for the agent); None when it must be encoded.
    wire: bytes | None = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> int:
        return rollout_key(self.task_index, self.rollout_index)

    @classmethod
    def from_materialized(
        cls,
        row: dict[str, Any],
        attempt_index: int,
        capture_token: str | None = None,
        line: bytes | None = None,
    ) -> Rollout:
        """The rollout of a materialized row (``line``: the bytes it was decoded from).
        An unchanged row is the body itself, not a copy."""
        rollout_id = rollout_id_for(row, attempt_index)
        capture_id = None if capture_token is None else f"{rollout_id}.{capture_token}"
        unchanged = attempt_index == 0 and capture_id is None
        body = row if unchanged else dict(row)
        if attempt_index > 0:
            body[ATTEMPT_INDEX] = attempt_index
        if capture_id is not None:
            body[CAPTURE_ID] = capture_id
        return cls(
            task_index=row[TASK_INDEX],
            rollout_index=row[ROLLOUT_INDEX],
            attempt_index=attempt_index,
            rollout_id=rollout_id,
            agent=row[AGENT_REF]["name"],
            body=body,
            capture_id=capture_id,
            wire=line.rstrip(b"\r\n") if unchanged and line is not None else None,
        )


def new_capture_token() -> str:
    """A fresh per-hop token: 8 hex digits (``keys.CAPTURE_TOKEN_LEN`` with its dot)."""
    return os.urandom(4).hex()


@dataclass(frozen=True)
class MaterializeSpec:
    """The task-affecting settings: everything that changes what a rollout is."""

    input_path: Path
    agents: frozenset[str]
    default_agent: str | None
    num_repeats: int | Mapping[str, int]
    limit: int | None
    overrides: Mapping[str, Any]
    skip_invalid_rows: bool
    shard_filter: Callable[[int], bool] | None = None
    # Every row must carry ``responses_create_params`` (a served job's task file).
    require_params: bool = False
    # A longer task line is an error naming it (``--max-task-line-bytes``).
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES


@dataclass(frozen=True)
class MaterializeResult:
    input_rows: int
    tasks: int
    rollouts: int
    rollouts_by_agent: dict[str, int]
    input_digest: str
    materialized_digest: str


class _DigestTable:
    """Map a row's 64-bit digest to its task index in 12 bytes a slot.

    A dict of Python ints costs ~100 bytes an entry; this keeps a 1M-row task
    file within ~16 MB. It is sized up front from an estimate of the row count,
    since growing would briefly hold the old and the new arrays at once.
    """

    _MAX_LOAD = 0.75

    def __init__(self, expected_rows: int = 0) -> None:
        self._allocate(max(4096, int(expected_rows / self._MAX_LOAD) + 1))
        self._size = 0

    def _allocate(self, capacity: int) -> None:
        self._capacity = capacity
        self._keys = array("Q", bytes(8 * capacity))
        self._values = array("I", bytes(4 * capacity))

    def get_or_add(self, digest: int, value: int) -> int:
        digest = digest or 1  # 0 marks an empty slot
        # ``_find``, inlined: once per task row.
        capacity, keys = self._capacity, self._keys
        slot = digest % capacity
        while (found := keys[slot]) != 0:
            if found == digest:
                return self._values[slot]
            slot = slot + 1 if slot + 1 < capacity else 0
        keys[slot] = digest
        self._values[slot] = value
        self._size += 1
        if self._size > self._MAX_LOAD * self._capacity:
            self._grow()
        return value

    def _find(self, digest: int) -> int:
        capacity, keys = self._capacity, self._keys
        slot = digest % capacity
        while keys[slot] != 0 and keys[slot] != digest:
            slot = slot + 1 if slot + 1 < capacity else 0
        return slot

    def _grow(self) -> None:
        old_keys, old_values = self._keys, self._values
        self._allocate(self._capacity * 2)
        for digest, value in zip(old_keys, old_values, strict=True):
            if digest:
                slot = self._find(digest)
                self._keys[slot] = digest
                self._values[slot] = value


def estimate_rows(path: Path, limit: int | None, sample_bytes: int = 1 << 20) -> int:
    """Rows in a task file, from its size and the mean length of its first lines."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            sample = f.read(sample_bytes)
    except OSError:
        return 0
    lines = max(1, sample.count(b"\n"))
    estimate = size * lines // max(1, len(sample)) + 1
    return estimate if limit is None else min(limit, estimate)


class _RolloutCounters:
    """Next rollout index per task: dense for assigned indices, a dict for the row's own."""

    def __init__(self) -> None:
        self._dense = array("I")
        self._sparse: dict[int, int] = {}

    def new_task(self, task_index: int) -> None:
        if task_index == len(self._dense):
            self._dense.append(self._sparse.pop(task_index, 0))

    def take(self, task_index: int, count: int) -> int:
        if 0 <= task_index < len(self._dense):
            first = self._dense[task_index]
            self._dense[task_index] = first + count
        else:
            first = self._sparse.get(task_index, 0)
            self._sparse[task_index] = first + count
        return first


class Materializer:
    """Validates input rows and expands each into its repeats, laid out aabbcc."""

    def __init__(self, spec: MaterializeSpec, rows: int | None = None) -> None:
        self._spec = spec
        expected = estimate_rows(spec.input_path, spec.limit) if rows is None else rows
        self._digests = _DigestTable(expected)
        self._counters = _RolloutCounters()
        self._own_ids: _DigestTable | None = None
        self._next_task = 0
        self.tasks = 0

    def expand(self, raw: Buffer, row: dict[str, Any], where: str) -> Iterator[dict[str, Any]]:
        """The materialized rows for one input row, made one at a time as they are consumed.

        Validation happens before this returns; the rows are lazy so that a
        task with many repeats never sits in memory whole. Empty when the
        task is in another shard. A task of one rollout is ``row`` itself, its
        indices set.
        """
        if self._spec.require_params and RESPONSES_CREATE_PARAMS not in row:
            raise ConfigError(f"{where}: the row has no {RESPONSES_CREATE_PARAMS}")
        _check_reserved_keys(row, where)
        agent = self._resolve_agent(row, where)
        self._merge_overrides(row, where)
        task_index = self._task_index(raw, row, where)
        repeats = self._repeats_for(agent, where)
        if ROLLOUT_ID in row:
            _check_own_rollout_id(row[ROLLOUT_ID], repeats, where)
            self._check_unique_id(row[ROLLOUT_ID], where)
        if self._spec.shard_filter is not None and not self._spec.shard_filter(task_index):
            return iter(())
        first = self._counters.take(task_index, repeats)
        if first + repeats - 1 > MAX_ROLLOUT_INDEX:
            raise ConfigError(
                f"{where}: task {task_index} would get more than {MAX_ROLLOUT_INDEX + 1:,} "
                "rollouts (identical rows share one task, and their repeats add up)"
            )
        if repeats == 1:
            # Most tasks: the row itself is its one rollout, not a copy of it.
            row[TASK_INDEX] = task_index
            row[ROLLOUT_INDEX] = first
            return iter((row,))
        return _repeats(row, task_index, first, repeats)

    def _check_unique_id(self, rollout_id: str, where: str) -> None:
        # Two rows with one id would share capture files and rows: refuse.
        if self._own_ids is None:
            self._own_ids = _DigestTable()
        digest = int.from_bytes(hashlib.blake2b(rollout_id.encode(), digest_size=8).digest())
        line = int(where.rpartition(":")[2])
        first = self._own_ids.get_or_add(digest, line)
        if first != line:
            raise ConfigError(
                f"{where}: {ROLLOUT_ID} {rollout_id!r} is already the id of the row on line "
                f"{first}; rollout ids must be unique"
            )

    def _resolve_agent(self, row: dict[str, Any], where: str) -> str:
        ref = row.get(AGENT_REF)
        if ref is None and self._spec.default_agent is not None:
            ref = row[AGENT_REF] = {"name": self._spec.default_agent}
        if ref is None:
            raise ConfigError(f"{where}: row has no agent_ref and no default agent is set")
        name = ref.get("name") if isinstance(ref, dict) else None
        if not isinstance(name, str):
            raise ConfigError(f'{where}: agent_ref must be an object like {{"name": "..."}}')
        if name not in self._spec.agents:
            known = ", ".join(sorted(self._spec.agents)) or "none"
            raise ConfigError(f"{where}: agent {name!r} is not configured (configured: {known})")
        return name

    def _merge_overrides(self, row: dict[str, Any], where: str) -> None:
        params = row.get(RESPONSES_CREATE_PARAMS)
        if params is not None and not isinstance(params, dict):
            raise ConfigError(f"{where}: {RESPONSES_CREATE_PARAMS} must be an object")
        if self._spec.overrides:
            row[RESPONSES_CREATE_PARAMS] = {**(params or {}), **self._spec.overrides}

    def _task_index(self, raw: Buffer, row: dict[str, Any], where: str) -> int:
        own = row.get(TASK_INDEX)
        if own is not None:
            problem = task_index_problem(own)
            if problem is not None:
                raise ConfigError(f"{where}: {problem}")
            self.tasks += 1
            return int(own)
        digest = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
        index = self._digests.get_or_add(digest, self._next_task)
        if index == self._next_task:
            self._counters.new_task(index)
            self._next_task += 1
            self.tasks += 1
        return index

    def _repeats_for(self, agent: str, where: str) -> int:
        repeats = self._spec.num_repeats
        if isinstance(repeats, int):
            return repeats
        if agent in repeats:
            return repeats[agent]
        if DEFAULT_REPEATS_KEY in repeats:
            return repeats[DEFAULT_REPEATS_KEY]
        raise ConfigError(
            f"{where}: num_repeats has no entry for agent {agent!r} and no {DEFAULT_REPEATS_KEY!r}"
        )


def _repeats(
    row: dict[str, Any], task_index: int, first: int, repeats: int
) -> Iterator[dict[str, Any]]:
    for rollout_index in range(first, first + repeats):
        copy = dict(row)
        copy[TASK_INDEX] = task_index
        copy[ROLLOUT_INDEX] = rollout_index
        yield copy


def _check_reserved_keys(row: dict[str, Any], where: str) -> None:
    if RESERVED_INPUT_KEYS.isdisjoint(row):
        return
    reserved = RESERVED_INPUT_KEYS.intersection(row)
    if reserved:
        raise ConfigError(
            f"{where}: task rows must not carry the dispatcher's own keys "
            f"({', '.join(sorted(reserved))})"
        )


def _check_own_rollout_id(value: Any, repeats: int, where: str) -> None:
    problem = own_rollout_id_problem(value)
    if problem is not None:
        raise ConfigError(f"{where}: {problem}")
    if repeats != 1:
        raise ConfigError(
            f"{where}: a row with its own {ROLLOUT_ID} cannot be repeated ({repeats} repeats)"
        )


def spec_rows(spec: MaterializeSpec, hasher: Any) -> Iterator[tuple[str, Buffer, dict[str, Any]]]:
    """``iter_input_rows`` of the spec's task file, as its settings say."""
    return iter_input_rows(
        spec.input_path, spec.limit, spec.skip_invalid_rows, hasher, spec.max_line_bytes
    )


def input_digest(spec: MaterializeSpec) -> str:
    """The ``input_digest`` that ``materialize`` records, without materializing."""
    if spec.limit is None:
        # Every line is read, so the digest is the whole file's: no need to parse it.
        whole = file_digest(spec.input_path)
        if whole is not None:
            return whole
    hasher = hashlib.sha256()
    for _ in spec_rows(spec, hasher):
        pass
    return hasher.hexdigest()


def materialize(
    spec: MaterializeSpec,
    destination: Path | None,
    *,
    durable: bool = True,
    lines: list[bytes] | None = None,
) -> MaterializeResult:
    """Stream the task file into ``destination`` (blocking: run it in a thread),
    fsynced unless ``durable=False``; None: written nowhere (a check of the rows).
    ``lines``: the task file's lines, in memory (``iter_rows_in_memory``), not read.

    The caller writes to a temporary name and renames it into place, so a bad
    line leaves no materialized file behind.
    """
    materializer = Materializer(spec, None if lines is None else len(lines))
    input_hash, output_hash = hashlib.sha256(), hashlib.sha256()
    input_rows = rollouts = 0
    by_agent: dict[str, int] = {}
    rows = (
        spec_rows(spec, input_hash)
        if lines is None
        else iter_rows_in_memory(
            lines, str(spec.input_path), spec.limit, input_hash, spec.max_line_bytes
        )
    )
    with destination.open("wb") if destination is not None else _Discard() as out:
        batch = _Batch(out, output_hash)
        for where, raw, row in rows:
            input_rows += 1
            written = batch.rows
            for materialized in materializer.expand(raw, row, where):
                batch.add(jsonx.dumps(materialized, option=orjson.OPT_APPEND_NEWLINE))
            written = batch.rows - written
            if written:
                rollouts += written
                agent = row[AGENT_REF]["name"]
                by_agent[agent] = by_agent.get(agent, 0) + written
        batch.flush()
        out.flush()
        if durable and not isinstance(out, _Discard):
            os.fsync(out.fileno())
    return MaterializeResult(
        input_rows=input_rows,
        tasks=materializer.tasks,
        rollouts=rollouts,
        rollouts_by_agent=by_agent,
        input_digest=input_hash.hexdigest(),
        materialized_digest=output_hash.hexdigest(),
    )


# Materialized lines are hashed and written this many rows, or bytes, at a time.
_WRITE_BATCH_ROWS = 1024
_WRITE_BATCH_BYTES = 1 << 20


class _Batch:
    """Materialized lines gathered across rows (most tasks have one rollout), then
    hashed and written at once."""

    def __init__(self, out: Any, hasher: Any) -> None:
        self._out, self._hasher = out, hasher
        self._lines: list[bytes] = []
        self._bytes = 0
        self.rows = 0  # lines added, in all

    def add(self, line: bytes) -> None:
        self._lines.append(line)
        self._bytes += len(line)
        self.rows += 1
        if len(self._lines) >= _WRITE_BATCH_ROWS or self._bytes >= _WRITE_BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        if self._lines:
            data = b"".join(self._lines)
            self._hasher.update(data)
            self._out.write(data)
            self._lines.clear()
            self._bytes = 0


class _Discard(contextlib.AbstractContextManager["_Discard"]):
    """Where ``materialize`` writes nothing: no file, no descriptor."""

    def write(self, data: bytes) -> int:
        return len(data)

    def flush(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        return None
