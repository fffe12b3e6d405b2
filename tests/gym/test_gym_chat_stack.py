"""`dispatcher run` against Gym's simple_agent behind Gym's vllm_model (chat dialect):
the shared stack's ``string_match_simple_agent`` → ``policy_model``.

Gym's capture writes the capture files; our rows must satisfy Gym's own readers.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import orjson
import pytest

from tests.gym.checks import gym_verdicts
from tests.gym.conftest import GymStack, dispatcher_cmd
from tests.helpers import read_jsonl

MODEL_SERVER = "vllm_model"
PERF_TOKEN_KEYS = {"prompt_tokens", "cached_prompt_tokens", "completion_tokens", "reasoning_tokens"}


@pytest.fixture(scope="module")
def gyms_collection(gym_stack: GymStack, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gym's own collector's ``rollouts.jsonl`` for the tasks (``gym eval run``), collected
    once for the module: a test that changes its directory works on a copy."""
    output = tmp_path_factory.mktemp("gyms-collection") / "rollouts.jsonl"
    collected = gym_stack.gym_collect(output)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    return output


@pytest.fixture(scope="module")
def uncaptured_run(gym_stack: GymStack, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory of one ``dispatcher run`` without ``--capture-dir``, for the module's
    tests that read such a run. Gym's health check adds its reports to it; neither the
    module's tests nor ``gym eval compare`` read them."""
    run_dir = tmp_path_factory.mktemp("uncaptured-run")
    result = gym_stack.run(run_dir / "rollouts.jsonl")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_rows_with_gyms_capture_pass_gyms_validators(gym_stack: GymStack, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = gym_stack.run(
        run_dir / "rollouts.jsonl", "--capture-dir", str(gym_stack.gym_capture_dir)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(run_dir / "rollouts.jsonl")
    assert len(rows) == 10
    verdicts = gym_verdicts(gym_stack, run_dir)
    assert verdicts.validated == 10
    assert verdicts.health == {
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


def test_without_capture_no_row_is_unhealthy(gym_stack: GymStack, uncaptured_run: Path) -> None:
    verdicts = gym_verdicts(gym_stack, uncaptured_run)
    assert verdicts.validated == 10
    assert verdicts.health["checked"] == 10 and verdicts.health["unhealthy"] == 0
    for row in read_jsonl(uncaptured_run / "rollouts.jsonl"):
        codes = {gap["code"] for gap in row["ng_trajectory"]["gaps"]}
        assert "model_calls_unavailable" in codes
        assert "ng_perf" not in row


def test_capture_proxy_as_gyms_upstream_forwards_but_cannot_attribute(gym_stack: GymStack) -> None:
    # Gym's model servers call their upstream without /ng-rollout/<id>/ and with no
    # header naming the rollout, so the proxy there forwards every call and records none.
    captured = list(gym_stack.proxy_capture_dir.glob("*.capture.jsonl"))
    gym_files = list(gym_stack.gym_capture_dir.glob("*.capture.jsonl"))
    assert gym_files and not captured
    assert "model_call_not_captured" in (gym_stack.root / "proxy.log").read_text()


def test_aggregate_metrics_are_written_and_gym_compare_reads_them(
    gym_stack: GymStack, uncaptured_run: Path, gyms_collection: Path, tmp_path: Path
) -> None:
    ours, theirs = uncaptured_run / "rollouts.jsonl", gyms_collection

    [entry] = orjson.loads((uncaptured_run / "rollouts_aggregate_metrics.json").read_bytes())
    [gyms] = orjson.loads((theirs.parent / "rollouts_aggregate_metrics.json").read_bytes())
    assert entry["agent_ref"] == {"name": gym_stack.agent}
    assert entry.keys() >= {"agent_metrics", "key_metrics", "group_level_metrics"}
    # The same agent, tasks and (deterministic) model: the same metrics as Gym's own run.
    assert entry["key_metrics"] == gyms["key_metrics"]
    compared = gym_stack.gym(
        "eval", "compare", "--baseline", str(theirs), "--candidates", str(ours),
        "--output-dir", str(tmp_path / "compare"),
    )  # fmt: skip
    assert compared.returncode == 0, compared.stdout[-3000:] + compared.stderr[-3000:]


def test_a_gym_output_directory_is_adopted_on_resume(
    gym_stack: GymStack, gyms_collection: Path, tmp_path: Path
) -> None:
    shutil.copytree(gyms_collection.parent, tmp_path / "run")
    output = tmp_path / "run" / "rollouts.jsonl"
    gym_rows = read_jsonl(output)
    assert len(gym_rows) == 10 and not (tmp_path / "run" / "rollouts_manifest.json").exists()
    # Lose one row, as a Gym hop killed before writing it would.
    output.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in gym_rows[1:]))

    result = gym_stack.run(output, "--capture-dir", str(gym_stack.gym_capture_dir))

    assert result.returncode == 0, result.stderr[-3000:]
    assert '"event":"gym_output_adopted"' in result.stderr
    rows = read_jsonl(output)
    assert rows[:9] == gym_rows[1:]
    lost = (gym_rows[0]["_ng_task_index"], gym_rows[0]["_ng_rollout_index"])
    assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows[9:]] == [lost]


def test_rows_and_aggregate_name_the_environment_server_as_gyms_collector_does(
    gym_stack: GymStack, gyms_collection: Path, tmp_path: Path
) -> None:
    output = tmp_path / "run" / "rollouts.jsonl"
    args = ["run", "--input", str(gym_stack.tasks), "--output", str(output)]
    args += ["--gym-head-server", f"127.0.0.1:{gym_stack.head_port}"]
    args += ["--default-agent", gym_stack.agent, "--num-repeats", "2", "--metrics-listen", "off"]
    result = subprocess.run(dispatcher_cmd(*args), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    keys = ("_ng_environment_server", "_ng_result_type")
    ours = {tuple(row[k] for k in keys) for row in read_jsonl(output)}
    theirs = {tuple(row[k] for k in keys) for row in read_jsonl(gyms_collection)}
    assert ours == theirs and len(ours) == 1
    [entry] = orjson.loads(output.with_name("rollouts_aggregate_metrics.json").read_bytes())
    [gyms] = orjson.loads(gyms_collection.with_name("rollouts_aggregate_metrics.json").read_bytes())
    assert entry["_ng_environment_server"] == gyms["_ng_environment_server"]
