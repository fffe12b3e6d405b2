"""``ng_trajectory`` and ``ng_perf`` of one rollout (contracts §7). Pure functions, no I/O.

The trajectory is NeMo Gym's ``TrajectoryRecord`` (schema 1.0), so Gym's own
readers (its ``TrajectoryRecord`` model, ``gym eval health-check``) accept our rows:
``task_id`` and ``rollout_id`` are strings, ``invocations`` are agent
conversations referencing their model calls, ``turns`` are assistant responses,
``model_calls`` carry ``response_metadata`` and ``token_stats``, and ``gaps``
name what could not be observed. The schema forbids unknown keys; the models
(``schema.py``) mirror it, and whatever we emit is built from them.

An agent may send its own ``ng_trajectory``: when valid it is kept, identity
re-stamped (a mismatch is a gap), and the captured calls are merged into its
``model_calls`` by ``model_call_id``; nothing it said is dropped. Otherwise the
invocations are those of the agent's observations (``observations.py``), or one
built from the captures; their turns are the calls they own that returned a
response.

``ng_perf`` sums tokens over the calls the invocations reference, counting each
physical call once, so a call listed by two invocations cannot double the bill.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from dispatcher.capture.records import CapturedCall, model_server_ref
from dispatcher.tasks.schema import TRAJECTORY
from dispatcher.trajectory.schema import (
    Gap,
    Invocation,
    ModelCallRef,
    ModelServerRef,
    ResponseMetadata,
    TokenStats,
    ToolCall,
    TrajectoryModelCall,
    TrajectoryRecord,
    Turn,
)

BUILT_INVOCATION_ID = "agent"
JsonObject = dict[str, Any]

# Gap codes of NeMo Gym's collector; health-check reads them to tell "unobserved" from "unhealthy".
MODEL_CALLS_UNAVAILABLE = "model_calls_unavailable"
TURNS_UNAVAILABLE = "turns_unavailable"
CONVERSATION_UNAVAILABLE = "conversation_unavailable"
PRODUCER_INVALID = "producer_trajectory_invalid"
PRODUCER_IDENTITY_MISMATCH = "producer_trajectory_identity_mismatch"

# ng_perf key <- token_stats key
_PERF_TOKEN_KEYS = (
    ("prompt_tokens", "prompt_tokens"),
    ("cached_prompt_tokens", "cached_tokens"),
    ("completion_tokens", "completion_tokens"),
    ("reasoning_tokens", "reasoning_tokens"),
)


# --- identity ----------------------------------------------------------------------------


def trajectory_task_id(row: Mapping[str, Any], task_index: int) -> str:
    """The trajectory's ``task_id`` as Gym derives it: the row's own task id, else its index."""
    for key in ("task_id", "problem_id", "instance_id"):
        if row.get(key) is not None:
            return str(row[key])
    return str(task_index)


def gap(code: str, detail: str | None = None, invocation_id: str | None = None) -> JsonObject:
    """A gap as rows carry it: ``code`` plus ``detail``/``invocation_id`` when known."""
    entry: JsonObject = {"code": code}
    if invocation_id is not None:
        entry["invocation_id"] = invocation_id
    if detail is not None:
        entry["detail"] = detail
    return entry


# --- building ----------------------------------------------------------------------------


def build_trajectory(
    *,
    task_id: str,
    rollout_id: str,
    calls: Sequence[CapturedCall] | None,
    agent_trajectory: object = None,
    status: str = "completed",
    capture_gaps: Iterable[JsonObject] = (),
    resolved: object = None,
    include_payloads: bool = False,
    observed: Observed | None = None,
) -> JsonObject:
    """The row's ``ng_trajectory``; ``calls`` is None when nothing was captured at all.

    Turns always show the question and answer of their call (Gym's readers judge a
    turn by them); ``model_calls`` carry the raw request and response only with
    ``include_payloads``, like the capture block (a request holds the whole
    conversation so far, which would make a row grow with the square of its turns).
    """
    gaps = [Gap.model_validate(g) for g in capture_gaps]
    captured = [trajectory_model_call(call, include_payloads) for call in calls or ()]
    sent = _validated(agent_trajectory, gaps)
    if observed is not None:
        gaps.extend(observed.gaps)
    if sent is not None:
        record = _merged(sent, task_id, rollout_id, captured, gaps)
    else:
        record = TrajectoryRecord(
            task_id=task_id, rollout_id=rollout_id, model_calls=captured, gaps=gaps
        )
        _built(record, calls or (), status, observed, resolved)
    if observed is not None:
        _add_observed(record, observed)
    _add_unavailable_gaps(record, producer_turns=sent is not None)
    # Built by appending to lists, which pydantic does not re-validate: check the
    # record-wide rules once, here, before it is written.
    record.check_consistency()
    return record.model_dump(mode="json")


def _validated(agent_trajectory: object, gaps: list[Gap]) -> TrajectoryRecord | None:
    if not isinstance(agent_trajectory, dict):
        return None
    try:
        return TrajectoryRecord.model_validate(agent_trajectory)
    except ValidationError as exc:
        gaps.append(Gap(code=PRODUCER_INVALID, detail=_first_error(exc)))
        return None


def trajectory_model_call(call: CapturedCall, include_payloads: bool) -> TrajectoryModelCall:
    """A captured call as ``ng_trajectory.model_calls`` lists it."""
    request, response = _payloads(call) if include_payloads else (None, None)
    return TrajectoryModelCall(
        model_call_id=call.model_call_id,
        started_at=call.started_at,
        completed_at=call.completed_at,
        duration_ms=_non_negative(call.latency_ms),
        request=request,
        response=response,
        response_metadata=ResponseMetadata(
            response_id=call.response_id,
            model_ref=_server_ref(call.model_ref),
            model=call.response_model or call.request_model,
            dialect=call.dialect,
            status_code=call.status_code,
            response_status=call.response_status,
            finish_reason=call.finish_reason,
            error_category=call.error_category,
            latency_ttft_ms=_non_negative(call.latency_ttft_ms),
            **_execution(call.execution),
        ),
        token_stats=TokenStats(
            prompt_tokens=call.tokens.prompt,
            completion_tokens=call.tokens.completion,
            reasoning_tokens=call.tokens.reasoning,
            total_tokens=call.tokens.total,
            cached_tokens=call.tokens.cached,
        ),
    )


def _payloads(call: CapturedCall) -> tuple[Any, Any]:
    payloads = call.payloads or {}
    request = payloads.get("request", payloads.get("request_raw"))
    return request, payloads.get("response", payloads.get("response_raw"))


def _non_negative(value: float | None) -> float | None:
    return value if value is not None and value >= 0 else None


def _execution(execution: Mapping[str, Any]) -> JsonObject:
    # response_source is a closed set in Gym's schema; anything else is not reported.
    if execution.get("response_source") not in (None, "upstream", "local"):
        return {k: v for k, v in execution.items() if k != "response_source"}
    return dict(execution)


def _server_ref(model_ref: object) -> ModelServerRef | None:
    ref = model_server_ref(model_ref)
    return ModelServerRef.model_validate(ref) if ref is not None else None


@dataclass(frozen=True, slots=True)
class Observed:
    """What an agent's observation bundle (Gym's ``ng_agent_observations``) adds,
    already joined to the captured calls: its invocations, tool calls and gaps."""

    invocations: list[Invocation]
    tool_calls: list[ToolCall]
    gaps: list[Gap]


def _built(
    record: TrajectoryRecord,
    calls: Sequence[CapturedCall],
    status: str,
    observed: Observed | None,
    resolved: object,
) -> TrajectoryRecord:
    if observed is not None and observed.invocations:
        record.invocations.extend(observed.invocations)
    elif calls:
        refs = [ModelCallRef(model_call_id=call.model_call_id) for call in calls]
        invocation = Invocation(
            invocation_id=BUILT_INVOCATION_ID, status=_status(status), model_calls=refs
        )
        record.invocations.append(invocation)
    owners = _owners(record.invocations)
    steps: Counter[str] = Counter()
    for call in calls:
        owner = owners.get(call.model_call_id) or owners.get(call.response_id or "")
        if owner is None or not call.returned_response:
            continue  # unowned calls (a judge, say) stay evidence, never a turn of the agent
        record.turns.append(_turn(record, call, owner, steps[owner]))
        steps[owner] += len(call.tool_calls)
        record.tool_calls.extend(
            ToolCall(invocation_id=owner, tool_call_id=t.tool_call_id, tool_name=t.tool_name)
            for t in call.tool_calls
            if t.tool_call_id
        )
    if record.turns and isinstance(resolved, bool):
        record.turns[-1].resolved = resolved
    return record


def _owners(invocations: Sequence[Invocation]) -> dict[str, str]:
    """Invocation of each referenced call, by ``model_call_id`` or ``response_id``."""
    owners: dict[str, str] = {}
    for invocation in invocations:
        for ref in invocation.model_calls:
            for key in (ref.model_call_id, ref.response_id):
                if key:
                    owners.setdefault(key, invocation.invocation_id)
    return owners


def _add_observed(record: TrajectoryRecord, observed: Observed) -> None:
    """What the observations add that the trajectory does not already have."""
    known = {invocation.invocation_id for invocation in record.invocations}
    record.invocations.extend(i for i in observed.invocations if i.invocation_id not in known)
    tools = {(tool.invocation_id, tool.tool_call_id) for tool in record.tool_calls}
    record.tool_calls.extend(
        t for t in observed.tool_calls if (t.invocation_id, t.tool_call_id) not in tools
    )


def _status(status: str) -> Literal["completed", "failed", "incomplete", "unknown"]:
    if status in ("completed", "failed", "incomplete"):
        return status  # type: ignore[return-value]
    return "unknown"


def _turn(record: TrajectoryRecord, call: CapturedCall, owner: str, steps: int) -> Turn:
    question, answer, reasoning = turn_content(*_payloads(call))
    return Turn(
        invocation_id=owner,
        task_id=record.task_id,
        rollout_id=record.rollout_id,
        turn_no=sum(1 for turn in record.turns if turn.invocation_id == owner) + 1,
        timestamp=call.started_at or call.completed_at or 0.0,
        question=question,
        answer=answer,
        reasoning_content=reasoning,
        step_count=steps,
        model_calls=[ModelCallRef(model_call_id=call.model_call_id)],
    )


def turn_content(request: object, response: object) -> tuple[Any, Any, Any]:
    """A call's question, answer and reasoning, whatever the dialect; shapes never raise."""
    question: Any = request
    if isinstance(request, dict):
        question = request.get("input", request.get("messages", request.get("prompt")))
    if not isinstance(response, dict):
        return question, None, None
    output = response.get("output")
    if isinstance(output, list):
        items = [item for item in output if isinstance(item, dict)]
        reasoning = [item for item in items if item.get("type") == "reasoning"] or None
        return question, [item for item in items if item.get("type") != "reasoning"], reasoning
    content = response.get("content")
    if isinstance(content, list):
        blocks = [block for block in content if isinstance(block, dict)]
        thinking = [
            block for block in blocks if block.get("type") in ("thinking", "redacted_thinking")
        ]
        return question, [block for block in blocks if block not in thinking], thinking or None
    return (question, *_chat_answer(response))


def _chat_answer(response: Mapping[str, Any]) -> tuple[Any, Any]:
    choices = response.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(first, dict):
        return None, None
    message = first.get("message")
    if isinstance(message, dict):
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        answer = {k: v for k, v in message.items() if k not in ("reasoning_content", "reasoning")}
        return answer, reasoning
    text = first.get("text")
    return (text if isinstance(text, str) else None), None


def _merged(
    sent: TrajectoryRecord,
    task_id: str,
    rollout_id: str,
    captured: list[TrajectoryModelCall],
    gaps: list[Gap],
) -> TrajectoryRecord:
    """The agent's trajectory with our identity and the captured calls merged in."""
    record = sent.model_copy(deep=True)
    wrong = [
        name
        for name, theirs, ours in (
            ("task_id", sent.task_id, task_id),
            ("rollout_id", sent.rollout_id, rollout_id),
        )
        if theirs != ours
    ]
    if wrong:
        gaps.insert(0, Gap(code=PRODUCER_IDENTITY_MISMATCH, detail=",".join(wrong)))
        record.task_id, record.rollout_id = task_id, rollout_id
        for turn in record.turns:
            turn.task_id, turn.rollout_id = task_id, rollout_id
    record.model_calls = merge_model_calls(record.model_calls, captured)
    record.gaps = [*record.gaps, *gaps]
    return record


def merge_model_calls(
    reported: Sequence[TrajectoryModelCall], captured: Sequence[TrajectoryModelCall]
) -> list[TrajectoryModelCall]:
    """The agent's calls, each updated with what capture observed of it (same ``model_call_id``),
    then the captured calls the agent did not list. Captured facts win where both say something."""
    merged = [call.model_copy(deep=True) for call in reported]
    positions = {call.model_call_id: i for i, call in enumerate(merged) if call.model_call_id}
    for call in captured:
        position = positions.pop(call.model_call_id, None) if call.model_call_id else None
        if position is None:
            merged.append(call)
            continue
        base = merged[position].model_dump()
        update = call.model_dump(exclude_none=True)
        for key in ("response_metadata", "token_stats"):
            base[key].update(update.pop(key))
        merged[position] = TrajectoryModelCall.model_validate({**base, **update})
    return merged


def _add_unavailable_gaps(record: TrajectoryRecord, *, producer_turns: bool) -> None:
    """What Gym's readers must not judge: absent evidence is "unobserved", not "unhealthy"."""
    if not record.model_calls:
        record.gaps.append(Gap(code=MODEL_CALLS_UNAVAILABLE))
    # An agent that sent a trajectory with no turns has said no turn completed.
    if not record.turns and not producer_turns:
        record.gaps.append(Gap(code=TURNS_UNAVAILABLE))
    if not any(invocation.conversation for invocation in record.invocations):
        record.gaps.append(Gap(code=CONVERSATION_UNAVAILABLE))
    unique = {(g.code, g.invocation_id, g.detail): g for g in record.gaps}
    record.gaps = list(unique.values())


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or TRAJECTORY
    return f"{where}: {first['msg']}"


# --- joining refs to calls ---------------------------------------------------------------


def _ref_key(model_ref: object) -> tuple[str, str] | None:
    if isinstance(model_ref, Mapping) and isinstance(model_ref.get("name"), str):
        return str(model_ref.get("type")), str(model_ref["name"])
    return None


class CallIndex:
    """Finds the one call a ref names, by ``model_call_id`` or ``(model_ref, response_id)``,
    the way Gym's readers join them (a ref's extra keys must agree with the call)."""

    def __init__(self, calls: Sequence[Mapping[str, Any]]) -> None:
        self._calls = calls
        self._by_id: dict[str, list[int]] = {}
        self._by_response: dict[tuple[tuple[str, str], str], list[int]] = {}
        for position, call in enumerate(calls):
            if call.get("model_call_id"):
                self._by_id.setdefault(call["model_call_id"], []).append(position)
            metadata = _metadata(call)
            key, response_id = _ref_key(metadata.get("model_ref")), metadata.get("response_id")
            if key is not None and response_id:
                self._by_response.setdefault((key, response_id), []).append(position)

    def match(self, ref: Mapping[str, Any]) -> int | None:
        """Position of the matching call; None when no call or several calls match."""
        if ref.get("model_call_id"):
            candidates = [
                p for p in self._by_id.get(ref["model_call_id"], []) if self._agrees(ref, p)
            ]
        else:
            key, response_id = _ref_key(ref.get("model_ref")), ref.get("response_id")
            candidates = (
                self._by_response.get((key, response_id), []) if key and response_id else []
            )
        return candidates[0] if len(candidates) == 1 else None

    def _agrees(self, ref: Mapping[str, Any], position: int) -> bool:
        metadata = _metadata(self._calls[position])
        model_ref, response_id = ref.get("model_ref"), ref.get("response_id")
        same_ref = model_ref is None or _ref_key(model_ref) == _ref_key(metadata.get("model_ref"))
        return same_ref and (response_id is None or response_id == metadata.get("response_id"))


def _metadata(call: Mapping[str, Any]) -> Mapping[str, Any]:
    metadata = call.get("response_metadata")
    return metadata if isinstance(metadata, Mapping) else {}


# --- ng_perf -----------------------------------------------------------------------------


def compute_perf(trajectory: Mapping[str, Any], *, total_latency_ms: float) -> JsonObject | None:
    """``ng_perf`` of a trajectory; None when it has no invocation (nothing to measure)."""
    invocations = trajectory.get("invocations") or []
    if not invocations:
        return None
    calls = trajectory.get("model_calls") or []
    owned, owned_by_invocation = _owned_calls(invocations, CallIndex(calls))
    invocation_ids = [invocation["invocation_id"] for invocation in invocations]
    turns_by_invocation = Counter(turn["invocation_id"] for turn in trajectory.get("turns") or [])
    num_turns = sum(turns_by_invocation[i] or owned_by_invocation[i] or 1 for i in invocation_ids)
    known = set(invocation_ids)
    tools = trajectory.get("tool_calls") or []
    perf: JsonObject = {
        "num_turns": num_turns,
        "num_tool_calls": sum(1 for tool in tools if tool.get("invocation_id") in known),
        "token_observability_coverage": min(1.0, len(owned) / num_turns),
    }
    for perf_key, stats_key in _PERF_TOKEN_KEYS:
        values = [_stat(calls[p], stats_key) for p in owned]
        present = [value for value in values if value is not None]
        if present:
            perf[perf_key] = sum(present)
    perf["total_latency_ms"] = total_latency_ms
    return perf


def _stat(call: Mapping[str, Any], key: str) -> int | None:
    stats = call.get("token_stats")
    value = stats.get(key) if isinstance(stats, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _owned_calls(
    invocations: Sequence[Mapping[str, Any]], index: CallIndex
) -> tuple[list[int], Counter[str]]:
    seen: set[int] = set()
    owned: list[int] = []
    by_invocation: Counter[str] = Counter()
    for invocation in invocations:
        for ref in invocation.get("model_calls") or []:
            position = index.match(ref)
            if position is None or position in seen:
                continue
            seen.add(position)
            owned.append(position)
            by_invocation[invocation["invocation_id"]] += 1
    return owned, by_invocation
