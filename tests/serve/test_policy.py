"""Step-control policies without a daemon: per-agent quotas, the token target, the group
lines' details read back after a restart, the job body's fields. The daemon's behaviour
is in ``test_policy_e2e.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from dispatcher.files.resume import RunState
from dispatcher.rows.finalize import generated_tokens
from dispatcher.serve.groups import Groups
from dispatcher.serve.lines import GroupLine
from dispatcher.serve.policy import (
    AgentQuotas,
    GroupsTarget,
    InputOrder,
    Room,
    SettingsOrder,
    TokensTarget,
    policy_of,
)
from dispatcher.serve.spec import BadJob, JobSpec
from dispatcher.serve.step import HELD_TASKS, HeldAside, StepControl
from dispatcher.tasks.keys import line_key
from dispatcher.tasks.materialize import Rollout

AGENTS = {"fast": ["http://a"], "slow": ["http://b"]}


def group(task: int, agent: str | None = None, filtered: bool = False, tokens: int | None = None):
    return GroupLine(task, [], 0, filtered, agent=agent, tokens=tokens)


def test_quotas_start_each_agent_under_its_bound_and_skip_it_once_met() -> None:
    step = StepControl(AgentQuotas({"fast": 2, "slow": 1}))
    assert step.admits(0, "fast") is Room.START
    assert step.admits(1, "fast") is Room.START
    # The fast agent's room is used up: held aside, the slow one still starts.
    assert step.admits(2, "fast") is Room.DEFER
    assert step.admits(3, "slow") is Room.START
    assert step.admits(4, "slow") is Room.DEFER
    step.on_group(group(0, "fast", filtered=True), seq=1)
    assert step.admits(2, "fast") is Room.START  # a filtered group frees one place
    step.on_group(group(1, "fast"), seq=2)
    step.on_group(group(2, "fast"), seq=3)
    assert step.admits(5, "fast") is Room.SKIP  # its quota is met: never again
    assert not step.satisfied
    step.on_group(group(3, "slow"), seq=4)
    assert step.satisfied and step.satisfied_seq == 4
    figures = step.figures()
    assert figures["groups_kept_by_agent"] == {"fast": 2, "slow": 1}
    assert figures["target_groups_by_agent"] == {"fast": 2, "slow": 1}
    assert figures["target_groups"] == 3 and figures["groups_kept"] == 3


def test_a_group_beyond_its_agents_quota_is_surplus_not_kept() -> None:
    step = StepControl(AgentQuotas({"fast": 1, "slow": 1}, overprovision=2.0))
    assert [step.admits(t, "fast") for t in range(3)] == [Room.START] * 2 + [Room.DEFER]
    assert not step.surplus("fast")
    step.on_group(group(0, "fast"), seq=1)
    assert step.surplus("fast") and not step.surplus("slow")
    step.on_group(GroupLine(1, [], 0, agent="fast", surplus=True), seq=2)
    figures = step.figures()
    assert figures["groups_kept_by_agent"] == {"fast": 1, "slow": 0}
    assert figures["groups_surplus"] == 1 and not step.satisfied


def test_a_filtered_group_tells_its_agent_has_room() -> None:
    told: list[str] = []
    step = StepControl(AgentQuotas({"fast": 1}))
    step.on_room = told.append
    step.admits(0, "fast")
    step.on_group(group(0, "fast", filtered=True), seq=1)
    assert told == ["fast"]


def test_the_token_target_is_satisfied_by_the_group_that_crosses_it() -> None:
    step = StepControl(TokensTarget(250))
    for task in range(3):
        assert step.admits(task, "sim") is Room.START
    step.on_group(group(0, "sim", tokens=100), seq=1)
    step.on_group(group(1, "sim", filtered=True, tokens=500), seq=2)  # not kept: not counted
    step.on_group(group(2, "sim", tokens=100), seq=3)
    assert not step.satisfied
    step.on_group(group(3, "sim", tokens=100), seq=4)
    assert step.satisfied_seq == 4 and step.figures()["tokens_kept"] == 300
    assert step.figures()["target_tokens"] == 250


def test_held_aside_keeps_a_tasks_rollouts_together_and_a_bounded_number_of_tasks() -> None:
    held = HeldAside()

    def rollout(task: int, repeat: int) -> Rollout:
        return Rollout(task, repeat, 0, f"r{task}.{repeat}", "fast", {})

    for task in range(HELD_TASKS + 1):
        for repeat in range(2):
            held.add(rollout(task, repeat))
    assert [r.rollout_id for r in held.take("fast")] == ["r0.0", "r0.1"]
    assert held.take("slow") == []
    taken = [held.take("fast") for _ in range(HELD_TASKS)]
    assert taken[-1] == []  # the one past the bound was not held: the next hop reads it


def test_the_policy_of_a_body_and_its_default_ordering() -> None:
    plain = policy_of(JobSpec.parse(b'{"rows": [{}], "target_groups": 2}', AGENTS))
    assert plain.target == GroupsTarget(2) and not plain.needs_details
    assert isinstance(plain.ordering, SettingsOrder)
    assert InputOrder().start_order(None, None, True) is None  # type: ignore[arg-type]
    mixed = JobSpec.parse(b'{"rows": [{}], "target_groups_by_agent": {"fast": 1}}', AGENTS)
    assert policy_of(mixed).target == AgentQuotas({"fast": 1}) and policy_of(mixed).needs_details
    tokens = JobSpec.parse(b'{"rows": [{}], "target_tokens": 9, "group_filter": '
                           b'"nonzero_reward_std"}', AGENTS)  # fmt: skip
    policy = policy_of(tokens)
    assert policy.target == TokensTarget(9) and policy.group_filter is not None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('"target_groups": 2, "target_tokens": 5', "target_tokens: not with target_groups"),
        ('"target_groups_by_agent": {"fast": 0}', "target_groups_by_agent.fast:"),
        ('"target_groups_by_agent": {"nope": 1}', "target_groups_by_agent.nope: unknown agent"),
        ('"target_groups_by_agent": {"fast": true}', "target_groups_by_agent.fast:"),
        ('"target_groups_by_agent": {}', "target_groups_by_agent:"),
        ('"target_tokens": 0', "target_tokens:"),
        ('"target_tokens": 5, "overprovision": 2.0', "overprovision: only with target_groups"),
        ('"on_target": "cancel"', "on_target: only with a target"),
    ],
)
def test_bad_step_fields_are_one_line_naming_the_field(body: str, message: str) -> None:
    with pytest.raises(BadJob) as caught:
        JobSpec.parse(f'{{"rows": [{{}}], {body}}}'.encode(), AGENTS)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_generated_tokens_from_capture_else_the_agents_usage() -> None:
    assert generated_tokens({"ng_perf": {"completion_tokens": 7}, "response": {}}) == 7
    assert generated_tokens({"response": {"usage": {"output_tokens": 5}}}) == 5
    assert generated_tokens({"response": {"usage": {"completion_tokens": 3}}}) == 3
    assert generated_tokens({"response": {"id": "x"}}) is None
    assert generated_tokens({}) is None


async def test_group_lines_carry_agent_and_tokens_and_a_restart_counts_them_again(
    tmp_path: Path,
) -> None:
    """With details, a restarted daemon's tally is the one it had: by agent and tokens,
    from the group lines written and from the rows of groups whose line was lost."""
    materialized = tmp_path / "m.jsonl"
    output = tmp_path / "out.jsonl"
    groups_path = tmp_path / "groups.jsonl"
    materialized.write_text(
        "".join(f'{{"_ng_task_index": {t}, "_ng_rollout_index": 0}}\n' for t in range(2))
    )
    output.write_text(
        "".join(
            f'{{"_ng_task_index": {t}, "_ng_rollout_index": 0, "agent_ref": {{"name": '
            f'"{agent}"}}, "response": {{"usage": {{"output_tokens": 10}}}}}}\n'
            for t, agent in ((0, "fast"), (1, "slow"))
        )
    )
    groups_path.write_text(
        '{"task_index": 0, "rows": [1], "failures": 0, "agent": "fast", "tokens": 10}\n'
    )
    step = StepControl(AgentQuotas({"fast": 1, "slow": 1}))
    groups = Groups(groups_path, on_group=step.on_group, details=True)
    state = RunState(max_attempts=1)
    for line in output.read_bytes().splitlines(keepends=True):
        key = line_key(line)
        assert key is not None
        state.successes.add(key)
    missing = groups.load(materialized, output, state)
    assert missing == [1]
    await groups.open(missing)
    await groups.close()
    assert step.figures()["groups_kept_by_agent"] == {"fast": 1, "slow": 1}
    assert step.satisfied and step.tally.tokens == 20
    assert groups_path.read_text().splitlines()[1] == (
        '{"task_index":1,"rows":[2],"failures":0,"agent":"slow","tokens":10}'
    )
