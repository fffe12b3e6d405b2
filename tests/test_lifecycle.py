"""States that only move forward (``dispatcher/lifecycle.py``): a job's, a run's phase,
and a rollout's stage in flight (contracts §10: an answered rollout's row is written)."""

from __future__ import annotations

import itertools

from dispatcher.lifecycle import JobState, Lifecycle, Phase, Stage


def test_a_stage_moves_forward_and_back_only_from_the_agent_to_waiting() -> None:
    for a, b in itertools.product(Stage, Stage):
        expected = b > a or (a is Stage.AT_AGENT and b is Stage.WAITING)
        assert a.may_move_to(b) is expected, (a, b)


def test_nothing_moves_back_from_answered() -> None:
    assert not any(Stage.ANSWERED.may_move_to(s) for s in (Stage.WAITING, Stage.AT_AGENT))


def test_a_jobs_first_final_state_stays() -> None:
    job = Lifecycle(JobState.QUEUED)
    assert job.advance(JobState.RUNNING) and job.advance(JobState.PACED) is False
    assert job.advance(JobState.SATISFIED)
    assert not job.advance(JobState.CANCELLED) and job.state is JobState.SATISFIED
    assert job.at_least(JobState.RUNNING) and job.state.final


def test_phases_move_in_their_declared_order() -> None:
    phases = list(Phase)
    run = Lifecycle(phases[0])
    for phase in phases[1:]:
        assert run.advance(phase) and not run.advance(phases[0])
