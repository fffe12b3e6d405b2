"""Our shapes checked by Gym 0.7.0's own models, without a running stack.

- every kind of ``ng_trajectory`` we build validates as Gym's ``TrajectoryRecord``;
- every sim-model answer validates as the OpenAI SDK's (or Anthropic's) response
  model and, where Gym has one, Gym's (``NeMoGymResponse``, ``NeMoGymChatCompletion``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from dispatcher.capture.proxy import build_proxy_app
from dispatcher.capture.records import CapturedCall, ToolCallRef, parse_record
from dispatcher.capture.store import capture_path
from dispatcher.capture.tokens import TokenCounts
from dispatcher.rows.capture import attach_capture
from dispatcher.sim.model import SimModelConfig, build_sim_model_app
from dispatcher.sim.model_client import DIALECT_PATHS, agent_trajectory, request_body
from dispatcher.trajectory.build import build_trajectory
from dispatcher.trajectory.observations import observed_from
from tests.gym.interpreter import GymInterpreter
from tests.helpers import serve

_TRAJECTORIES = """
import json, sys
from nemo_gym.rollout_observability import TrajectoryRecord
for line in open(sys.argv[1], "rb"):
    TrajectoryRecord.model_validate(json.loads(line))
print("ok")
"""

_ANSWERS = """
import json, sys
from anthropic.types import Message
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from nemo_gym.openai_utils import NeMoGymChatCompletion, NeMoGymResponse
models = {
    "chat": [ChatCompletion, NeMoGymChatCompletion],
    "responses": [Response, NeMoGymResponse],
    "completions": [Completion],
    "messages": [Message],
}
checked = 0
for line in open(sys.argv[1], "rb"):
    answer = json.loads(line)
    for model in models[answer["dialect"]]:
        model.model_validate(answer["body"])
        checked += 1
print(checked)
"""


def run_in_gym(interpreter: GymInterpreter, code: str, data: Path) -> str:
    result = interpreter.run(code, str(data))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


def call(call_id: str, *, status: int = 200, tools: int = 0) -> CapturedCall:
    ok = status < 400
    return CapturedCall(
        model_call_id=call_id,
        call_index=0,
        dialect="responses",
        model_ref="sim-model",
        request_model="sim-model",
        response_model="sim-model" if ok else None,
        response_id=f"resp_{call_id}" if ok else None,
        response_status="completed" if ok else None,
        finish_reason=None,
        client_session_id=None,
        started_at=1.5,
        completed_at=2.5,
        latency_ms=1000.0,
        latency_ttft_ms=3.0,
        status_code=status,
        error_category=None if ok else "upstream_http_error",
        tokens=TokenCounts(10, 5, 1, 2, 15) if ok else TokenCounts(),
        tool_calls=tuple(ToolCallRef(f"call_{i}", "sim_tool") for i in range(tools)),
        has_response=ok,
        payloads={"request": {"input": "q"}, "response": {"output": []}} if ok else None,
    )


def test_every_trajectory_we_build_is_a_gym_trajectory_record(
    gym_interpreter: GymInterpreter, tmp_path: Path
) -> None:
    calls = [call("a", tools=2), call("b", status=500), call("c")]
    own = agent_trajectory(
        task_id=0, rollout_id="0-0", responses=[{"id": "resp_a"}], model_ref="sim-model"
    )
    trajectories = [
        build_trajectory(task_id="0", rollout_id="0-0", calls=calls),
        build_trajectory(task_id="0", rollout_id="0-0", calls=[]),
        build_trajectory(task_id="0", rollout_id="0-0", calls=None, agent_trajectory=own),
        build_trajectory(task_id="0", rollout_id="0-0", calls=calls, agent_trajectory=own),
        build_trajectory(task_id="0", rollout_id="0-0", calls=calls, agent_trajectory={"x": 1}),
    ]
    data = tmp_path / "trajectories.jsonl"
    data.write_bytes(b"".join(orjson.dumps(t) + b"\n" for t in trajectories))

    assert run_in_gym(gym_interpreter, _TRAJECTORIES, data) == "ok"


@pytest.mark.parametrize("tool_calls", [0, 2])
async def test_every_sim_model_answer_passes_the_sdks_and_gyms_models(
    gym_interpreter: GymInterpreter, tmp_path: Path, tool_calls: int
) -> None:
    app = build_sim_model_app(SimModelConfig(tool_calls=tool_calls, reasoning_tokens=3))
    runner, url = await serve(app)
    answers = []
    try:
        async with aiohttp.ClientSession() as session:
            for dialect, path in DIALECT_PATHS.items():
                body = request_body(dialect, stream=False, prompt="question", model="sim-model")
                async with session.post(url + path, json=body) as response:
                    answers.append({"dialect": dialect, "body": await response.json()})
    finally:
        await runner.cleanup()
    data = tmp_path / "answers.jsonl"
    data.write_bytes(b"".join(orjson.dumps(a) + b"\n" for a in answers))

    assert run_in_gym(gym_interpreter, _ANSWERS, data) == "6"


_JOIN = """
import json, sys
from nemo_gym.base_responses_api_model import build_model_call_record
from nemo_gym.rollout_observability import AgentObservationBundle, join_model_call_observations
lines = [json.loads(line) for line in open(sys.argv[1], "rb") if line.strip()]
case = json.loads(lines[0])
calls = [build_model_call_record(record, call_index=i) for i, record in enumerate(lines[1:])]
joined = join_model_call_observations(AgentObservationBundle.model_validate(case), calls)
refs = {
    r.invocation_id: [ref.model_dump(mode="json") for ref in r.model_calls]
    for r in joined.records if r.kind == "agent_invocation"
}
gaps = sorted([g.code, g.invocation_id, g.detail] for g in joined.gaps)
print(json.dumps({"refs": refs, "gaps": gaps}))
"""


def test_observations_join_as_gyms_join_does(
    gym_interpreter: GymInterpreter, tmp_path: Path
) -> None:
    server = {"type": "responses_api_models", "name": "policy_model"}

    def record(call_id: str, session: str | None = None, response_id: str | None = None) -> Any:
        line = {
            "model_call_id": call_id,
            "dialect": "chat",
            "model_ref": server,
            "status_code": 200,
            "response": {"id": response_id or f"resp-{call_id}", "choices": []},
        }
        return line | ({"client_session_id": session} if session else {})

    records = [
        record("a", session="root"),
        record("b"),
        record("c", response_id="same"),
        record("d", response_id="same"),
        record("judge"),
    ]
    invocations = [
        {"invocation_id": "root", "model_calls": [{"model_call_id": "x"}]},
        {"invocation_id": "sub", "model_calls": [{"model_ref": server, "response_id": "resp-b"}]},
        {"invocation_id": "dup", "model_calls": [{"model_ref": server, "response_id": "same"}]},
        {"invocation_id": "thief", "model_calls": [{"model_call_id": "a"}]},
    ]
    case = {
        "source": "t",
        "records": [{"kind": "agent_invocation", **i} for i in invocations],
        "gaps": [],
    }
    data = tmp_path / "join.jsonl"
    data.write_bytes(orjson.dumps(orjson.dumps(case).decode()) + b"\n")
    data.write_bytes(data.read_bytes() + b"".join(orjson.dumps(r) + b"\n" for r in records))

    gyms = orjson.loads(run_in_gym(gym_interpreter, _JOIN, data))

    calls = [
        parse_record(orjson.dumps(r), call_index=i, include_payloads=False)
        for i, r in enumerate(records)
    ]
    observed = observed_from(case, [c for c in calls if c is not None])
    assert observed is not None
    ours = {
        "refs": {
            i.invocation_id: [ref.model_dump(mode="json") for ref in i.model_calls]
            for i in observed.invocations
        },
        "gaps": sorted([g.code, g.invocation_id, g.detail] for g in observed.gaps),
    }
    assert ours == gyms


_GYM_MERGE = """
import json, sys
from pathlib import Path
from nemo_gym.base_responses_api_model import merge_model_call_capture_into_record
record = {"_ng_task_index": 0, "_ng_rollout_index": 0}
merge_model_call_capture_into_record(record, [Path(sys.argv[1])])
print(json.dumps(record["ng_model_call_capture"]))
"""


@pytest.mark.parametrize("stream", [False, True])
async def test_gyms_collector_reads_our_proxys_capture_files(
    gym_interpreter: GymInterpreter, tmp_path: Path, stream: bool
) -> None:
    model, model_url = await serve(build_sim_model_app(SimModelConfig(reasoning_tokens=3)))
    proxy, proxy_url = await serve(build_proxy_app(model_url, tmp_path / "captures"))
    try:
        async with aiohttp.ClientSession() as session:
            for dialect, path in DIALECT_PATHS.items():
                body = request_body(dialect, stream=stream, prompt="q", model="sim-model")
                url = f"{proxy_url}/ng-rollout/0-0{path}"
                async with session.post(url, json=body) as response:
                    await response.read()
    finally:
        await proxy.cleanup()
        await model.cleanup()

    capture = orjson.loads(run_in_gym(gym_interpreter, _GYM_MERGE, tmp_path / "captures"))

    assert "gaps" not in capture, capture["gaps"]
    assert capture["metrics"]["num_calls"] == 4
    server = {"type": "responses_api_models", "name": "sim-model"}
    assert all(call["model_ref"] == server for call in capture["calls"])
    assert all(isinstance(call["started_at"], float) for call in capture["calls"])


_GYM_CALLS = """
import json, sys
from pathlib import Path
from nemo_gym.base_responses_api_model import merge_model_call_capture_into_record
record = {"_ng_task_index": 0, "_ng_rollout_index": 0}
merge_model_call_capture_into_record(record, [Path(sys.argv[1])])
print(json.dumps(record["ng_model_call_capture"]["calls"]))
"""

# Lines as Gym's own model servers write them: how the answer was made, and
# answers whose tool calls, reasoning and cache only Gym's fields carry.
_GYM_LINES = [
    {
        "model_call_id": "gym-local",
        "dialect": "chat",
        "model_ref": {"type": "responses_api_models", "name": "policy_model"},
        "client_session_id": "sess-1",
        "status_code": 200,
        "upstream_attempted": False,
        "response_source": "local",
        "local_response_reason": "cached_prefix",
        "started_at": 1.0,
        "completed_at": 2.0,
        "latency_ms": 1000.0,
        "response": {
            "id": "c1",
            "model": "m",
            "choices": [
                {
                    "finish_reason": "tool_calls",
                    "message": {
                        "role": "assistant",
                        "reasoning": "think",
                        "tool_calls": [
                            {"id": "t1", "function": {"name": "f", "arguments": '{"n": 1}'}},
                            {"id": "t2", "function": {"name": "g", "arguments": "not json"}},
                        ],
                    },
                }
            ],
            "usage": {"prompt_tokens": 9, "completion_tokens": 2, "cached_input_tokens": 0},
        },
    },
    {
        "model_call_id": "gym-messages",
        "dialect": "messages",
        "status_code": 200,
        "upstream_attempted": True,
        "response_source": "upstream",
        "upstream_status_code": 200,
        "response": {
            "id": "msg",
            "stop_reason": "tool_use",
            "content": [
                {"type": "thinking", "thinking": "hmm"},
                {"type": "tool_use", "id": "u1", "name": "h", "input": {"x": [1]}},
            ],
            "usage": {
                "input_tokens": 3,
                "output_tokens": 4,
                "cache_read_input_tokens": 5,
                "cache_creation_input_tokens": 6,
            },
        },
    },
]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_rows_calls_keep_every_field_of_gyms_model_call_records(
    gym_interpreter: GymInterpreter, tmp_path: Path, stream: bool
) -> None:
    """The same capture files read by Gym's collector and by ours: each call of ours
    has every key Gym's ``ModelCallRecord`` has, with Gym's value."""
    config = SimModelConfig(reasoning_tokens=3, tool_calls=2, prefix_cache_tokens=4096)
    model, model_url = await serve(build_sim_model_app(config))
    captures = tmp_path / "captures"
    proxy, proxy_url = await serve(build_proxy_app(model_url, captures))
    try:
        async with aiohttp.ClientSession() as session:
            for dialect, path in [*DIALECT_PATHS.items(), *DIALECT_PATHS.items()]:
                body = request_body(dialect, stream=stream, prompt="q", model="sim-model")
                url = f"{proxy_url}/ng-rollout/0-0{path}"
                async with session.post(url, json=body) as response:
                    await response.read()
    finally:
        await proxy.cleanup()
        await model.cleanup()
    with capture_path(captures, "0-0").open("ab") as lines:
        lines.write(b"".join(orjson.dumps(line) + b"\n" for line in _GYM_LINES))

    gyms = orjson.loads(run_in_gym(gym_interpreter, _GYM_CALLS, captures))
    row: dict[str, Any] = {"reward": 1.0}
    await attach_capture(
        row, capture_dir=captures, rollout_id="0-0", task_id=0, agent_result={},
        total_latency_ms=1.0,
    )  # fmt: skip
    ours = row["ng_model_call_capture"]["calls"]

    assert len(ours) == len(gyms) == 10
    for gym_call, our_call in zip(gyms, ours, strict=True):
        missing = sorted(set(gym_call) - set(our_call))
        assert not missing, (gym_call["model_call_id"], missing)
        differ = {k: (v, our_call[k]) for k, v in gym_call.items() if our_call[k] != v}
        assert not differ, (gym_call["model_call_id"], differ)
    # The answers had what these fields carry: they were compared with values in them.
    for key in ("tool_calls", "reasoning_content", "cache_hit", "response_source"):
        assert any(call[key] for call in gyms), key
