"""Gym's own verdicts on our rows: its TrajectoryRecord model and `gym eval health-check`."""

from __future__ import annotations

import re
from pathlib import Path

from tests.gym.conftest import GymStack

HEALTH = re.compile(
    r"Rollout health: (\d+) checked, (\d+) healthy, (\d+) unhealthy, (\d+) unobserved"
)

_VALIDATE = """
import json, sys
from nemo_gym.rollout_observability import TrajectoryRecord
count = 0
for line in open(sys.argv[1], "rb"):
    if line.strip():
        TrajectoryRecord.model_validate(json.loads(line)["ng_trajectory"])
        count += 1
print(count)
"""


def gym_validated_rows(stack: GymStack, rows: Path) -> int:
    """How many rows Gym's TrajectoryRecord accepts; fails on the first it rejects."""
    result = stack.python(_VALIDATE, str(rows))
    assert result.returncode == 0, result.stderr[-3000:]
    return int(result.stdout.strip())


def health_check(stack: GymStack, run_dir: Path) -> dict[str, int]:
    """`gym eval health-check` of a run directory, as counts."""
    result = stack.gym("eval", "health-check", str(run_dir))
    match = HEALTH.search(result.stdout + result.stderr)
    assert match is not None, result.stdout[-3000:] + result.stderr[-3000:]
    checked, healthy, unhealthy, unobserved = (int(group) for group in match.groups())
    return {
        "checked": checked,
        "healthy": healthy,
        "unhealthy": unhealthy,
        "unobserved": unobserved,
    }
