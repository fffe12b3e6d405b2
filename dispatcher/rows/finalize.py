"""Finalizing a rollout's row (contracts §6, §7): quiescence, capture merge, trajectory, one line.

``Finalizer.finalize`` turns an attempt into the bytes appended to an output
file. With a capture directory it waits until the rollout's model-call
captures are durable (the wait stays on the event loop), merges them into the
row with token and latency figures, and serializes it; a big merge runs
whole in the worker thread (``offload.py``). Without one, the agent's own
trajectory is normalized as NeMo Gym's collector does. A rollout's ``Flight``
calls it once per answer and writes the line.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypedDict

import msgspec

from dispatcher.capture.scope import capture_key
from dispatcher.capture.store import capture_path, has_claims
from dispatcher.capture.tokens import completion_tokens
from dispatcher.delivery.client import Attempt
from dispatcher.files.contracts import FAILURE_CLASS, FAILURE_TERMINAL, NOT_DELIVERED
from dispatcher.files.writer import Line
from dispatcher.rows.build import build_row
from dispatcher.rows.capture import CaptureSummary, attach_agent_trajectory, attach_capture
from dispatcher.rows.offload import off_loop
from dispatcher.rows.wire import WireResult, row_line
from dispatcher.settings.config import RunSettings
from dispatcher.tasks.materialize import Rollout
from dispatcher.tasks.schema import MASK_SAMPLE, PERF, REWARD
from dispatcher.telemetry.metrics import Metrics

# A row's line (None: nothing is written), what ``Job.record`` reads of it, the capture's figures.
Finalized = tuple[Line | None, dict[str, Any] | None, dict[str, Any]]


class Finalizer:
    """Builds each attempt's output line; records capture waits and gaps in the metrics."""

    def __init__(self, settings: RunSettings, metrics: Metrics, count_tokens: bool = True) -> None:
        self.settings = settings
        self.metrics = metrics
        # Whether a row's facts carry its generated tokens (``GENERATED_TOKENS``): only
        # a reader of final outcomes counts them (service mode's groups).
        self.count_tokens = count_tokens
        # The run's id, on every row (contracts §15); set once the run's files are open.
        self.run_id: str | None = None

    def pauses(self, attempt: Attempt) -> bool:
        """Whether ``finalize`` awaits anything (capture, a worker) for this attempt;
        otherwise it runs to its end without giving the loop a turn."""
        return self.settings.capture_dir is not None or self._big(attempt)

    def _big(self, attempt: Attempt) -> bool:
        return attempt.body_bytes > self.settings.offload_bytes

    async def finalize(
        self, rollout: Rollout, attempt: Attempt, extra: Mapping[str, Any] | None = None
    ) -> Finalized:
        """The line to append for this attempt (capture attached), what ``Job.record``
        reads of its row, and the capture's figures. ``extra`` keys are added
        to the row (the policy versions of service mode).

        A big row is merged and serialized in a worker and then held only as
        its line: the dict it came from is dropped here.
        """
        if not self.pauses(attempt):
            return self.finalize_now(rollout, attempt, extra)
        row = self._row(rollout, attempt, extra)
        if row is None:
            return None, None, {}
        big = self._big(attempt)
        if self.settings.capture_dir is not None:
            line, capture = await self._attach_capture(rollout, attempt, row, big)
        else:
            line, capture = await off_loop(_plain_line, rollout, attempt, row), {}
        return line, self._facts(attempt, row), capture

    def finalize_now(
        self, rollout: Rollout, attempt: Attempt, extra: Mapping[str, Any] | None = None
    ) -> Finalized:
        """``finalize`` for an attempt it does not pause for (``pauses`` is False), in
        place: no coroutine for the rows of most answers."""
        row = self._row(rollout, attempt, extra)
        if row is None:
            return None, None, {}
        return _plain_line(rollout, attempt, row), self._facts(attempt, row), {}

    def _row(
        self, rollout: Rollout, attempt: Attempt, extra: Mapping[str, Any] | None
    ) -> dict[str, Any] | None:
        environment = self.settings.gym_environments.get(rollout.agent)
        row = build_row(rollout, attempt, self.run_id, environment)
        if row is not None and extra:
            row.update(extra)
        return row

    def _facts(self, attempt: Attempt, row: dict[str, Any]) -> dict[str, Any]:
        if isinstance(attempt.result, WireResult):
            # Its kept values are slices of the agent's body: only the line waits
            # for the commit, and a big line's pieces are the body itself
            # (1x its size, never 2x).
            attempt.result.clear()
        return row_facts(row, self.count_tokens)

    async def _attach_capture(
        self, rollout: Rollout, attempt: Attempt, row: dict[str, Any], big: bool
    ) -> tuple[Line, dict[str, Any]]:
        """Attach the captured calls and serialize; a big merge runs in a worker thread.

        The quiescence wait stays here, on the loop: a worker must not sleep
        through a poll. The merge of many big calls and its serialization go to
        the worker, whole, with what is left of the wait limit.
        """
        capture_dir = self.settings.capture_dir
        assert capture_dir is not None
        capture_id = await asyncio.to_thread(capture_key, capture_dir, rollout)
        waited_s, capture_bytes = await self._wait_quiet(capture_id)
        merge = functools.partial(
            attach_capture,
            row,
            capture_dir=capture_dir,
            rollout_id=rollout.rollout_id,
            capture_id=capture_id,
            task_id=rollout.task_index,
            agent_result=_readable(attempt.result),
            total_latency_ms=attempt.duration_s * 1000.0,
            poll_s=self.settings.capture_poll_s,
            limit_s=max(0.0, self.settings.capture_wait_limit_s - waited_s),
            include_payloads=self.settings.capture_include_payloads,
        )
        if big or capture_bytes > self.settings.offload_bytes:
            line, summary = await off_loop(_merge_in_worker, merge, row)
        else:
            summary = await merge()
            line = row_line(row)
        wait_s = waited_s + summary.wait_s
        self.metrics.capture_waited(wait_s, summary.gaps)
        return line, {"calls": summary.num_calls, "gaps": summary.gaps, "wait_s": wait_s}

    async def _wait_quiet(self, rollout_id: str) -> tuple[float, int]:
        """Poll until no capture write of the rollout is claimed (or the limit);
        returns the seconds waited and the size of its capture file."""
        capture_dir = self.settings.capture_dir
        assert capture_dir is not None
        started = time.perf_counter()
        deadline = started + self.settings.capture_wait_limit_s
        while True:
            claimed, size = await asyncio.to_thread(_capture_state, capture_dir, rollout_id)
            if not claimed or time.perf_counter() >= deadline:
                return time.perf_counter() - started, size
            await asyncio.sleep(
                min(self.settings.capture_poll_s, max(0.0, deadline - time.perf_counter()))
            )


def row_facts(row: Mapping[str, Any], count_tokens: bool = True) -> dict[str, Any]:
    """What ``Job.record`` reads of a row, so the row itself need not be kept, and
    (``count_tokens``) its generated tokens (``GENERATED_TOKENS``), which a token
    target counts."""
    # The keys a row has, found in one set operation: most rows have one (a reward).
    facts = {key: row[key] for key in _FACT_KEYS.intersection(row)}
    if count_tokens:
        tokens = generated_tokens(row)
        if tokens is not None:
            facts[GENERATED_TOKENS] = tokens
    return facts


# The facts' key of a row's generated tokens (not a key of the row).
GENERATED_TOKENS = "generated_tokens"
# The agent's answer, whose ``usage`` says the tokens generated without a capture.
RESPONSE = "response"


def generated_tokens(row: Mapping[str, Any]) -> int | None:
    """The tokens a rollout generated: its captured model calls' completion tokens
    (``ng_perf``), else the agent's own ``usage`` in its ``response``; None when
    neither says."""
    # ``type(x) is dict`` first: the ABC check of ``Mapping`` is most of the cost.
    perf = row.get(PERF)
    if perf is not None and (type(perf) is dict or isinstance(perf, Mapping)):
        completion = perf.get("completion_tokens")
        if isinstance(completion, int) and not isinstance(completion, bool):
            return completion
    response = row.get(RESPONSE)
    if type(response) is dict or isinstance(response, Mapping):
        return completion_tokens(response.get("usage"))
    if isinstance(response, msgspec.Raw):
        # A big row keeps its response as bytes: only its usage is decoded.
        try:
            return completion_tokens(_USAGE.decode(response).get("usage"))
        except msgspec.DecodeError:
            return None
    return None


class _Counts(TypedDict, total=False):
    completion_tokens: Any


class _Response(TypedDict, total=False):
    usage: Any


# What ``generated_tokens`` reads of a row, as ``FactsReader`` shapes: a reader of
# written rows decodes these and skips the rest of the agent's ``response`` (its
# output, its token ids) without building it. Any other shape of the two keys is a
# mismatch, which the reader then decodes whole.
TOKENS_SHAPES: Mapping[str, Any] = {PERF: _Counts | None, RESPONSE: _Response | None}
# A big row's response kept as bytes: its usage decoded, the rest skipped.
_USAGE = msgspec.json.Decoder(_Response)


# What the one finality rule (``state.final_after_failure``) reads of a failure row,
# and the reward, which service mode's group filter reads (contracts §13); the
# class and ``mask_sample`` for the run's coverage and status files (contracts §15).
_FACT_KEYS = frozenset((FAILURE_TERMINAL, NOT_DELIVERED, REWARD, FAILURE_CLASS, MASK_SAMPLE))


def _readable(result: dict[str, Any] | None) -> Mapping[str, Any] | None:
    """The agent's result as plain values for the capture merge (decoded on demand)."""
    return result.decoded() if isinstance(result, WireResult) else result


def _plain_line(rollout: Rollout, attempt: Attempt, row: dict[str, Any]) -> Line:
    """A row without capture: the agent's own trajectory normalized as Gym's collector
    does (its model calls then read as unobserved), then serialized."""
    attach_agent_trajectory(
        row,
        rollout_id=rollout.rollout_id,
        task_id=rollout.task_index,
        agent_result=_readable(attempt.result),
    )
    return row_line(row)


def _merge_in_worker(
    merge: Callable[[], Coroutine[Any, Any, CaptureSummary]], row: dict[str, Any]
) -> tuple[Line, CaptureSummary]:
    """Run the capture merge on a loop of this worker thread, then serialize the row."""
    summary = asyncio.run(merge())
    return row_line(row), summary


def _capture_state(capture_dir: Path, rollout_id: str) -> tuple[bool, int]:
    """Whether a capture write of the rollout is claimed, and its capture file's size."""
    try:
        size = capture_path(capture_dir, rollout_id).stat().st_size
    except OSError:
        size = 0
    try:
        return has_claims(capture_dir, rollout_id), size
    except OSError:
        # attach_capture reads what is there and names the error as a gap.
        return False, size
