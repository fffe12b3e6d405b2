"""Complete groups read back at a restart: the facts of the rows of groups whose line
was lost (reward, agent, generated tokens) are read from only the keys counted, and
equal what a parse of the whole row gave."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from dispatcher import jsonx
from dispatcher.files.resume import RunState
from dispatcher.rows.finalize import generated_tokens
from dispatcher.serve.groups import Groups
from dispatcher.sim.token_ids import add_to_chat, add_to_responses

PROMPT = b"what is two and two? " * 20


def responses_answer(usage: Any) -> dict[str, Any]:
    """A Responses answer with Gym's token ids and log-probs on its last output item."""
    answer: dict[str, Any] = {
        "id": "resp_1",
        "object": "response",
        "output": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
            {"type": "message", "role": "assistant", "content": [{"text": "four " * 40}]},
        ],
        "usage": usage,
    }
    add_to_responses(answer, PROMPT, 64)
    return answer


def chat_answer(usage: Any) -> dict[str, Any]:
    """A chat completion with vLLM's token ids and per-token log-probs."""
    answer: dict[str, Any] = {"choices": [{"message": {"content": "four"}}], "usage": usage}
    body = {"logprobs": True, "return_tokens_as_token_ids": True, "return_token_ids": True}
    add_to_chat(answer, body, PROMPT, 64)
    return answer


RESPONSES_USAGE = {"input_tokens": 105, "output_tokens": 64, "total_tokens": 169}
CHAT_USAGE = {"prompt_tokens": 105, "completion_tokens": 64, "total_tokens": 169}

# The rest of each row, past its identity: the shapes a row's reward, agent and
# tokens come in, and the token-id shapes around them.
ROWS: list[dict[str, Any]] = [
    {"reward": 1.0, "agent_ref": {"name": "a"}, "response": responses_answer(RESPONSES_USAGE)},
    {"reward": 0, "agent_ref": {"name": "b"}, "response": chat_answer(CHAT_USAGE)},
    {
        "reward": 0.5,
        "agent_ref": {"name": "a", "type": "responses_api_agents"},
        "response": responses_answer(RESPONSES_USAGE),
        "ng_perf": {"completion_tokens": 70, "prompt_tokens": 105, "total_latency_ms": 3.5},
    },
    {"reward": None, "response": responses_answer({"output_tokens": True})},
    {"response": chat_answer({"completion_tokens": -3, "output_tokens": 9})},
    {"reward": [1, 2], "response": responses_answer(None)},
    {"reward": 1, "response": responses_answer([1, 2])},
    {"agent_ref": None, "response": None, "ng_perf": None},
    {"agent_ref": "a", "response": "four", "ng_perf": [70]},
    {"agent_ref": {"name": 7}, "response": [responses_answer(RESPONSES_USAGE)]},
    {"ng_perf": {"completion_tokens": False}, "response": chat_answer(CHAT_USAGE)},
    {"ng_perf": {"completion_tokens": 2**70}, "reward": 2**70},
    {"response": responses_answer({"output_tokens": 2**70})},
    {"response": {"usage": {"output_tokens": 5.0}}, "reward": {"score": 1}},
]


def whole_row_facts(line: bytes) -> tuple[Any, str | None, int]:
    """What a restart read of a row when it parsed the whole row."""
    row = jsonx.loads(line)
    agent = row.get("agent_ref")
    name = agent["name"] if isinstance(agent, dict) and isinstance(agent.get("name"), str) else None
    return row.get("reward"), name, generated_tokens(row) or 0


def restart(tmp_path: Path, lines: list[bytes]) -> Groups:
    """A served job's files with one single-rollout task per line and no group logged,
    read back as a restarted daemon does."""
    materialized, output = tmp_path / "m.jsonl", tmp_path / "out.jsonl"
    materialized.write_text(
        "".join(f'{{"_ng_task_index":{t},"_ng_rollout_index":0}}\n' for t in range(len(lines)))
    )
    output.write_bytes(b"".join(lines))
    groups = Groups(tmp_path / "groups.jsonl", group_filter=lambda _: False, details=True)
    missing = groups.load(materialized, output, RunState(max_attempts=1))
    assert missing == list(range(len(lines)))
    return groups


def line_of(task: int, rest: dict[str, Any]) -> bytes:
    row = {"_ng_task_index": task, "_ng_rollout_index": 0, **rest}
    return jsonx.dumps(row, option=orjson.OPT_APPEND_NEWLINE)


def facts_of(groups: Groups, task: int) -> tuple[Any, str | None, int]:
    return groups.rewards[task][0], groups.agents.get(task), groups.tokens[task]


def test_the_facts_read_back_are_those_of_the_whole_row(tmp_path: Path) -> None:
    lines = [line_of(task, rest) for task, rest in enumerate(ROWS)]
    groups = restart(tmp_path, lines)
    for task, line in enumerate(lines):
        assert facts_of(groups, task) == whole_row_facts(line), ROWS[task]


@pytest.mark.parametrize(
    "other",
    [
        # Invalid UTF-8 in the agent's text, which a parse of the whole row refuses.
        b'"text":"caf\xe9"',
        # Megabytes of token ids.
        b'"token_ids":' + json.dumps(list(range(400_000))).encode(),
    ],
    ids=["refused-by-a-whole-parse", "big"],
)
def test_a_row_is_read_for_its_facts_whatever_the_rest_of_its_answer(
    tmp_path: Path, other: bytes
) -> None:
    line = (
        b'{"_ng_task_index":0,"_ng_rollout_index":0,"reward":1.0,"agent_ref":{"name":"a"},'
        b'"response":{"output":[{' + other + b'}],"usage":{"output_tokens":12}}}\n'
    )
    groups = restart(tmp_path, [line])
    assert facts_of(groups, 0) == (1.0, "a", 12)
