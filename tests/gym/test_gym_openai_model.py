"""Gym's openai_model server (Responses dialect) on our sim-model, Gym's capture on: the
shared stack's ``string_match_responses_agent`` → ``responses_policy_model``."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

from dispatcher.settings.gym_head import fetch_global_config, gym_agents
from tests.gym.checks import gym_verdicts
from tests.gym.conftest import RESPONSES_MODEL, GymStack, dispatcher_cmd
from tests.gym.dropin import (
    ask_directly,
    collect,
    head_server,
    served,
    unminted,
    without_dispatcher_keys,
)
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
        # The stack's second model server answered, under the name the fixture gave it.
        assert call["response_metadata"]["model_ref"] == {
            "type": "responses_api_models", "name": RESPONSES_MODEL
        }  # fmt: skip
        assert call["response_metadata"]["status_code"] == 200
    verdicts = gym_verdicts(gym_stack, run_dir)
    assert verdicts.validated == 10
    assert verdicts.health["healthy"] == 10


def test_run_takes_its_agents_from_gyms_head_server(gym_stack: GymStack, tmp_path: Path) -> None:
    output = tmp_path / "run" / "rollouts.jsonl"
    args = ["run", "--input", str(gym_stack.tasks), "--output", str(output)]
    args += ["--gym-head-server", head_server(gym_stack), "--default-agent", gym_stack.agent]
    args += ["--num-repeats", "2", "--metrics-listen", "off", "--log-format", "json"]
    result = subprocess.run(dispatcher_cmd(*args), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(output)
    assert len(rows) == 10 and all(row["reward"] in (0.0, 1.0) for row in rows)
    # As Gym's collector: /run goes to the environment server in front of the agent.
    [relay] = gym_agents(fetch_global_config(f"http://{head_server(gym_stack)}"))[gym_stack.agent]
    assert {row["_ng_dispatch"]["replica"] for row in rows} == {relay}
    assert relay != gym_stack.agent_url


def test_the_drop_in_answers_what_simple_agent_answers(gym_stack: GymStack, tmp_path: Path) -> None:
    agent_ref = {"name": gym_stack.agent}
    examples = [
        {**task, "agent_ref": agent_ref, "_ng_task_index": i, "_ng_rollout_index": 0}
        for i, task in enumerate(read_jsonl(gym_stack.tasks))
    ]
    with served(gym_stack, tmp_path / "state") as url:
        pairs = asyncio.run(collect(url, examples))
    assert sorted(examples.index(row) for row, _ in pairs) == list(range(len(examples)))
    [relay] = gym_agents(fetch_global_config(f"http://{head_server(gym_stack)}"))[gym_stack.agent]
    own = asyncio.run(ask_directly(relay, [row for row, _ in pairs]))
    for (row, result), answer in zip(pairs, own, strict=True):
        assert result["reward"] == answer["reward"], row
        assert unminted(result) == unminted(without_dispatcher_keys(answer))
        # Gym's simple_agent echoes none of the request's keys; its trajectory is
        # the one key the dispatcher rewrites (contracts §7).
        assert set(answer) - set(result) == {"ng_trajectory"}
