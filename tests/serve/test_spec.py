"""A job's body (``serve/spec.py``): the run settings it makes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from dispatcher.serve.spec import JobSpec
from dispatcher.settings.config import RunSettings


def validated(spec: JobSpec, base: RunSettings, tasks: Path, output: Path) -> RunSettings:
    """The settings as every field validated again makes them."""
    values = base.model_dump()
    values.update(input=tasks, output=output, shard=None, fresh=False)
    if spec.num_repeats is not None:
        values["num_repeats"] = spec.num_repeats
    if spec.default_agent is not None:
        values["default_agent"] = spec.default_agent
    if spec.max_attempts is not None:
        values.update(max_attempts=spec.max_attempts, extend_attempts=0)
    if spec.responses_create_params is not None:
        values["responses_create_params"] = {
            **base.responses_create_params,
            **spec.responses_create_params,
        }
    return RunSettings.model_validate(values)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"num_repeats": 8},
        {"default_agent": "b", "max_attempts": 1},
        {"responses_create_params": {"temperature": 0.5, "top_p": 1}},
    ],
)
def test_a_jobs_settings_are_the_daemons_with_its_own_fields(
    tmp_path: Path, body: dict[str, Any]
) -> None:
    base = RunSettings.model_validate({
        "input": tmp_path / "jobs", "output": tmp_path / "jobs" / "x.jsonl",
        "agents": {"a": ["http://h:1"], "b": ["http://h:2"]}, "max_attempts": 5,
        "extend_attempts": 2, "responses_create_params": {"temperature": 1.0},
    })  # fmt: skip
    before = base.model_dump()
    spec = JobSpec.model_validate({"rows": [{"x": 1}], **body})
    tasks, output = tmp_path / "j" / "input.jsonl", tmp_path / "j" / "rollouts.jsonl"
    made = spec.settings(base, tasks, output)
    assert made == validated(spec, base, tasks, output)
    assert isinstance(made.input, Path) and made.input == tasks
    # The daemon's own settings are left as they were.
    assert base.model_dump() == before


def test_a_job_whose_agent_the_daemon_does_not_have_is_refused_as_before(
    tmp_path: Path,
) -> None:
    base = RunSettings.model_validate({
        "input": tmp_path / "jobs", "output": tmp_path / "x.jsonl",
        "agents": {"a": ["http://h:1"]},
    })  # fmt: skip
    spec = JobSpec.model_validate({"rows": [{"x": 1}], "default_agent": "gone"})
    with pytest.raises(ValidationError, match="not among the agents"):
        spec.settings(base, tmp_path / "t.jsonl", tmp_path / "o.jsonl")
