"""Gym's openai_model server (Responses dialect) on our sim-model, Gym's capture on: the
shared stack's ``string_match_responses_agent`` → ``responses_policy_model``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
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


# A Gym trainer's loop as NeMo RL writes it; the two helpers differ in the import only.
TRAINER = """
import asyncio, json, sys
{import_line}

async def main():
    examples = json.loads(sys.argv[1])
    head = json.loads(sys.argv[2])
    helper = RolloutCollectionHelper()
    results = {{}}
    for future in helper.run_examples(examples, head_server_config=HEAD(**head)):
        row, result = await future
        results[row["_ng_task_index"]] = result["reward"]
    own = getattr(helper, "daemon", None)
    print(json.dumps({{"rewards": results, "daemon": own.process.pid if own else None}}))

asyncio.run(main())
"""
GYM_IMPORT = (
    "from nemo_gym.rollout_collection import RolloutCollectionHelper\n"
    "from nemo_gym.config_types import BaseServerConfig as HEAD"
)
DROP_IN_IMPORT = (
    "from dispatcher.client.gym import RolloutCollectionHelper\n"
    "from types import SimpleNamespace as HEAD"
)


def test_a_gym_trainer_runs_on_the_drop_in_by_its_import_alone(
    gym_stack: GymStack, tmp_path: Path
) -> None:
    """No URL: the drop-in starts a daemon of its own for the head server's agents,
    answers what Gym's own helper answers, and leaves no daemon behind."""
    agent_ref = {"name": gym_stack.agent}
    examples = [
        {**task, "agent_ref": agent_ref, "_ng_task_index": i, "_ng_rollout_index": 0}
        for i, task in enumerate(read_jsonl(gym_stack.tasks))
    ]
    args = [json.dumps(examples), json.dumps({"host": "127.0.0.1", "port": gym_stack.head_port})]
    gym = gym_stack.python(TRAINER.format(import_line=GYM_IMPORT), *args)
    assert gym.returncode == 0, gym.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k != "DISPATCHER_URL"}
    env["DISPATCHER_STATE"] = str(tmp_path / "state")
    ours = subprocess.run(
        [sys.executable, "-c", TRAINER.format(import_line=DROP_IN_IMPORT), *args],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert ours.returncode == 0, ours.stderr[-3000:]
    theirs, mine = json.loads(gym.stdout), json.loads(ours.stdout)
    assert len(mine["rewards"]) == len(examples)
    assert mine["rewards"] == theirs["rewards"]
    # Its daemon stopped with the trainer (atexit), its jobs in DISPATCHER_STATE.
    assert not Path(f"/proc/{mine['daemon']}").exists()
    assert len(list((tmp_path / "state" / "jobs").iterdir())) == 1
