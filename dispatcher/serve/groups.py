"""Complete groups: tasks whose every repeat is final, in the order they completed.

A trainer that computes advantages per prompt group wants a group only once
all of its repeats are final (contracts §12, ``group=true``). ``Groups`` counts
each task's final rollouts; when a task's count reaches its repeats, one line
``{"task_index", "rows": [seq, ...], "failures": n}`` is appended to the job's
``groups.jsonl``. A group's ``_ng_seq`` on the stream is its line number
there, so ``after=`` resumes a group stream as exactly as a row stream.

The file is derived data: on open, groups that completed before a kill -9
but whose line was lost are appended again (in task order), so the order is
fixed once written and never changes. A damaged line (torn, garbage, not a
group) is never a reason to fail the job: the file is cut before it and the
rest rebuilt from the rows (the output, the failures sidecar and the
materialized inputs); the lines before it keep their numbers.

Durability (``durable``: an ``--fsync`` other than ``never``): a line is
written on the loop at once, but shown on the stream (its ``_ng_seq`` handed
out) and told to ``on_group`` only once an fsync covers it, so a power cut
cannot renumber what a consumer or the step's tally (saved in ``job.json``)
has seen. One fsync at a time runs in the loop's default executor, covering
every line written before it started; lines written meanwhile wait for the
next. On open, what is read back (the groups file, and the rows it is rebuilt
from: a kill may have left them in the page cache only) is fsynced before
anything is told; the rows were, before their line indexes were loaded
(``run/prepare.py``). An fsync that fails stops the job as a failed write does.

Step control (contracts §13): with a group filter, a complete group whose rows
the filter finds teach nothing is logged all the same, with
``"filtered": true``. Whoever counts groups (``step.py``) hears of every line
through ``on_group``, those of earlier daemons first (replayed on open, on
the loop), with its line number. With ``details`` (a target that reads them,
``policy.py``), a group line also names its agent and its rows' generated
tokens, so the tally is the same after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict

import structlog

from dispatcher.errors import OutputWriteError
from dispatcher.files.resume import RunState, repair_torn_tail
from dispatcher.files.writer import LineIndex
from dispatcher.outcome import Outcome
from dispatcher.rows.finalize import GENERATED_TOKENS, RESPONSE, TOKENS_SHAPES, generated_tokens
from dispatcher.serve.lines import BadLine, GroupLine, encode, read_group
from dispatcher.tasks.keys import AGENT_REF, FactsReader, line_key, materialized_key, task_of
from dispatcher.tasks.materialize import Rollout
from dispatcher.tasks.schema import PERF, REWARD

log = structlog.get_logger("dispatcher.serve")

# Whether a complete group's rewards make it one to filter out.
GroupFilter = Callable[[Sequence[Any]], bool]
# Told of each group line and its line number.
OnGroup = Callable[[GroupLine, int], None]


class _AgentRef(TypedDict, total=False):
    name: Any


# What a restart reads of the rows of groups not logged yet: the reward, the agent's
# name and the generated tokens; the agent's answer is skipped, not built.
_FACTS = FactsReader(
    (REWARD, AGENT_REF, PERF, RESPONSE), {AGENT_REF: _AgentRef | None, **TOKENS_SHAPES}
)


class Groups:
    """Counts final rollouts per task and logs each task once all its repeats are final."""

    def __init__(
        self,
        path: Path,
        on_error: Callable[[OutputWriteError], None] | None = None,
        group_filter: GroupFilter | None = None,
        on_group: OnGroup | None = None,
        details: bool = False,
        surplus: Callable[[str], bool] | None = None,
        durable: bool = False,
    ) -> None:
        self.path = path
        # A group line that cannot be written or fsynced: the owner stops the job, naming it.
        self._on_error = on_error
        self._filter = group_filter
        self._on_group = on_group
        self._details = details
        # Whether a kept group of an agent is surplus (its quota met), asked before its line.
        self._surplus = surplus
        # With details: each unlogged task's agent and its rows' generated tokens.
        self.agents: dict[int, str] = {}
        self.tokens: Counter[int] = Counter()
        self.expected: Counter[int] = Counter()
        self.final: Counter[int] = Counter()
        self.failures: Counter[int] = Counter()
        self.rows: defaultdict[int, list[int]] = defaultdict(list)
        # The rewards of each unlogged task's rows, for the filter.
        self.rewards: defaultdict[int, list[Any]] = defaultdict(list)
        self.logged: set[int] = set()
        # Read by ``load`` (in a thread), told to ``on_group`` by ``open`` (on the loop).
        self._read_back: list[tuple[GroupLine, int]] = []
        # Tasks the files show started (a final or failed attempt) but not complete.
        self.reopened: list[int] = []
        # When each group completed in this process (monotonic): its last row's
        # durable moment, which the stream's delay is measured from.
        self.completed_at: dict[int, float] = {}
        self.index = LineIndex()
        self._fd: int | None = None
        self._durable = durable
        # Lines written and not shown yet, in file order: each group and its line's bytes.
        self._unshown: list[tuple[GroupLine, int]] = []
        # The fsync in flight, one at most; the descriptor stays open until it returns.
        self._syncing: asyncio.Future[None] | None = None

    def load(self, materialized: Path, output: Path, state: RunState) -> list[int]:
        """Read back what earlier hops did (blocking); the complete tasks not yet logged."""
        with materialized.open("rb") as f:
            for line in f:
                self.expected[task_of(materialized_key(line))] += 1
        with output.open("rb") as f:
            for seq, line in enumerate(f, start=1):
                key = line_key(line)
                if key is not None:
                    self.rows[task_of(key)].append(seq)
                    self.final[task_of(key)] += 1
        started = {task_of(key) for key in state.failed_attempts} | set(self.rows)
        for key in state.failed_attempts:
            if state.is_final(key) and key not in state.successes:
                self.failures[task_of(key)] += 1
                self.final[task_of(key)] += 1
        repair_torn_tail(self.path)
        self._read_logged()
        self.index.load(self.path)
        self.reopened = sorted(t for t in started if not self._complete(t))
        if self._filter is not None or self._details:
            self._read_facts(output)
        return sorted(t for t in self.expected if self._complete(t) and t not in self.logged)

    def _read_facts(self, output: Path) -> None:
        """The rewards (and with details, agents and tokens) of the rows of groups not
        logged yet: only those rows are read, and of each only what is counted."""
        wanted = {
            seq: task for task, seqs in self.rows.items() if task not in self.logged for seq in seqs
        }
        if not wanted:
            return
        with output.open("rb") as f:
            for seq, line in enumerate(f, start=1):
                task = wanted.get(seq)
                if task is not None:
                    row = _FACTS.read(line) or {}
                    if self._filter is not None:
                        self.rewards[task].append(row.get(REWARD))
                    agent = row.get(AGENT_REF)
                    if isinstance(agent, dict) and isinstance(agent.get("name"), str):
                        self.agents[task] = agent["name"]
                    self.tokens[task] += generated_tokens(row) or 0

    def _read_logged(self) -> None:
        """The groups already logged, durable before ``open`` tells them (a kill may have
        left them in the page cache only); the file is cut at its first damaged line."""
        good = 0
        with self.path.open("ab+") as f:
            f.seek(0)
            for line_no, line in enumerate(f, start=1):
                group = self._group_of(line)
                if group is None:
                    log.warning("groups_rebuilt", path=str(self.path), damaged_line=line_no)
                    f.truncate(good)
                    break
                self.logged.add(group.task_index)
                self._read_back.append((group, line_no))
                good += len(line)
            if self._durable and good:
                os.fsync(f.fileno())

    def _group_of(self, line: bytes) -> GroupLine | None:
        """The group of a line that is whole and sound; None for a damaged one."""
        if not line.endswith(b"\n"):
            return None
        try:
            group = read_group(line)
        except BadLine:
            return None
        task = group.task_index
        if task in self.logged or not self._complete(task):
            return None
        return group

    async def open(self, missing: list[int]) -> None:
        """Tell ``on_group`` of the lines read back, then log the groups missing."""
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        read_back, self._read_back = self._read_back, []
        if self._on_group is not None:
            for group, seq in read_back:
                self._on_group(group, seq)
        for task in missing:
            if self._fd is not None:
                self._log(task)

    def on_final(
        self, rollout: Rollout, outcome: Outcome, seq: int | None, facts: Mapping[str, Any] | None
    ) -> None:
        """Count one final rollout (``Job``'s hook); log its group when it completes it."""
        task = rollout.task_index
        self.final[task] += 1
        if self._details:
            self.agents[task] = rollout.agent
        if outcome is Outcome.SUCCESS and seq is not None:
            self.rows[task].append(seq)
            if self._filter is not None:
                self.rewards[task].append((facts or {}).get("reward"))
            if self._details:
                self.tokens[task] += (facts or {}).get(GENERATED_TOKENS) or 0
        else:
            self.failures[task] += 1
        if self._complete(task) and task not in self.logged and self._fd is not None:
            self.completed_at[task] = time.monotonic()
            self._log(task)

    def _complete(self, task: int) -> bool:
        return self.final[task] >= self.expected[task] > 0

    def _log(self, task: int) -> None:
        """Append the group's line, here on the loop: one small write(2) to the page
        cache, shown at once without ``durable``, else once an fsync covers it."""
        assert self._fd is not None
        filtered = self._filter is not None and self._filter(self.rewards.pop(task, []))
        group = GroupLine(task, sorted(self.rows[task]), self.failures[task], filtered)
        if self._details:
            group.agent = self.agents.pop(task, None)
            group.tokens = self.tokens.pop(task, 0)
            if not filtered and self._surplus is not None and group.agent is not None:
                group.surplus = self._surplus(group.agent)
        line = encode(group)
        try:
            written = os.write(self._fd, line)
        except OSError as exc:
            self._refuse("write", exc)
            return
        if written != len(line):
            self._refuse("write", OSError(0, f"short write ({written} of {len(line)} bytes)"))
            return
        self.logged.add(task)
        self._unshown.append((group, len(line)))
        if not self._durable:
            self._show(1)
        elif self._syncing is None:
            self._sync()

    def _sync(self) -> None:
        """fsync the lines written so far, in a thread; they are shown when it returns."""
        assert self._fd is not None
        loop = asyncio.get_running_loop()
        self._syncing = loop.run_in_executor(None, os.fsync, self._fd)
        self._syncing.add_done_callback(
            functools.partial(self._synced, self._fd, len(self._unshown))
        )

    def _synced(self, fd: int, covered: int, done: asyncio.Future[None]) -> None:
        """An fsync returned: show the ``covered`` lines it made durable, then fsync the
        lines written meanwhile, if any."""
        self._syncing = None
        if self._fd is None:  # refused meanwhile: its lines are cut, the file is ours to close
            os.close(fd)
            return
        error = asyncio.CancelledError() if done.cancelled() else done.exception()
        if error is not None:
            self._refuse("fsync", error)
            return
        try:
            self._show(covered)
        except Exception as exc:  # a listener's bug, here in a callback: stop, not hang
            self._refuse("telling a group", exc)
            return
        if self._unshown and self._fd is not None:
            self._sync()

    def _show(self, count: int) -> None:
        """Show the first ``count`` lines not shown on the stream, and tell ``on_group``
        of each, in file order."""
        shown, self._unshown = self._unshown[:count], self._unshown[count:]
        seq = self.index.add(self.index.end, [length for _, length in shown])
        for group, _ in shown:
            if self._on_group is not None:
                self._on_group(group, seq)
            seq += 1

    def _refuse(self, what: str, exc: BaseException) -> None:
        """Cut what is not shown (a failed write's part, lines no fsync covered) and
        write no more: the next open rebuilds the rest. The owner stops the job."""
        assert self._fd is not None
        fd, self._fd = self._fd, None
        self._unshown.clear()
        with contextlib.suppress(OSError):
            os.ftruncate(fd, self.index.end)
        if self._syncing is None:
            os.close(fd)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        error = OutputWriteError(f"{self.path}: {what} failed: {reason}")
        log.error("groups_write_failed", path=str(self.path), error=str(error))
        if self._on_error is not None:
            self._on_error(error)

    async def flush(self) -> None:
        """Until every line written is shown (or the file refused)."""
        while self._syncing is not None:
            # Its done callback (``_synced``) runs before this wait's, and may start the next.
            await asyncio.wait([self._syncing])

    async def close(self) -> None:
        """Show what is written (its fsync awaited), then close."""
        await self.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
