"""A NeMo Gym user's habits at the real command line get a pointer to the flag meant."""

from __future__ import annotations

import pytest

from tests.helpers import run_cli


@pytest.mark.parametrize(
    ("words", "hint"),
    [
        (["--resume"], "(a rerun of the same command resumes by itself; --fresh starts over)"),
        (
            ["--temperature", "0.5"],
            """(--responses-create-params '{"temperature": 0.5}' sets it on every request)""",
        ),
        (
            ["+responses_create_params.max_output_tokens=512"],
            """(--responses-create-params '{"max_output_tokens": 512}' sets it on every request)""",
        ),
        (["+num_repeats=4"], "(here: --num-repeats 4)"),
        (["+input_jsonl_fpath=tasks.jsonl"], "(here: --input tasks.jsonl)"),
        (["--num-samples-in-parallel", "8"], "(here: --concurrency N)"),
    ],
)
async def test_a_gym_habit_is_pointed_to_the_flag_meant(words: list[str], hint: str) -> None:
    result = await run_cli("run", *words)
    assert result.returncode == 2
    last = result.stderr.splitlines()[-1]
    assert last.endswith(hint), last
    assert "did you mean" not in last


async def test_agent_without_a_url_points_to_default_agent() -> None:
    result = await run_cli("run", "--input", "t.jsonl", "--output", "o.jsonl", "--agent", "sim")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        "error: --agent 'sim': expected NAME=URL[,URL...]"
        " (--default-agent sim picks the agent of rows without agent_ref)"
    )
