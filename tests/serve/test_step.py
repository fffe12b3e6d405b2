"""Step control's pieces without a daemon: the admission rule, the filter, the pause's TTL
on a fake clock. The daemon's behaviour is in ``test_step_control_e2e.py``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dispatcher.admission.pause import AdmissionPause
from dispatcher.admission.pool import Budget, RolloutPool
from dispatcher.files.resume import RunState
from dispatcher.serve.groups import Groups
from dispatcher.serve.lines import GroupLine
from dispatcher.serve.policy import GroupsTarget, Room, teaches_nothing
from dispatcher.serve.step import StepControl
from dispatcher.tasks.keys import line_key
from tests.helpers import wait_until


class FakeClock:
    """Seconds that move only when the test says; ``sleep_until`` wakes when they pass."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._moved = asyncio.Event()

    def now(self) -> float:
        return self.seconds

    async def sleep_until(self, deadline: float) -> None:
        while self.seconds < deadline:
            await self._moved.wait()

    def advance(self, seconds: float) -> None:
        self.seconds += seconds
        self._moved.set()
        self._moved = asyncio.Event()


def group(task: int, filtered: bool = False, **details: object) -> GroupLine:
    return GroupLine(task, [], 0, filtered, **details)  # type: ignore[arg-type]


START, WAIT = Room.START, Room.WAIT


def test_a_new_group_starts_only_under_the_bound_and_a_filtered_one_frees_one_place() -> None:
    step = StepControl(GroupsTarget(4, 1.5))  # ceil(6.0) = 6 places
    assert [step.admits(task) for task in range(7)] == [START] * 6 + [WAIT]
    assert step.admits(3) is START  # a repeat of an open group always starts
    step.on_group(group(0), seq=1)
    assert step.admits(6) is WAIT  # a kept group holds its place
    step.on_group(group(1, filtered=True), seq=2)
    assert step.admits(6) is START and step.admits(7) is WAIT  # one place, one group
    for seq, task in enumerate((2, 3, 4), start=3):
        step.on_group(group(task), seq=seq)
    assert step.satisfied and step.satisfied_seq == 5
    assert step.admits(5) is None  # satisfied: nothing starts, not even open groups
    assert step.figures()["groups_kept"] == 4 and step.figures()["groups_filtered"] == 1


def test_without_a_target_every_task_starts() -> None:
    step = StepControl(None)
    assert all(step.admits(task) is START for task in range(100))
    assert step.figures()["timeline"] is None


def test_the_timeline_marks_the_first_group_and_50_90_100_percent_of_the_target() -> None:
    now = [0.0]
    step = StepControl(GroupsTarget(10), clock=lambda: now[0])
    for kept in range(1, 11):
        now[0] = float(kept)
        step.on_group(group(kept), seq=kept)
    assert step.timeline == {"first_group_s": 1.0, "p50_s": 5.0, "p90_s": 9.0, "p100_s": 10.0}


def test_satisfaction_is_told_once_and_late_listeners_hear_of_it_at_once() -> None:
    heard: list[str] = []
    step = StepControl(GroupsTarget(1))
    step.when_satisfied(lambda: heard.append("early"))
    step.on_group(group(0), seq=1)
    step.on_group(group(1), seq=2)
    step.when_satisfied(lambda: heard.append("late"))
    assert heard == ["early", "late"] and step.satisfied_seq == 1


@pytest.mark.parametrize(
    ("rewards", "filtered"),
    [
        ([1.0, 1.0, 1.0], True),
        ([0, 0.0], True),
        ([None, None], True),
        ([1.0], True),
        ([], True),
        ([0.0, 1.0], False),
        ([None, 1.0], False),
        ([{"a": 1}, {"a": 2}], False),
    ],
)
def test_nonzero_reward_std_filters_groups_whose_rewards_are_all_equal(
    rewards: list[object], filtered: bool
) -> None:
    assert teaches_nothing(rewards) is filtered


async def test_groups_read_back_their_filtered_lines_and_the_rewards_of_open_tasks(
    tmp_path: Path,
) -> None:
    """A restarted daemon counts what its groups file says: kept, filtered, satisfied."""
    materialized = tmp_path / "m.jsonl"
    output = tmp_path / "out.jsonl"
    groups_path = tmp_path / "groups.jsonl"
    materialized.write_text(
        "".join(
            f'{{"_ng_task_index": {t}, "_ng_rollout_index": {r}}}\n'
            for t in range(3)
            for r in range(2)
        )
    )
    rewards = {(0, 0): 1.0, (0, 1): 1.0, (1, 0): 0.0, (1, 1): 1.0, (2, 0): 1.0}
    output.write_text(
        "".join(
            f'{{"_ng_task_index": {t}, "_ng_rollout_index": {r}, "reward": {v}}}\n'
            for (t, r), v in rewards.items()
        )
    )
    groups_path.write_text('{"task_index": 0, "rows": [1, 2], "failures": 0, "filtered": true}\n')
    step = StepControl(GroupsTarget(1))
    groups = Groups(groups_path, group_filter=teaches_nothing, on_group=step.on_group)
    state = RunState(max_attempts=1)
    for line in output.read_bytes().splitlines(keepends=True):
        key = line_key(line)
        assert key is not None
        state.successes.add(key)
    missing = groups.load(materialized, output, state)
    assert missing == [1] and groups.reopened == [2]
    step.reopen(groups.reopened)
    await groups.open(missing)
    await groups.close()
    assert step.filtered == 1 and step.kept == 1 and step.satisfied_seq == 2
    assert step.open == {2: ""} and groups.rewards[2] == [1.0]


async def test_the_pause_ends_by_itself_when_its_ttl_runs_out_on_a_fake_clock() -> None:
    clock = FakeClock()
    pause = AdmissionPause(clock)
    pause.pause(ttl_s=300.0, reason="update")
    assert pause.paused and pause.remaining_s() == 300.0
    clock.advance(299.0)
    await asyncio.sleep(0)
    assert pause.paused and pause.paused_seconds() == 299.0
    # Pausing again restarts the TTL from now.
    pause.pause(ttl_s=10.0)
    clock.advance(9.0)
    await asyncio.sleep(0)
    assert pause.paused and pause.pauses == 1
    clock.advance(1.0)
    await wait_until(lambda: not pause.paused)
    assert pause.paused_seconds() == 309.0 and pause.remaining_s() is None
    assert pause.resume("request") is False
    await pause.close()


async def test_a_rollout_that_won_its_slot_during_a_pause_gives_it_back() -> None:
    pause = AdmissionPause(FakeClock())
    pool = RolloutPool(1, Budget(None), lambda: None, pause=pause)
    held = await pool.admit("a")
    assert held is not None
    waiting = asyncio.create_task(pool.admit("a"))
    await wait_until(lambda: pool.slots is not None and pool.slots.waiting == 1)
    pause.pause(ttl_s=60.0)
    held.release()  # the waiter wins the slot, finds the pause, and gives it back
    await wait_until(lambda: pause.waiting == 1)
    assert not waiting.done() and pool.slots is not None and pool.slots.waiting == 0
    pause.resume("request")
    slots = await waiting
    assert slots is not None
    slots.release()
    await pause.close()
