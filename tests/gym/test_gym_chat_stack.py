"""`dispatcher run` against Gym's simple_agent behind Gym's vllm_model (chat dialect).

Gym's capture writes the capture files; our rows must satisfy Gym's own readers.
"""

from __future__ import annotations

from pathlib import Path

from tests.gym.checks import gym_validated_rows, health_check
from tests.gym.conftest import GymStack
from tests.helpers import read_jsonl

MODEL_SERVER = "vllm_model"
PERF_TOKEN_KEYS = {"prompt_tokens", "cached_prompt_tokens", "completion_tokens", "reasoning_tokens"}


def test_rows_with_gyms_capture_pass_gyms_validators(gym_stack: GymStack, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = gym_stack.run(
        run_dir / "rollouts.jsonl", "--capture-dir", str(gym_stack.gym_capture_dir)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(run_dir / "rollouts.jsonl")
    assert len(rows) == 10
    assert gym_validated_rows(gym_stack, run_dir / "rollouts.jsonl") == 10
    assert health_check(gym_stack, run_dir) == {
        "checked": 10, "healthy": 10, "unhealthy": 0, "unobserved": 0
    }  # fmt: skip
    for row in rows:
        perf = row["ng_perf"]
        assert perf["token_observability_coverage"] == 1.0
        assert perf.keys() >= PERF_TOKEN_KEYS
        # Gym's model server names itself in model_ref; the join used it.
        call = row["ng_trajectory"]["model_calls"][0]
        assert call["response_metadata"]["model_ref"] == {
            "type": "responses_api_models", "name": "policy_model"
        }  # fmt: skip
        assert isinstance(call["started_at"], float)
        gaps = {gap["code"] for gap in row["ng_trajectory"]["gaps"]}
        assert not gaps & {
            "model_call_reference_unmatched",
            "producer_trajectory_identity_mismatch",
        }


def test_without_capture_no_row_is_unhealthy(gym_stack: GymStack, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = gym_stack.run(run_dir / "rollouts.jsonl")
    assert result.returncode == 0, result.stderr[-3000:]
    assert gym_validated_rows(gym_stack, run_dir / "rollouts.jsonl") == 10
    verdicts = health_check(gym_stack, run_dir)
    assert verdicts["checked"] == 10 and verdicts["unhealthy"] == 0
    for row in read_jsonl(run_dir / "rollouts.jsonl"):
        codes = {gap["code"] for gap in row["ng_trajectory"]["gaps"]}
        assert "model_calls_unavailable" in codes
        assert "ng_perf" not in row


def test_capture_proxy_as_gyms_upstream_forwards_but_cannot_attribute(gym_stack: GymStack) -> None:
    # Gym's model servers call their upstream without /ng-rollout/<id>/ and with no
    # header naming the rollout, so the proxy there forwards every call and records none.
    captured = list(gym_stack.proxy_capture_dir.glob("*.capture.jsonl"))
    gym_files = list(gym_stack.gym_capture_dir.glob("*.capture.jsonl"))
    assert gym_files and not captured
