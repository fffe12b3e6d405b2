"""The start order: unseen first, a finished sibling's estimate, the starvation bound."""

from __future__ import annotations

import random

import pytest

from dispatcher.admission import order as order_module
from dispatcher.admission.history import TaskHistory
from dispatcher.admission.order import StartOrder, Waiting


def waiting(position: int, task: int, repeat: int = 0) -> Waiting:
    offset = position * 100
    return Waiting(position, offset, offset + 100, (task << 8) | repeat, task, f"d{task}")


def taken(order: StartOrder, count: int) -> list[int]:
    picks = [order.take() for _ in range(count)]
    return [p.position for p in picks if p is not None]


def test_unseen_tasks_start_first_then_the_longest_expected() -> None:
    history = TaskHistory(None)
    history.observe("d0", 1.0)
    history.observe("d1", 5.0)
    order = StartOrder(history)
    for position, task in enumerate([0, 1, 2, 3]):
        order.add(waiting(position, task))
    history.observe("d3", 3.0)  # too late for the task already added: it stays unseen
    assert taken(order, 5) == [2, 3, 1, 0]
    assert order.take() is None
    assert (order.unseen, order.estimated) == (2, 2)


def test_a_finished_sibling_sets_the_estimate_of_the_rest() -> None:
    order = StartOrder(TaskHistory(None))
    # Two tasks of three repeats each, in input order.
    for position in range(6):
        order.add(waiting(position, position // 3, position % 3))
    # The first repeat of each (unseen), then the other repeats while they run.
    assert taken(order, 3) == [0, 3, 1]
    order.finished((0 << 8) | 0, 0, 1.0)
    order.finished((1 << 8) | 0, 1, 4.0)
    # Task 1 is the longer one now: its repeats go before task 0's last one.
    assert taken(order, 3) == [4, 5, 2]
    # The error of a rollout started with an estimate: |ln(actual / expected)|.
    order.finished((1 << 8) | 1, 1, 4.0)
    assert order.median_error() == 0.0


def test_no_rollout_is_passed_by_a_window_of_later_ones() -> None:
    window = 4
    order = StartOrder(TaskHistory(None), window)
    history = order.history
    assert history is not None
    # Every task but the first is expected long: the first is never the longest.
    for task in range(1, 40):
        history.observe(f"d{task}", 10.0 + task)
    history.observe("d0", 0.1)
    started: list[int] = []
    position = 0
    while True:
        while position < 40 and position < order.admits_until():
            order.add(waiting(position, position))
            position += 1
        pick = order.take()
        if pick is None:
            break
        started.append(pick.position)
    assert sorted(started) == list(range(40))
    # Position 0 is passed by at most window - 1 later rollouts.
    assert started.index(0) <= window - 1
    for at, p in enumerate(started):
        later_before = sum(1 for q in started[:at] if q >= p + window)
        assert later_before == 0


class Rule:
    """What the order should do, by sorting what waits at each take: unseen tasks
    first, then probing ones, then the longest expected, each in input order."""

    def __init__(self, history: TaskHistory) -> None:
        self.history = history
        self.tasks: dict[int, tuple[float | None, bool, bool]] = {}  # estimate, probed, learned
        self.waits: dict[int, int] = {}  # position -> task

    def add(self, position: int, task: int) -> None:
        if task not in self.tasks:
            self.tasks[task] = (self.history.estimate(f"d{task}"), False, False)
        self.waits[position] = task

    def take(self) -> int:
        def rank(position: int) -> tuple[int, float, int]:
            estimate, probed, _ = self.tasks[self.waits[position]]
            if estimate is not None:
                return (2, -estimate, position)
            return (1 if probed else 0, 0.0, position)

        position = min(self.waits, key=rank)
        task = self.waits.pop(position)
        estimate, _, learned = self.tasks[task]
        self.tasks[task] = (estimate, True, learned)
        if learned and task not in self.waits.values():
            del self.tasks[task]  # nothing more to learn or order
        return position

    def finished(self, task: int, latency_s: float) -> None:
        if task not in self.tasks or self.tasks[task][2]:
            return
        self.tasks[task] = (latency_s, self.tasks[task][1], True)
        if task not in self.waits.values():
            del self.tasks[task]


def test_the_order_follows_its_rule_whatever_happens_between_takes() -> None:
    rng = random.Random(7)
    history = TaskHistory(None)
    for task in range(0, 60, 3):
        history.observe(f"d{task}", rng.choice([0.0, 0.5, 2.0, rng.random()]))
    order, rule = StartOrder(history, window=1 << 20), Rule(history)
    started: list[tuple[int, int]] = []  # key, task
    for position in range(400):
        # A few repeats in a row, now and then a task seen before.
        task = position // 3 if rng.random() < 0.8 else rng.randrange(60)
        rule.add(position, task)
        order.add(Waiting(position, position, position + 1, position, task, f"d{task}"))
        for _ in range(rng.randrange(3)):
            take_or_finish(order, rule, started, rng)
    while rule.waits:
        pick = order.take()
        assert pick is not None and pick.position == rule.take()
    assert order.take() is None


def take_or_finish(
    order: StartOrder, rule: Rule, started: list[tuple[int, int]], rng: random.Random
) -> None:
    """One step of a random run: start the next rollout (the order's pick is the
    rule's), or finish one started (``started``: key, task), with a random latency."""
    if rule.waits and rng.random() < 0.6:
        pick = order.take()
        assert pick is not None and pick.position == rule.take()
        started.append((pick.key, pick.task_index))
    elif started:
        key, done = started.pop(rng.randrange(len(started)))
        latency_s = rng.choice([0.1, 1.0, 3.0, rng.random()])
        rule.finished(done, latency_s)  # before the order moves the history on
        order.finished(key, done, latency_s)


def test_the_order_follows_its_rule_when_rollouts_come_in_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batches merged into the sorted entries, small ones and new ranks on the heap:
    taken together in one order."""
    monkeypatch.setattr(order_module, "_MERGED_BATCH", 4)
    rng = random.Random(11)
    history = TaskHistory(None)
    for task in range(0, 300, 2):
        history.observe(f"d{task}", rng.choice([0.5, 2.0, rng.random()]))
    order, rule = StartOrder(history, window=1 << 20), Rule(history)
    started: list[tuple[int, int]] = []  # key, task
    position = 0
    while position < 1500:
        batch = []
        for _ in range(rng.choice([1, 3, 8, 40, 120])):
            task = position // 3 if rng.random() < 0.8 else rng.randrange(300)
            rule.add(position, task)
            batch.append(Waiting(position, position, position + 1, position, task, f"d{task}"))
            position += 1
        order.add_all(batch)
        for _ in range(rng.randrange(2 * len(batch))):
            take_or_finish(order, rule, started, rng)
    while rule.waits:
        pick = order.take()
        assert pick is not None and pick.position == rule.take()
    assert order.take() is None


def test_positions_with_gaps_between_them_start_each_once() -> None:
    # Lines that were final are never added: the positions jump, and the window
    # is counted from the oldest waiting one.
    history = TaskHistory(None)
    history.observe("d1", 2.0)
    order = StartOrder(history, window=100)
    order.add_all([waiting(3, 0), waiting(4, 1), waiting(9, 2)])
    assert order.oldest_position() == 3 and order.admits_until() == 103
    assert taken(order, 3) == [3, 9, 4]
    # Nothing waits: the oldest is the next line not read.
    order.skip_to(5000)
    assert len(order) == 0 and order.oldest_position() == 5000
    # Far on, a task started long ago comes again; its first rollout's
    # entries must not bring back anything taken.
    order.add_all([waiting(5000 + i, i % 3) for i in range(6000)])
    got: list[int] = []
    while picks := order.take_many(500):
        got += [w.position for w in picks]
        left = set(range(5000, 11000)).difference(got)
        assert order.oldest_position() == min(left, default=11000)
    assert sorted(got) == list(range(5000, 11000))
    assert order.take() is None and order.oldest_position() == 11000


def test_a_task_kept_for_the_jobs_life_holds_no_place_of_each_rollout_started() -> None:
    # The service's order keeps a task for the whole job: what it holds of the
    # task's rollouts must not grow with every rollout it ever started.
    order = StartOrder(TaskHistory(None), whole_groups=True)
    for batch in range(10):
        order.add_all([waiting(batch * 100 + i, 0, i) for i in range(100)])
        assert len(order.take_many(100)) == 100
    assert order._tasks[0].positions == []
