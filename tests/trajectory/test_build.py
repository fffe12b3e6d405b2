"""ng_trajectory (Gym's TrajectoryRecord, built or merged into the agent's) and ng_perf (§7)."""

from __future__ import annotations

from typing import Any

import pytest

from dispatcher.capture.records import CapturedCall, ToolCallRef
from dispatcher.capture.tokens import TokenCounts
from dispatcher.trajectory.build import build_trajectory, compute_perf, trajectory_task_id
from dispatcher.trajectory.schema import TrajectoryRecord

DEFAULT_TOKENS = TokenCounts(prompt=100, completion=10, cached=20, total=110)
GYM_REF = {"type": "responses_api_models", "name": "policy_model"}


def captured(
    call_id: str,
    *,
    response_id: str | None = None,
    tokens: TokenCounts = DEFAULT_TOKENS,
    tools: int = 0,
    status: int = 200,
    model_ref: str | dict[str, str] | None = "policy",
) -> CapturedCall:
    answered = status < 400
    response = {"choices": [{"message": {"role": "assistant", "content": "hi"}}]}
    return CapturedCall(
        model_call_id=call_id,
        call_index=0,
        dialect="chat",
        model_ref=model_ref,
        request_model="policy",
        response_model="policy",
        response_id=response_id or f"resp-{call_id}",
        response_status=None,
        finish_reason="stop",
        client_session_id=None,
        started_at=1_700_000_000.5,
        completed_at=1_700_000_001.0,
        latency_ms=5.0,
        latency_ttft_ms=None,
        status_code=status,
        error_category=None if answered else "upstream_http_error",
        tokens=tokens,
        tool_calls=tuple(ToolCallRef(f"{call_id}-t{i}", "search") for i in range(tools)),
        has_response=answered,
        payloads={"request": {"messages": []}, "response": response} if answered else None,
    )


def codes(trajectory: dict[str, Any]) -> list[str]:
    return [gap["code"] for gap in trajectory["gaps"]]


def valid(trajectory: dict[str, Any]) -> dict[str, Any]:
    TrajectoryRecord.model_validate(trajectory)
    return trajectory


def test_built_from_captures_one_invocation_turns_are_answered_calls() -> None:
    calls = [captured("a", tools=2), captured("b", status=500, tokens=TokenCounts()), captured("c")]

    trajectory = valid(build_trajectory(task_id="3", rollout_id="3-0", calls=calls))

    assert (trajectory["schema_version"], trajectory["task_id"], trajectory["rollout_id"]) == (
        "1.0",
        "3",
        "3-0",
    )
    (invocation,) = trajectory["invocations"]
    assert invocation["status"] == "completed"
    assert [ref["model_call_id"] for ref in invocation["model_calls"]] == ["a", "b", "c"]
    turns = trajectory["turns"]
    assert [(t["turn_no"], t["model_calls"][0]["model_call_id"]) for t in turns] == [
        (1, "a"),
        (2, "c"),
    ]
    # The answer is the model's message; step_count counts the tools asked for before.
    assert turns[0]["answer"] == {"role": "assistant", "content": "hi"}
    assert [t["step_count"] for t in turns] == [0, 2]
    assert [t["tool_call_id"] for t in trajectory["tool_calls"]] == ["a-t0", "a-t1"]
    assert [c["model_call_id"] for c in trajectory["model_calls"]] == ["a", "b", "c"]
    assert trajectory["model_calls"][0]["token_stats"]["prompt_tokens"] == 100
    assert trajectory["model_calls"][0]["response_metadata"]["model_ref"] == {
        "type": "responses_api_models",
        "name": "policy",
    }
    assert codes(trajectory) == ["conversation_unavailable"]

    perf = compute_perf(trajectory, total_latency_ms=250.0)

    assert perf == {
        "num_turns": 2,
        "num_tool_calls": 2,
        "token_observability_coverage": 1.0,
        "prompt_tokens": 200,
        "cached_prompt_tokens": 40,
        "completion_tokens": 20,
        "total_latency_ms": 250.0,
    }


def test_no_calls_no_invocation_no_perf_and_gyms_unavailable_gaps() -> None:
    trajectory = valid(
        build_trajectory(
            task_id="1",
            rollout_id="1-0",
            calls=[],
            capture_gaps=[{"code": "model_call_capture_pending"}],
        )
    )
    assert trajectory["invocations"] == []
    assert codes(trajectory) == [
        "model_call_capture_pending",
        "model_calls_unavailable",
        "turns_unavailable",
        "conversation_unavailable",
    ]
    assert compute_perf(trajectory, total_latency_ms=1.0) is None


def agent_sent(**overrides: Any) -> dict[str, Any]:
    """A trajectory as Gym's simple_agent sends one."""
    turn = {"invocation_id": "root", "task_id": "3", "rollout_id": "3-0", "timestamp": 1.0}
    sent: dict[str, Any] = {
        "schema_version": "1.0",
        "task_id": "3",
        "rollout_id": "3-0",
        "invocations": [
            {
                "invocation_id": "root",
                "status": "completed",
                "model_calls": [
                    {"model_ref": GYM_REF, "response_id": "resp-a"},
                    {"model_call_id": "b"},
                ],
                "conversation": [{"role": "user", "content": "q"}],
            }
        ],
        "turns": [
            {**turn, "turn_no": 1, "step_count": 0, "answer": "x"},
            {**turn, "turn_no": 2, "step_count": 1, "answer": "y"},
        ],
        "tool_calls": [{"invocation_id": "root", "tool_call_id": "t", "tool_name": "run"}],
        "gaps": [{"code": "resolution_unavailable", "invocation_id": "root"}],
    }
    sent.update(overrides)
    return sent


def test_agent_trajectory_is_kept_and_the_captures_merged_in() -> None:
    calls = [captured("a", model_ref=GYM_REF), captured("b", model_ref=GYM_REF)]
    sent = agent_sent()

    trajectory = valid(
        build_trajectory(task_id="3", rollout_id="3-0", calls=calls, agent_trajectory=sent)
    )

    # Nothing the agent said is lost or rewritten.
    kept = TrajectoryRecord.model_validate(sent).model_dump(mode="json")
    for key in ("invocations", "turns", "tool_calls"):
        assert trajectory[key] == kept[key]
    assert codes(trajectory) == ["resolution_unavailable"]
    assert [c["model_call_id"] for c in trajectory["model_calls"]] == ["a", "b"]
    perf = compute_perf(trajectory, total_latency_ms=9.0)
    assert perf is not None
    assert (perf["num_turns"], perf["num_tool_calls"], perf["prompt_tokens"]) == (2, 1, 200)
    assert perf["token_observability_coverage"] == 1.0


def test_a_ref_by_model_ref_needs_the_same_model_server() -> None:
    other = {"type": "responses_api_models", "name": "judge"}
    calls = [captured("a", model_ref=other), captured("b", model_ref=GYM_REF)]

    trajectory = build_trajectory(
        task_id="3", rollout_id="3-0", calls=calls, agent_trajectory=agent_sent()
    )
    perf = compute_perf(trajectory, total_latency_ms=9.0)

    assert perf is not None
    assert perf["token_observability_coverage"] == 0.5


def test_the_agents_model_calls_are_updated_with_what_capture_saw() -> None:
    reported = {
        "model_call_id": "b",
        "request": "agent's view",
        "token_stats": {"prompt_tokens": 1},
    }
    sent = agent_sent(model_calls=[reported])

    trajectory = valid(
        build_trajectory(
            task_id="3", rollout_id="3-0", calls=[captured("b")], agent_trajectory=sent
        )
    )

    [call] = trajectory["model_calls"]
    assert call["token_stats"]["prompt_tokens"] == 100
    assert call["response_metadata"]["status_code"] == 200
    # Without payloads capture has no request to say: the agent's own stays.
    assert call["request"] == "agent's view"


def test_payloads_in_model_calls_only_when_asked_turns_always_show_the_answer() -> None:
    lean = build_trajectory(task_id="3", rollout_id="3-0", calls=[captured("a")])
    full = build_trajectory(
        task_id="3", rollout_id="3-0", calls=[captured("a")], include_payloads=True
    )

    assert (lean["model_calls"][0]["request"], lean["model_calls"][0]["response"]) == (None, None)
    assert full["model_calls"][0]["request"] == {"messages": []}
    assert lean["turns"] == full["turns"]
    assert lean["turns"][0]["answer"] == {"role": "assistant", "content": "hi"}


def test_identity_mismatch_is_a_gap_and_the_identity_is_restamped() -> None:
    sent = agent_sent(task_id="9", rollout_id="9-9")
    for turn in sent["turns"]:
        turn.update(task_id="9", rollout_id="9-9")

    trajectory = valid(
        build_trajectory(task_id="3", rollout_id="3-0", calls=[], agent_trajectory=sent)
    )

    assert (trajectory["task_id"], trajectory["rollout_id"]) == ("3", "3-0")
    assert {(t["task_id"], t["rollout_id"]) for t in trajectory["turns"]} == {("3", "3-0")}
    assert trajectory["gaps"][1] == {
        "code": "producer_trajectory_identity_mismatch",
        "invocation_id": None,
        "detail": "task_id,rollout_id",
    }


@pytest.mark.parametrize(
    "broken",
    [
        {"invocations": [{"invocation_id": "root", "model_calls": [{}]}]},
        {"task_id": 3},
        {"producer": "harness-x"},
        {"turns": [{"invocation_id": "root"}]},
    ],
    ids=["ref-without-key", "int-task-id", "unknown-key", "turn-without-fields"],
)
def test_invalid_agent_trajectory_falls_back_to_captures_with_a_gap(
    broken: dict[str, Any],
) -> None:
    trajectory = valid(
        build_trajectory(
            task_id="3",
            rollout_id="3-0",
            calls=[captured("a")],
            agent_trajectory=agent_sent(**broken),
        )
    )

    assert codes(trajectory)[0] == "producer_trajectory_invalid"
    assert trajectory["invocations"][0]["invocation_id"] == "agent"
    assert len(trajectory["turns"]) == 1


def test_without_capture_the_agents_trajectory_says_its_calls_are_unavailable() -> None:
    trajectory = valid(
        build_trajectory(task_id="3", rollout_id="3-0", calls=None, agent_trajectory=agent_sent())
    )

    assert codes(trajectory) == ["resolution_unavailable", "model_calls_unavailable"]
    assert trajectory["model_calls"] == []


def test_perf_counts_each_physical_call_once_and_falls_back_for_turns() -> None:
    sent = agent_sent(
        invocations=[
            {"invocation_id": "root", "model_calls": [{"model_call_id": "a"}]},
            # Refers to the same physical call again, and to one nobody captured.
            {
                "invocation_id": "sub",
                "model_calls": [{"model_call_id": "a"}, {"model_call_id": "lost"}],
            },
            {"invocation_id": "idle", "model_calls": []},
        ],
        turns=[],
        tool_calls=[],
    )

    trajectory = build_trajectory(
        task_id="3", rollout_id="3-0", calls=[captured("a")], agent_trajectory=sent
    )
    perf = compute_perf(trajectory, total_latency_ms=1.0)

    assert perf is not None
    # root: 1 owned call; sub: 0 owned (a already counted) -> 1; idle -> 1.
    assert perf["num_turns"] == 3
    assert perf["prompt_tokens"] == 100
    assert perf["token_observability_coverage"] == 1 / 3


def test_perf_keys_present_only_when_some_call_reported_them() -> None:
    calls = [
        captured("a", tokens=TokenCounts(completion=4)),
        captured("b", tokens=TokenCounts(completion=6, reasoning=2)),
    ]
    perf = compute_perf(
        build_trajectory(task_id="0", rollout_id="0-0", calls=calls), total_latency_ms=3.0
    )

    assert perf is not None
    assert perf["completion_tokens"] == 10
    assert perf["reasoning_tokens"] == 2
    assert "prompt_tokens" not in perf and "cached_prompt_tokens" not in perf


def test_agent_reported_calls_not_captured_still_count() -> None:
    sent = agent_sent(
        invocations=[{"invocation_id": "root", "model_calls": [{"model_call_id": "remote"}]}],
        turns=[],
        tool_calls=[],
        gaps=[],
        model_calls=[
            {
                "model_call_id": "remote",
                "token_stats": {"prompt_tokens": 11, "completion_tokens": 2},
            }
        ],
    )

    trajectory = build_trajectory(task_id="3", rollout_id="3-0", calls=[], agent_trajectory=sent)
    perf = compute_perf(trajectory, total_latency_ms=1.0)

    assert codes(trajectory) == ["conversation_unavailable"]
    assert perf is not None
    assert (perf["prompt_tokens"], perf["completion_tokens"]) == (11, 2)
    assert perf["token_observability_coverage"] == 1.0


def test_task_id_is_the_rows_own_id_else_its_index() -> None:
    assert trajectory_task_id({"task_id": 7, "instance_id": "x"}, 3) == "7"
    assert trajectory_task_id({"instance_id": "django-1"}, 3) == "django-1"
    assert trajectory_task_id({}, 3) == "3"
