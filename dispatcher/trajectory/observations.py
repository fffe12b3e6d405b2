"""An agent's observation bundle (NeMo Gym's ``ng_agent_observations``), joined to the
captured model calls the way Gym joins it. Pure functions, no I/O.

A bundle (``{source, records, gaps}``) lists what a harness saw: agent invocations
(root agent and subagents), tool calls, and more. Its invocations name their
model calls by reference; a captured call may also name its invocation itself
(``client_session_id``, sent by the client as ``x-session-id``). The join:

- a captured call whose ``client_session_id`` is an invocation's id belongs to it;
- every reference must match exactly one captured call (``model_call_id``, or
  ``(model_ref, response_id)``), else ``model_call_reference_unmatched`` or
  ``..._ambiguous``; a call two invocations claim is ``..._conflict`` for the second;
- a captured call nobody owns is ``model_call_ownership_unavailable``: it stays
  evidence in ``model_calls`` but is not counted as the agent's.

The agent's own ``ng_agent_observations`` key is never rewritten: the join goes
into ``ng_trajectory`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from dispatcher.capture.records import CapturedCall, model_server_ref
from dispatcher.trajectory.build import Observed
from dispatcher.trajectory.schema import Gap, Invocation, ModelCallRef, ToolCall

INVALID = "agent_observations_invalid"
_RESOLVED_GAPS = {
    "model_call_reference_ambiguous",
    "model_call_reference_conflict",
    "model_call_reference_unmatched",
}


def observed_from(bundle: object, calls: Sequence[CapturedCall] | None) -> Observed | None:
    """The bundle's invocations and tool calls, joined to ``calls``; None without a bundle."""
    if bundle is None:
        return None
    try:
        observed = _parsed(bundle)
    except (ValidationError, ValueError, TypeError) as exc:
        detail = type(exc).__name__
        return Observed(invocations=[], tool_calls=[], gaps=[Gap(code=INVALID, detail=detail)])
    if calls is not None:
        _join(observed, calls)
    return observed


def _parsed(bundle: object) -> Observed:
    if not isinstance(bundle, dict) or not isinstance(bundle.get("records", []), list):
        raise TypeError("an observation bundle is an object with a records list")
    invocations: list[Invocation] = []
    tools: list[ToolCall] = []
    for record in bundle.get("records", []):
        kind = record.get("kind") if isinstance(record, dict) else None
        if kind == "agent_invocation":
            invocations.append(Invocation.model_validate(record))
        elif kind == "tool_call":
            tools.append(ToolCall.model_validate(record))
    ids = [invocation.invocation_id for invocation in invocations]
    if len(ids) != len(set(ids)):
        raise ValueError("invocation_id must be unique within an observation bundle")
    gaps = [Gap.model_validate(g) for g in bundle.get("gaps") or []]
    # Join gaps are recomputed here; stale ones from an earlier join would contradict them.
    gaps = [g for g in gaps if g.code not in _RESOLVED_GAPS]
    return Observed(invocations=invocations, tool_calls=tools, gaps=gaps)


def _join(observed: Observed, calls: Sequence[CapturedCall]) -> None:
    by_id = {invocation.invocation_id: invocation for invocation in observed.invocations}
    for call in calls:
        invocation = by_id.get(call.client_session_id or "")
        if invocation is not None and not any(
            _matches(ref, call) for ref in invocation.model_calls
        ):
            invocation.model_calls.append(_canonical(call))
    owner_of: dict[int, str] = {}
    for invocation in observed.invocations:
        invocation.model_calls = [
            _resolved(ref, invocation.invocation_id, calls, owner_of, observed.gaps)
            for ref in invocation.model_calls
        ]
    observed.gaps.extend(
        Gap(
            code="model_call_ownership_unavailable",
            detail=f"capture:{call.model_call_id}:call_index={call.call_index}",
        )
        for position, call in enumerate(calls)
        if position not in owner_of
    )


def _resolved(
    ref: ModelCallRef,
    invocation_id: str,
    calls: Sequence[CapturedCall],
    owner_of: dict[int, str],
    gaps: list[Gap],
) -> ModelCallRef:
    candidates = [position for position, call in enumerate(calls) if _matches(ref, call)]
    detail = ref.model_call_id or ref.response_id
    if len(candidates) != 1:
        code = "model_call_reference_ambiguous" if candidates else "model_call_reference_unmatched"
        gaps.append(Gap(code=code, invocation_id=invocation_id, detail=detail))
        return ref
    [position] = candidates
    if position in owner_of:
        gaps.append(
            Gap(code="model_call_reference_conflict", invocation_id=invocation_id, detail=detail)
        )
        return ref
    owner_of[position] = invocation_id
    return _canonical(calls[position])


def _matches(ref: ModelCallRef, call: CapturedCall) -> bool:
    server = model_server_ref(call.model_ref)
    same_server = ref.model_ref is None or ref.model_ref.model_dump() == server
    if ref.model_call_id:
        same_response = ref.response_id is None or ref.response_id == call.response_id
        return ref.model_call_id == call.model_call_id and same_server and same_response
    return ref.model_ref is not None and same_server and ref.response_id == call.response_id


def _canonical(call: CapturedCall) -> ModelCallRef:
    data: dict[str, Any] = {
        "model_call_id": call.model_call_id,
        "model_ref": model_server_ref(call.model_ref),
        "response_id": call.response_id,
    }
    return ModelCallRef.model_validate(data)
