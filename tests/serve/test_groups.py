"""Complete groups read back at a restart: the facts of the rows of groups whose line
was lost (reward, agent, generated tokens) are read from only the keys counted, and
equal what a parse of the whole row gave."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from dispatcher import jsonx
from dispatcher.errors import OutputWriteError
from dispatcher.files.resume import RunState
from dispatcher.outcome import Outcome
from dispatcher.rows.finalize import generated_tokens
from dispatcher.serve.groups import Groups
from dispatcher.serve.lines import GroupLine
from dispatcher.sim.token_ids import add_to_chat, add_to_responses
from dispatcher.tasks.materialize import Rollout
from tests.helpers import wait_until

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


# ---- durability (``durable``: ``--fsync`` batch or always) ------------------------------


class FsyncSpy:
    """``os.fsync`` watched: the names it was called on, the size of ``groups.jsonl`` each
    fsync of it covered once it returned; it waits for ``release`` or raises ``fail``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: OSError | None = None) -> None:
        self.names: list[str] = []
        self.covered: list[int] = []
        self.release = threading.Event()
        self.fail = fail
        real = os.fsync

        def fsync(fd: int) -> None:
            name = os.readlink(f"/proc/self/fd/{fd}")
            self.names.append(name)
            if not name.endswith("groups.jsonl"):
                return real(fd)
            size = os.fstat(fd).st_size
            if self.fail is not None:
                raise self.fail
            self.release.wait(30)
            real(fd)
            self.covered.append(size)

        monkeypatch.setattr(os, "fsync", fsync)

    def groups_synced(self) -> int:
        return sum(name.endswith("groups.jsonl") for name in self.names)


class Told:
    """What ``on_group`` was told: (task, seq), each checked to be durable by then."""

    def __init__(self, spy: FsyncSpy) -> None:
        self.spy = spy
        self.groups: Groups | None = None
        self.told: list[tuple[int, int]] = []
        self.errors: list[OutputWriteError] = []

    def __call__(self, group: GroupLine, seq: int) -> None:
        assert self.groups is not None
        # What the stream shows (the index) is covered by an fsync that returned.
        assert self.groups.index.end <= max(self.spy.covered, default=0)
        self.told.append((group.task_index, seq))


def task_files(tmp_path: Path, tasks: int) -> tuple[Path, Path]:
    """A hop's materialized file of ``tasks`` tasks of one repeat, and its output's path."""
    materialized, output = tmp_path / "m.jsonl", tmp_path / "out.jsonl"
    materialized.write_text(
        "".join(f'{{"_ng_task_index":{t},"_ng_rollout_index":0}}\n' for t in range(tasks))
    )
    return materialized, output


def fresh_job(
    tmp_path: Path, tasks: int, spy: FsyncSpy, *, durable: bool = True
) -> tuple[Told, Groups]:
    """A served job's groups as its first hop opens them, and what they tell."""
    materialized, output = task_files(tmp_path, tasks)
    output.touch()
    told = Told(spy)
    groups = Groups(
        tmp_path / "groups.jsonl", on_error=told.errors.append, on_group=told, durable=durable
    )
    told.groups = groups
    assert groups.load(materialized, output, RunState(max_attempts=1)) == []
    return told, groups


def complete(groups: Groups, task: int) -> None:
    """The task's one rollout is final: its row (line ``task + 1``) is durable."""
    rollout = Rollout(task, 0, 0, f"r{task}", "a", {})
    groups.on_final(rollout, Outcome.SUCCESS, task + 1, {})


async def test_a_group_is_shown_and_told_only_once_an_fsync_covering_its_line_returned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written at once, shown later: one fsync at a time, the lines written while it
    runs covered by the next, then shown in file order."""
    spy = FsyncSpy(monkeypatch)
    told, groups = fresh_job(tmp_path, 3, spy)
    await groups.open([])
    complete(groups, 0)
    await wait_until(lambda: spy.groups_synced() == 1)
    complete(groups, 1)
    complete(groups, 2)
    lines = groups.path.read_bytes().splitlines(keepends=True)
    assert len(lines) == 3
    assert len(groups.index) == 0 and told.told == [] and spy.groups_synced() == 1
    spy.release.set()
    await wait_until(lambda: len(told.told) == 3)
    assert told.told == [(0, 1), (1, 2), (2, 3)]
    assert spy.covered == [len(lines[0]), sum(map(len, lines))]
    await groups.close()
    assert told.errors == []


async def test_without_fsync_a_group_is_shown_and_told_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = FsyncSpy(monkeypatch)
    told, groups = fresh_job(tmp_path, 2, spy, durable=False)
    spy.covered.append(1 << 30)  # nothing is fsynced, nothing is waited for
    await groups.open([])
    complete(groups, 1)
    assert told.told == [(1, 1)] and len(groups.index) == 1
    await groups.close()
    assert spy.names == []


async def test_a_group_whose_fsync_fails_is_cut_and_stops_the_job_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = FsyncSpy(monkeypatch, fail=OSError(errno.EIO, os.strerror(errno.EIO)))
    told, groups = fresh_job(tmp_path, 2, spy)
    await groups.open([])
    complete(groups, 0)
    await wait_until(lambda: bool(told.errors))
    assert [str(e) for e in told.errors] == [f"{groups.path}: fsync failed: Input/output error"]
    # Never shown, and cut: the next open rebuilds it.
    assert told.told == [] and len(groups.index) == 0
    assert groups.path.read_bytes() == b""
    complete(groups, 1)
    assert groups.path.read_bytes() == b"" and spy.groups_synced() == 1
    await groups.close()


async def test_close_shows_the_lines_whose_fsync_is_in_flight_before_it_closes_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = FsyncSpy(monkeypatch)
    told, groups = fresh_job(tmp_path, 1, spy)
    await groups.open([])
    complete(groups, 0)
    await wait_until(lambda: spy.groups_synced() == 1)
    closing = asyncio.create_task(groups.close())
    spy.release.set()
    await closing
    # Its descriptor stayed open for the fsync (a closed one fails it: EBADF).
    assert told.told == [(0, 1)] and told.errors == []


async def test_groups_read_back_are_fsynced_before_any_is_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill may leave a line in the page cache only: what a restart reads back is
    made durable before its groups are told (the rows were when their index was
    loaded: ``tests/run/test_prepare.py``), and a group rebuilt from the rows is
    shown once its own fsync returned."""
    materialized, output = task_files(tmp_path, 2)
    output.write_bytes(line_of(0, {}) + line_of(1, {}))
    path = tmp_path / "groups.jsonl"
    path.write_bytes(b'{"task_index":0,"rows":[1],"failures":0}\n')
    spy = FsyncSpy(monkeypatch)
    spy.release.set()
    told = Told(spy)
    groups = Groups(path, on_error=told.errors.append, on_group=told, durable=True)
    told.groups = groups
    state = RunState(max_attempts=1)
    assert groups.load(materialized, output, state) == [1]
    assert spy.names == [str(path)]
    assert told.told == []
    await groups.open([1])
    assert told.told == [(0, 1)]
    await groups.close()
    assert told.told == [(0, 1), (1, 2)] and spy.groups_synced() == 2


async def test_a_listener_that_fails_on_a_durable_group_stops_the_job_rather_than_hangs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``on_group`` runs in the fsync's done callback there, where nobody awaits a crash."""
    spy = FsyncSpy(monkeypatch)
    spy.release.set()
    told, groups = fresh_job(tmp_path, 1, spy)

    def broken(group: GroupLine, seq: int) -> None:
        raise ValueError("a bug")

    groups._on_group = broken
    await groups.open([])
    complete(groups, 0)
    await groups.close()
    assert [str(e) for e in told.errors] == [f"{groups.path}: telling a group failed: a bug"]
