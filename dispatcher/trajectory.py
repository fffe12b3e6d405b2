"""``ng_trajectory`` and ``ng_perf`` of one rollout (DESIGN A7). Pure functions, no I/O.

A trajectory (schema 1.0) says what the agent did: ``invocations`` (one per
agent conversation, each referencing the model calls it made), ``turns`` (one
per assistant response), ``model_calls`` (the physical calls, with tokens),
``tool_calls`` and ``gaps`` (what could not be observed or joined).

An agent may send its own ``ng_trajectory``; it is validated, stamped with the
dispatcher's identity (a mismatch is a gap, never a silent overwrite) and its
references are joined against the captured calls. Otherwise one invocation is
built from the captures, whose turns are the calls that returned a response.

``ng_perf`` sums tokens over the calls the invocations reference, counting each
physical call once, so a call listed by two invocations cannot double the bill.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dispatcher.capture.records import CapturedCall, token_fields

SCHEMA_VERSION = "1.0"
BUILT_INVOCATION_ID = "agent"
JsonObject = dict[str, Any]

# ng_perf key <- trajectory model_call key
_PERF_TOKEN_KEYS = (
    ("prompt_tokens", "tokens_in"),
    ("cached_prompt_tokens", "cached_tokens"),
    ("completion_tokens", "tokens_out"),
    ("reasoning_tokens", "tokens_reasoning"),
)


# --- validation of an agent's own trajectory ---------------------------------------------


class _Open(BaseModel):
    # Unknown keys are kept: producers may carry more than this schema names.
    model_config = ConfigDict(extra="allow")


class ModelCallRef(_Open):
    model_call_id: str | None = None
    model_ref: str | dict[str, Any] | None = None
    response_id: str | None = None

    @model_validator(mode="after")
    def _joinable(self) -> ModelCallRef:
        if not self.model_call_id and not (self.model_ref and self.response_id):
            raise ValueError("a model call ref needs model_call_id or model_ref and response_id")
        return self


class Invocation(_Open):
    invocation_id: str = Field(min_length=1)
    status: Literal["completed", "failed", "incomplete", "unknown"] = "unknown"
    model_calls: list[ModelCallRef] = Field(default_factory=list)


class Turn(_Open):
    invocation_id: str


class ToolCall(_Open):
    invocation_id: str
    tool_call_id: str | None = None
    tool_name: str | None = None


class TrajectoryModelCall(_Open):
    model_call_id: str | None = None
    model_ref: str | dict[str, Any] | None = None
    response_id: str | None = None
    tokens_in: int | None = Field(default=None, ge=0)
    tokens_out: int | None = Field(default=None, ge=0)
    tokens_reasoning: int | None = Field(default=None, ge=0)
    tokens_total: int | None = Field(default=None, ge=0)
    cached_tokens: int | None = Field(default=None, ge=0)


class Gap(_Open):
    code: str = Field(min_length=1)
    invocation_id: str | None = None
    detail: str | None = None


class AgentTrajectory(_Open):
    """What an agent may send as ``ng_trajectory``; identity is checked by the caller."""

    schema_version: str = SCHEMA_VERSION
    task_id: Any = None
    rollout_id: Any = None
    invocations: list[Invocation] = Field(default_factory=list)
    turns: list[Turn] = Field(default_factory=list)
    model_calls: list[TrajectoryModelCall] = Field(default_factory=list)
    tool_calls: list[ToolCall] = Field(default_factory=list)
    gaps: list[Gap] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> AgentTrajectory:
        if self.schema_version.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
            raise ValueError(f"schema_version {self.schema_version!r} is not 1.x")
        ids = [invocation.invocation_id for invocation in self.invocations]
        if len(ids) != len(set(ids)):
            raise ValueError("invocation_id must be unique")
        known = set(ids)
        referenced = [t.invocation_id for t in self.turns]
        referenced += [t.invocation_id for t in self.tool_calls]
        for invocation_id in referenced:
            if invocation_id not in known:
                raise ValueError(f"unknown invocation_id {invocation_id!r}")
        return self


# --- building ----------------------------------------------------------------------------


def gap(code: str, detail: str | None = None, invocation_id: str | None = None) -> JsonObject:
    """A gap as rows carry it: ``code`` plus ``detail``/``invocation_id`` when known."""
    entry: JsonObject = {"code": code}
    if invocation_id is not None:
        entry["invocation_id"] = invocation_id
    if detail is not None:
        entry["detail"] = detail
    return entry


def build_trajectory(
    *,
    task_id: int,
    rollout_id: str,
    calls: Sequence[CapturedCall],
    agent_trajectory: object = None,
    status: str = "completed",
    capture_gaps: Iterable[JsonObject] = (),
) -> JsonObject:
    """The row's ``ng_trajectory``: the agent's own when it sent a valid one, else built."""
    gaps = list(capture_gaps)
    captured = [trajectory_model_call(call) for call in calls]
    if agent_trajectory is not None:
        try:
            sent = AgentTrajectory.model_validate(agent_trajectory)
        except ValidationError as exc:
            gaps.append(gap("trajectory_invalid", _first_error(exc)))
        else:
            return _adopt(sent, task_id, rollout_id, captured, gaps)
    return _built(task_id, rollout_id, calls, captured, status, gaps)


def trajectory_model_call(call: CapturedCall) -> JsonObject:
    """A captured call as ``ng_trajectory.model_calls`` lists it."""
    return {
        "model_call_id": call.model_call_id,
        "model_ref": call.model_ref,
        "response_id": call.response_id,
        "status_code": call.status_code,
        "error_category": call.error_category,
        "latency_ms": call.latency_ms,
        **token_fields(call.tokens),
    }


def _built(
    task_id: int,
    rollout_id: str,
    calls: Sequence[CapturedCall],
    captured: list[JsonObject],
    status: str,
    gaps: list[JsonObject],
) -> JsonObject:
    invocations: list[JsonObject] = []
    turns: list[JsonObject] = []
    tool_calls: list[JsonObject] = []
    if calls:
        refs = [{"model_call_id": call.model_call_id} for call in calls]
        invocation = {"invocation_id": BUILT_INVOCATION_ID, "status": status, "model_calls": refs}
        invocations.append(invocation)
    for call in (call for call in calls if call.returned_response):
        turns.append(
            {
                "invocation_id": BUILT_INVOCATION_ID,
                "turn_no": len(turns) + 1,
                "model_call": {"model_call_id": call.model_call_id},
            }
        )
        tool_calls.extend(
            {
                "invocation_id": BUILT_INVOCATION_ID,
                "tool_call_id": tool.tool_call_id,
                "tool_name": tool.tool_name,
                "model_call_id": call.model_call_id,
            }
            for tool in call.tool_calls
        )
    return _record(task_id, rollout_id, invocations, turns, captured, tool_calls, gaps)


def _adopt(
    sent: AgentTrajectory,
    task_id: int,
    rollout_id: str,
    captured: list[JsonObject],
    gaps: list[JsonObject],
) -> JsonObject:
    data = sent.model_dump(mode="json", exclude_none=True)
    mismatch = _identity_mismatch(sent, task_id, rollout_id)
    if mismatch is not None:
        gaps.append(gap("trajectory_identity_mismatch", mismatch))
    index = CallIndex(captured)
    extra_calls = [c for c in data["model_calls"] if index.match(c) is None]
    model_calls = captured + extra_calls
    gaps = [*data["gaps"], *gaps, *_join_gaps(data["invocations"], CallIndex(model_calls))]
    return _record(
        task_id,
        rollout_id,
        data["invocations"],
        data["turns"],
        model_calls,
        data["tool_calls"],
        gaps,
        extra={k: v for k, v in data.items() if k not in _RECORD_KEYS},
    )


def _identity_mismatch(sent: AgentTrajectory, task_id: int, rollout_id: str) -> str | None:
    wrong = []
    if sent.task_id is not None and sent.task_id != task_id:
        wrong.append(f"task_id={sent.task_id!r}")
    if sent.rollout_id is not None and sent.rollout_id != rollout_id:
        wrong.append(f"rollout_id={sent.rollout_id!r}")
    return " ".join(wrong) if wrong else None


def _join_gaps(invocations: list[JsonObject], index: CallIndex) -> list[JsonObject]:
    gaps = []
    for invocation in invocations:
        for ref in invocation["model_calls"]:
            if index.match(ref) is None:
                detail = ref.get("model_call_id") or ref.get("response_id")
                gaps.append(
                    gap("model_call_reference_unmatched", detail, invocation["invocation_id"])
                )
    return gaps


_RECORD_KEYS = frozenset(
    {
        "schema_version",
        "task_id",
        "rollout_id",
        "invocations",
        "turns",
        "model_calls",
        "tool_calls",
        "gaps",
    }
)


def _record(
    task_id: int,
    rollout_id: str,
    invocations: list[JsonObject],
    turns: list[JsonObject],
    model_calls: list[JsonObject],
    tool_calls: list[JsonObject],
    gaps: list[JsonObject],
    extra: Mapping[str, Any] | None = None,
) -> JsonObject:
    return {
        **(extra or {}),
        "schema_version": SCHEMA_VERSION,
        "task_id": task_id,
        "rollout_id": rollout_id,
        "invocations": invocations,
        "turns": turns,
        "model_calls": model_calls,
        "tool_calls": tool_calls,
        "gaps": gaps,
    }


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "ng_trajectory"
    return f"{where}: {first['msg']}"


# --- joining refs to calls ---------------------------------------------------------------


def _model_name(model_ref: object) -> str | None:
    if isinstance(model_ref, str):
        return model_ref
    if isinstance(model_ref, Mapping) and isinstance(model_ref.get("name"), str):
        return str(model_ref["name"])
    return None


class CallIndex:
    """Finds the one call a ref names, by ``model_call_id`` or ``(model_ref, response_id)``."""

    def __init__(self, calls: Sequence[Mapping[str, Any]]) -> None:
        self._by_id: dict[str, list[int]] = {}
        self._by_response: dict[tuple[str, str], list[int]] = {}
        for position, call in enumerate(calls):
            if call.get("model_call_id"):
                self._by_id.setdefault(call["model_call_id"], []).append(position)
            name, response_id = _model_name(call.get("model_ref")), call.get("response_id")
            if name is not None and response_id:
                self._by_response.setdefault((name, response_id), []).append(position)

    def match(self, ref: Mapping[str, Any]) -> int | None:
        """Position of the matching call; None when no call or several calls match."""
        if ref.get("model_call_id"):
            candidates = self._by_id.get(ref["model_call_id"], [])
        else:
            name, response_id = _model_name(ref.get("model_ref")), ref.get("response_id")
            candidates = self._by_response.get((name or "", response_id or ""), [])
        return candidates[0] if len(candidates) == 1 else None


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
    for perf_key, call_key in _PERF_TOKEN_KEYS:
        values = [calls[p][call_key] for p in owned if calls[p].get(call_key) is not None]
        if values:
            perf[perf_key] = sum(values)
    perf["total_latency_ms"] = total_latency_ms
    return perf


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
