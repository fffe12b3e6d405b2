"""Attach a rollout's captured model calls to its row (contracts §6, §7).

For each finished rollout: wait until none of its writes is claimed (the proxy
may still be writing the last call when the agent's answer arrives), read only
that rollout's capture file, line by line in a worker thread, and add
``ng_model_call_capture``, ``ng_trajectory`` and ``ng_perf`` to the row. The
agent's own keys and reward are never touched.

A bad line costs only itself (``model_call_capture_records_unreadable`` with
``count=N``); everything that prevents a complete picture is a gap on the row,
never an exception in the run loop.

``dispatcher.trajectory`` is imported at the first row that has a trajectory
(a capture directory, or an agent that sends its own): building its pydantic
models (Gym's schema) was ~15 ms of every ``run`` and ``serve`` process's
start-up, and most runs' rows carry none. An import is safe when a worker
thread and the loop get there at once; a deferred model build
(``defer_build``) is not, in every pydantic this package accepts.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dispatcher.capture.records import CapturedCall, parse_record, token_fields
from dispatcher.capture.store import capture_path, clear_rollouts, has_claims, incomplete_path
from dispatcher.capture.tokens import TokenCounts
from dispatcher.files.contracts import FAILURE_CLASS
from dispatcher.rows.wire import DecodedView
from dispatcher.tasks.schema import AGENT_OBSERVATIONS, MODEL_CALL_CAPTURE, PERF, TRAJECTORY

JsonObject = dict[str, Any]

NO_RECORDS = "model_call_capture_no_records"
INCOMPLETE = "model_call_capture_incomplete"
RECORDS_UNREADABLE = "model_call_capture_records_unreadable"
UNREADABLE = "model_call_capture_unreadable"
PENDING = "model_call_capture_pending"

# Ids per worker-thread call when clearing: large enough to amortize the hop,
# small enough that a huge run yields to the loop between batches.
_CLEAR_BATCH = 512


async def clear_rollout_captures(capture_dir: Path, rollout_ids: Iterable[str]) -> None:
    """Remove capture files, markers and claims of exactly these ids (before they run)."""
    ids = iter(rollout_ids)
    while batch := list(itertools.islice(ids, _CLEAR_BATCH)):
        await asyncio.to_thread(clear_rollouts, capture_dir, batch)


@dataclass(slots=True)
class CaptureSummary:
    """What finalization saw: time spent waiting for quiescence, calls attached, gap codes."""

    wait_s: float
    num_calls: int
    gaps: list[str]


@dataclass(slots=True)
class _Snapshot:
    calls: list[CapturedCall] = field(default_factory=list)
    unreadable_lines: int = 0
    incomplete: bool = False
    error: str | None = None


def _read_if_quiet(capture_dir: Path, rollout_id: str, include_payloads: bool) -> _Snapshot | None:
    """None while a write is outstanding; checking and reading in one worker call keeps
    the common case (already quiet) to a single thread hop."""
    try:
        if has_claims(capture_dir, rollout_id):
            return None
    except OSError as exc:
        # Quiescence cannot be known; read what is there and say why it may be partial.
        snapshot = _read_capture(capture_dir, rollout_id, include_payloads)
        snapshot.error = snapshot.error or f"claims: {type(exc).__name__}: {exc.strerror or exc}"
        return snapshot
    return _read_capture(capture_dir, rollout_id, include_payloads)


def _read_capture(capture_dir: Path, rollout_id: str, include_payloads: bool) -> _Snapshot:
    """One rollout's captures, one line in memory at a time (plus the calls kept)."""
    snapshot = _Snapshot(incomplete=incomplete_path(capture_dir, rollout_id).exists())
    try:
        with capture_path(capture_dir, rollout_id).open("rb") as lines:
            for line in lines:
                _add_line(snapshot, line, include_payloads)
    except FileNotFoundError:
        pass
    except OSError as exc:
        snapshot.error = f"{type(exc).__name__}: {exc.strerror or exc}"
    return snapshot


def _add_line(snapshot: _Snapshot, line: bytes, include_payloads: bool) -> None:
    if not line.strip():
        return
    index = len(snapshot.calls) + snapshot.unreadable_lines
    try:
        call = parse_record(line, call_index=index, include_payloads=include_payloads)
    except Exception:  # a line any server wrote must never end the run: it is a gap
        call = None
    if call is None:
        snapshot.unreadable_lines += 1
    else:
        snapshot.calls.append(call)


async def _wait_and_read(
    capture_dir: Path, rollout_id: str, include_payloads: bool, poll_s: float, limit_s: float
) -> tuple[_Snapshot, float, bool]:
    """Poll until quiet or ``limit_s``; returns the snapshot, seconds waited, and pending."""
    started = time.perf_counter()
    deadline = started + limit_s
    while True:
        quiet = await asyncio.to_thread(_read_if_quiet, capture_dir, rollout_id, include_payloads)
        if quiet is not None:
            return quiet, time.perf_counter() - started, False
        if time.perf_counter() >= deadline:
            break
        await asyncio.sleep(min(poll_s, max(0.0, deadline - time.perf_counter())))
    waited = time.perf_counter() - started
    snapshot = await asyncio.to_thread(_read_capture, capture_dir, rollout_id, include_payloads)
    return snapshot, waited, True


def _gaps(snapshot: _Snapshot, pending: bool) -> list[JsonObject]:
    from dispatcher.trajectory.build import gap  # at first use: see the module docstring

    gaps = []
    if pending:
        gaps.append(gap(PENDING))
    if snapshot.error is not None:
        gaps.append(gap(UNREADABLE, snapshot.error))
    elif not snapshot.calls and not snapshot.unreadable_lines:
        gaps.append(gap(NO_RECORDS))
    if snapshot.incomplete:
        gaps.append(gap(INCOMPLETE))
    if snapshot.unreadable_lines:
        gaps.append(gap(RECORDS_UNREADABLE, f"count={snapshot.unreadable_lines}"))
    return gaps


def capture_metrics(calls: Sequence[CapturedCall]) -> JsonObject:
    """Sums over the calls; a sum is None when no call reported that quantity."""
    tokens = TokenCounts(
        *(_sum_counts(getattr(c.tokens, f.name) for c in calls) for f in fields(TokenCounts))
    )
    latencies = [c.latency_ms for c in calls if c.latency_ms is not None]
    return {
        **token_fields(tokens),
        "latency_total_ms": round(sum(latencies), 3) if latencies else None,
        "num_calls": len(calls),
    }


def _sum_counts(values: Iterable[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


async def attach_capture(
    row: dict[str, Any],
    *,
    capture_dir: Path,
    rollout_id: str,
    task_id: int,
    agent_result: Mapping[str, Any] | None,
    total_latency_ms: float,
    poll_s: float = 0.05,
    limit_s: float = 10.0,
    include_payloads: bool = False,
    observability: bool = True,
    capture_id: str | None = None,
) -> CaptureSummary:
    """Wait for quiescence, then add ``ng_model_call_capture``, ``ng_trajectory``, ``ng_perf``.

    The files read are ``capture_id``'s when given (one attempt of one hop,
    see ``capture.scope``); the row still names ``rollout_id``.
    """
    # Payloads are always read: the trajectory's turns are made of them (as in Gym);
    # only the capture block drops them unless asked.
    snapshot, wait_s, pending = await _wait_and_read(
        capture_dir, capture_id or rollout_id, True, poll_s, limit_s
    )
    gaps = _gaps(snapshot, pending)
    capture: JsonObject = {
        "rollout_id": rollout_id,
        "metrics": capture_metrics(snapshot.calls),
        "calls": [call.to_row(include_payloads=include_payloads) for call in snapshot.calls],
    }
    if gaps:
        capture["gaps"] = gaps
    row[MODEL_CALL_CAPTURE] = capture
    _attach_trajectory(
        row, task_id, rollout_id, agent_result, (snapshot.calls, include_payloads), gaps
    )
    trajectory = row.get(TRAJECTORY)
    if observability and isinstance(trajectory, dict):
        from dispatcher.trajectory.build import compute_perf  # imported by _attach_trajectory

        perf = compute_perf(trajectory, total_latency_ms=total_latency_ms)
        if perf is not None:
            row[PERF] = perf
    return CaptureSummary(wait_s, len(snapshot.calls), [g["code"] for g in gaps])


def attach_agent_trajectory(
    row: dict[str, Any], *, rollout_id: str, task_id: int, agent_result: Mapping[str, Any] | None
) -> None:
    """Without capture: normalize the agent's own ``ng_trajectory`` (or observations) as
    Gym's collector does, so its missing model calls read as "unobserved" (a gap), not
    as a mismatch."""
    # Two tests spelled out, once per row: a generator and ``any`` cost five times theirs.
    if agent_result is None or (
        TRAJECTORY not in agent_result and AGENT_OBSERVATIONS not in agent_result
    ):
        return
    _attach_trajectory(row, task_id, rollout_id, agent_result, (None, False), [])


def _attach_trajectory(
    row: dict[str, Any],
    task_id: int,
    rollout_id: str,
    agent_result: Mapping[str, Any] | None,
    captured: tuple[Sequence[CapturedCall] | None, bool],
    gaps: list[JsonObject],
) -> None:
    # At first use: see the module docstring.
    from dispatcher.trajectory.build import build_trajectory, gap, trajectory_task_id
    from dispatcher.trajectory.observations import observed_from

    result = agent_result or {}
    calls, include_payloads = captured
    # A big answer's row keeps the agent's values as bytes (rows/wire.py): its task id read plain.
    task_key = trajectory_task_id(DecodedView(row), task_id)
    try:
        observed = observed_from(result.get(AGENT_OBSERVATIONS), calls)
        row[TRAJECTORY] = build_trajectory(
            task_id=task_key,
            rollout_id=rollout_id,
            calls=calls,
            agent_trajectory=result.get(TRAJECTORY),
            status="failed" if FAILURE_CLASS in row else "completed",
            capture_gaps=gaps,
            resolved=result.get("resolved"),
            include_payloads=include_payloads,
            observed=observed,
        )
    except Exception as exc:  # the row must still be written: say why it has no trajectory
        failed = gap("trajectory_projection_failed", type(exc).__name__)
        row[TRAJECTORY] = {
            "schema_version": "1.0",
            "task_id": task_key,
            "rollout_id": rollout_id,
            "gaps": [failed],
        }
