"""ng_trajectory (built or adopted from the agent) and the ng_perf rules of A7."""

from __future__ import annotations

from typing import Any

from dispatcher.capture.records import CapturedCall, ToolCallRef
from dispatcher.capture.tokens import TokenCounts
from dispatcher.trajectory import build_trajectory, compute_perf

DEFAULT_TOKENS = TokenCounts(prompt=100, completion=10, cached=20, total=110)


def captured(
    call_id: str,
    *,
    response_id: str | None = None,
    tokens: TokenCounts = DEFAULT_TOKENS,
    tools: int = 0,
    status: int = 200,
) -> CapturedCall:
    return CapturedCall(
        model_call_id=call_id,
        dialect="chat",
        model_ref="policy",
        response_model="policy",
        response_id=response_id or f"resp-{call_id}",
        started_at=None,
        completed_at=None,
        latency_ms=5.0,
        latency_ttft_ms=None,
        status_code=status,
        error_category=None if status < 400 else "upstream_http_error",
        tokens=tokens,
        tool_calls=tuple(ToolCallRef(f"{call_id}-t{i}", "search") for i in range(tools)),
        has_response=status < 400,
    )


def codes(trajectory: dict[str, Any]) -> list[str]:
    return [gap["code"] for gap in trajectory["gaps"]]


def test_built_from_captures_one_invocation_turns_are_answered_calls() -> None:
    calls = [captured("a", tools=2), captured("b", status=500, tokens=TokenCounts()), captured("c")]

    trajectory = build_trajectory(task_id=3, rollout_id="3-0", calls=calls)

    assert (trajectory["schema_version"], trajectory["task_id"], trajectory["rollout_id"]) == (
        "1.0",
        3,
        "3-0",
    )
    (invocation,) = trajectory["invocations"]
    assert invocation["status"] == "completed"
    assert [ref["model_call_id"] for ref in invocation["model_calls"]] == ["a", "b", "c"]
    assert [(t["turn_no"], t["model_call"]["model_call_id"]) for t in trajectory["turns"]] == [
        (1, "a"),
        (2, "c"),
    ]
    assert [t["tool_call_id"] for t in trajectory["tool_calls"]] == ["a-t0", "a-t1"]
    assert [c["model_call_id"] for c in trajectory["model_calls"]] == ["a", "b", "c"]
    assert trajectory["gaps"] == []

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


def test_no_calls_no_invocation_no_perf() -> None:
    trajectory = build_trajectory(
        task_id=1, rollout_id="1-0", calls=[], capture_gaps=[{"code": "model_call_capture_pending"}]
    )
    assert trajectory["invocations"] == []
    assert codes(trajectory) == ["model_call_capture_pending"]
    assert compute_perf(trajectory, total_latency_ms=1.0) is None


def agent_sent(**overrides: Any) -> dict[str, Any]:
    sent: dict[str, Any] = {
        "schema_version": "1.0",
        "task_id": 3,
        "rollout_id": "3-0",
        "invocations": [
            {
                "invocation_id": "root",
                "status": "completed",
                "model_calls": [
                    {"model_ref": "policy", "response_id": "resp-a"},
                    {"model_call_id": "b"},
                ],
            }
        ],
        "turns": [
            {"invocation_id": "root", "turn_no": 1},
            {"invocation_id": "root", "turn_no": 2},
        ],
        "tool_calls": [{"invocation_id": "root", "tool_call_id": "t", "tool_name": "run"}],
        "gaps": [],
        "producer": "harness-x",
    }
    sent.update(overrides)
    return sent


def test_agent_trajectory_is_adopted_and_joined() -> None:
    trajectory = build_trajectory(
        task_id=3,
        rollout_id="3-0",
        calls=[captured("a"), captured("b")],
        agent_trajectory=agent_sent(),
    )

    assert trajectory["gaps"] == []
    assert trajectory["producer"] == "harness-x"
    assert trajectory["invocations"][0]["invocation_id"] == "root"
    perf = compute_perf(trajectory, total_latency_ms=9.0)
    assert perf is not None
    assert (perf["num_turns"], perf["num_tool_calls"], perf["prompt_tokens"]) == (2, 1, 200)
    assert perf["token_observability_coverage"] == 1.0


def test_identity_mismatch_is_a_gap_and_the_identity_is_restamped() -> None:
    trajectory = build_trajectory(
        task_id=3,
        rollout_id="3-0",
        calls=[captured("a"), captured("b")],
        agent_trajectory=agent_sent(task_id=9, rollout_id="9-9"),
    )

    assert (trajectory["task_id"], trajectory["rollout_id"]) == (3, "3-0")
    (gap,) = trajectory["gaps"]
    assert gap == {"code": "trajectory_identity_mismatch", "detail": "task_id=9 rollout_id='9-9'"}


def test_invalid_agent_trajectory_falls_back_to_captures_with_a_gap() -> None:
    broken = agent_sent(invocations=[{"invocation_id": "root", "model_calls": [{}]}])

    trajectory = build_trajectory(
        task_id=3, rollout_id="3-0", calls=[captured("a")], agent_trajectory=broken
    )

    assert codes(trajectory) == ["trajectory_invalid"]
    assert trajectory["invocations"][0]["invocation_id"] == "agent"
    assert len(trajectory["turns"]) == 1


def test_turn_for_an_unknown_invocation_is_invalid() -> None:
    broken = agent_sent(turns=[{"invocation_id": "ghost"}])
    trajectory = build_trajectory(task_id=3, rollout_id="3-0", calls=[], agent_trajectory=broken)
    assert codes(trajectory) == ["trajectory_invalid"]


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
        task_id=3, rollout_id="3-0", calls=[captured("a")], agent_trajectory=sent
    )
    perf = compute_perf(trajectory, total_latency_ms=1.0)

    assert perf is not None
    # root: 1 owned call; sub: 0 owned (a already counted) -> 1; idle -> 1.
    assert perf["num_turns"] == 3
    assert perf["prompt_tokens"] == 100
    assert perf["token_observability_coverage"] == 1 / 3
    assert {"code": "model_call_reference_unmatched", "invocation_id": "sub", "detail": "lost"} in (
        trajectory["gaps"]
    )


def test_perf_keys_present_only_when_some_call_reported_them() -> None:
    calls = [
        captured("a", tokens=TokenCounts(completion=4)),
        captured("b", tokens=TokenCounts(completion=6, reasoning=2)),
    ]
    perf = compute_perf(
        build_trajectory(task_id=0, rollout_id="0-0", calls=calls), total_latency_ms=3.0
    )

    assert perf is not None
    assert perf["completion_tokens"] == 10
    assert perf["reasoning_tokens"] == 2
    assert "prompt_tokens" not in perf and "cached_prompt_tokens" not in perf


def test_agent_reported_calls_not_captured_still_count() -> None:
    sent = agent_sent(
        invocations=[{"invocation_id": "root", "model_calls": [{"model_call_id": "remote"}]}],
        turns=[{"invocation_id": "root"}],
        tool_calls=[],
        model_calls=[{"model_call_id": "remote", "tokens_in": 11, "tokens_out": 2}],
    )

    trajectory = build_trajectory(task_id=3, rollout_id="3-0", calls=[], agent_trajectory=sent)
    perf = compute_perf(trajectory, total_latency_ms=1.0)

    assert trajectory["gaps"] == []
    assert perf is not None
    assert (perf["prompt_tokens"], perf["completion_tokens"]) == (11, 2)
    assert perf["token_observability_coverage"] == 1.0
