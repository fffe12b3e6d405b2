"""``--dispatch-budget-s auto``: the budget from a (faked) Slurm job end time."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from dispatcher.errors import ConfigError
from dispatcher.settings.walltime import resolve_budget_auto, squeue_end_time

NOW = 1_700_000_000.0


def no_squeue(job_id: str) -> str | None:
    raise AssertionError(f"squeue must not be asked (job {job_id})")


def test_end_time_from_environment() -> None:
    env = {"SLURM_JOB_END_TIME": str(int(NOW) + 3600), "SLURM_JOB_ID": "42"}
    assert resolve_budget_auto(env, reserve_s=300, now=NOW, squeue=no_squeue) == 3300.0


def test_end_time_from_squeue() -> None:
    asked: list[str] = []

    def squeue(job_id: str) -> str | None:
        asked.append(job_id)
        return "2030-01-02T03:04:05\n"

    end = datetime(2030, 1, 2, 3, 4, 5).timestamp()
    budget = resolve_budget_auto({"SLURM_JOB_ID": "77"}, reserve_s=60, now=NOW, squeue=squeue)
    assert asked == ["77"]
    assert budget == pytest.approx(end - NOW - 60)


def test_negative_budget_is_zero() -> None:
    env = {"SLURM_JOB_END_TIME": str(int(NOW) + 100)}
    assert resolve_budget_auto(env, reserve_s=300, now=NOW, squeue=no_squeue) == 0.0


@pytest.mark.parametrize(
    ("env", "answer", "message"),
    [
        ({}, None, "not inside a Slurm job"),
        ({"SLURM_JOB_ID": "5"}, None, "squeue could not report"),
        ({"SLURM_JOB_ID": "5"}, "N/A\n", "has no end time"),
        ({"SLURM_JOB_ID": "5"}, "", "has no end time"),
        ({"SLURM_JOB_ID": "5"}, "tomorrow", "cannot read"),
        ({"SLURM_JOB_END_TIME": "soon"}, None, "not epoch seconds"),
    ],
)
def test_no_end_time_is_a_clear_error(
    env: dict[str, str], answer: str | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_budget_auto(env, reserve_s=300, now=NOW, squeue=lambda _: answer)


def test_zero_end_time_falls_back_to_squeue() -> None:
    env = {"SLURM_JOB_END_TIME": "0", "SLURM_JOB_ID": "9"}
    budget = resolve_budget_auto(env, reserve_s=0, now=NOW, squeue=lambda _: "2030-01-01T00:00:00")
    assert budget == pytest.approx(datetime(2030, 1, 1).timestamp() - NOW)


def test_negative_reserve_is_rejected() -> None:
    with pytest.raises(ConfigError, match="budget-reserve-s"):
        resolve_budget_auto({"SLURM_JOB_END_TIME": "1"}, reserve_s=-1, now=NOW, squeue=no_squeue)


def test_squeue_absent_reports_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert squeue_end_time("1") is None


def test_squeue_is_asked_for_the_end_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "squeue"
    fake.write_text('#!/bin/sh\necho "args=$*"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert squeue_end_time("123") == "args=-h -j 123 -o %e\n"
