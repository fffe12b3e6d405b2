"""NeMo Gym's ``TrajectoryRecord`` (schema 1.0), mirrored as pydantic models.

Gym's schema forbids unknown keys, so every ``ng_trajectory`` we emit is built
from these models and a row never carries a key Gym's readers would refuse.
``build.py`` builds records from them; ``observations.py`` reads an
agent's own observations into them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SCHEMA_VERSION = "1.0"


class _Strict(BaseModel):
    # Gym's schema forbids unknown keys: a row we emit must not carry any.
    model_config = ConfigDict(extra="forbid")


class ModelServerRef(_Strict):
    type: Literal["responses_api_models"]
    name: str


class ModelCallRef(_Strict):
    model_call_id: str | None = None
    model_ref: ModelServerRef | None = None
    response_id: str | None = None

    @model_validator(mode="after")
    def _joinable(self) -> ModelCallRef:
        if not self.model_call_id and not (self.model_ref is not None and self.response_id):
            raise ValueError("model_call_id or both model_ref and response_id are required")
        return self


class TokenStats(_Strict):
    prompt_tokens: int | None = Field(default=None, ge=0)
    completion_tokens: int | None = Field(default=None, ge=0)
    reasoning_tokens: int | None = Field(default=None, ge=0)
    total_tokens: int | None = Field(default=None, ge=0)
    cached_tokens: int | None = Field(default=None, ge=0)


class ResponseMetadata(_Strict):
    response_id: str | None = None
    model_ref: ModelServerRef | None = None
    model: str | None = None
    dialect: str | None = None
    status_code: int | None = None
    response_status: str | None = None
    finish_reason: str | None = None
    upstream_attempted: bool | None = None
    response_source: Literal["upstream", "local"] | None = None
    upstream_status_code: int | None = None
    local_response_reason: str | None = None
    error_category: str | None = None
    latency_ttft_ms: float | None = Field(default=None, ge=0)


class TrajectoryModelCall(_Strict):
    model_call_id: str | None = None
    started_at: float | None = None
    completed_at: float | None = None
    duration_ms: float | None = Field(default=None, ge=0)
    request: Any = None
    response: Any = None
    response_metadata: ResponseMetadata = Field(default_factory=ResponseMetadata)
    token_stats: TokenStats = Field(default_factory=TokenStats)


class Turn(_Strict):
    invocation_id: str
    task_id: str
    rollout_id: str
    turn_no: int = Field(ge=1)
    timestamp: float
    question: Any = None
    answer: Any = None
    reasoning_content: Any = None
    resolved: bool | None = None
    step_count: int = Field(ge=0)
    model_calls: list[ModelCallRef] = Field(default_factory=list)


class Invocation(_Strict):
    kind: Literal["agent_invocation"] = "agent_invocation"
    invocation_id: str
    parent_invocation_id: str | None = None
    spawned_by_tool_call_id: str | None = None
    status: Literal["completed", "failed", "incomplete", "unknown"] = "unknown"
    duration_ms: float | None = Field(default=None, ge=0)
    error_type: str | None = None
    model_calls: list[ModelCallRef] = Field(default_factory=list)
    # Gym types these as Responses input items; we keep what the agent sent as it is.
    conversation: list[Any] = Field(default_factory=list)


class ToolCall(_Strict):
    kind: Literal["tool_call"] = "tool_call"
    invocation_id: str
    tool_call_id: str
    sandbox_id: str | None = None
    tool_name: str | None = None
    started_at: float | None = None
    completed_at: float | None = None
    duration_ms: float | None = Field(default=None, ge=0)
    timing_source: Literal["executor", "artifact", "harness"] | None = None
    status: Literal["completed", "failed", "timeout", "cancelled", "incomplete", "unknown"] = (
        "unknown"
    )
    error_type: str | None = None
    output: Any = None


class Gap(_Strict):
    code: str
    invocation_id: str | None = None
    detail: str | None = None


class TrajectoryRecord(_Strict):
    """NeMo Gym's ``TrajectoryRecord``: what an agent may send and what rows carry."""

    schema_version: Literal["1.0"] = "1.0"
    task_id: str
    rollout_id: str
    invocations: list[Invocation] = Field(default_factory=list)
    turns: list[Turn] = Field(default_factory=list)
    model_calls: list[TrajectoryModelCall] = Field(default_factory=list)
    tool_calls: list[ToolCall] = Field(default_factory=list)
    gaps: list[Gap] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> TrajectoryRecord:
        self.check_consistency()
        return self

    def check_consistency(self) -> None:
        """Gym's record-wide rules: unique invocations and calls, turns of this rollout."""
        ids = [invocation.invocation_id for invocation in self.invocations]
        if len(ids) != len(set(ids)):
            raise ValueError("invocation_id must be unique within a trajectory")
        call_ids = [call.model_call_id for call in self.model_calls if call.model_call_id]
        if len(call_ids) != len(set(call_ids)):
            raise ValueError("model_call_id must be unique within a trajectory")
        keys: set[tuple[str, int]] = set()
        for turn in self.turns:
            if turn.task_id != self.task_id or turn.rollout_id != self.rollout_id:
                raise ValueError("turn identity must match the trajectory")
            if (turn.invocation_id, turn.turn_no) in keys:
                raise ValueError("turn number must be unique within an invocation")
            keys.add((turn.invocation_id, turn.turn_no))
