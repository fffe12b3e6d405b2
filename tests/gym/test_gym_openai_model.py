"""Gym's openai_model server (Responses dialect) on our sim-model, Gym's capture on."""

from __future__ import annotations

from pathlib import Path

from tests.gym.checks import gym_validated_rows, health_check
from tests.gym.conftest import GymStack
from tests.helpers import read_jsonl

MODEL_SERVER = "openai_model"


def test_gyms_openai_model_works_on_our_sim_model(gym_stack: GymStack, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = gym_stack.run(
        run_dir / "rollouts.jsonl", "--capture-dir", str(gym_stack.gym_capture_dir)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(run_dir / "rollouts.jsonl")
    assert len(rows) == 10
    assert not read_jsonl(run_dir / "rollouts_failures.jsonl")
    for row in rows:
        assert row["response"]["output"], row["response"]
        assert row["ng_perf"]["token_observability_coverage"] == 1.0
        call = row["ng_trajectory"]["model_calls"][0]
        assert call["response_metadata"]["dialect"] == "responses"
        assert call["response_metadata"]["status_code"] == 200
    assert gym_validated_rows(gym_stack, run_dir / "rollouts.jsonl") == 10
    assert health_check(gym_stack, run_dir)["healthy"] == 10
