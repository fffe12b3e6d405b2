"""Gym's verdicts on our rows: its TrajectoryRecord model and `gym eval health-check`.

Both run in one process forked from the session's Gym interpreter
(``interpreter.py``), the health check through the `gym` CLI's own entry point.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.gym.conftest import GymStack

HEALTH = re.compile(
    r"Rollout health: (\d+) checked, (\d+) healthy, (\d+) unhealthy, (\d+) unobserved"
)
HEALTH_KEYS = ("checked", "healthy", "unhealthy", "unobserved")
VALIDATED = re.compile(r"^TrajectoryRecord accepted (\d+) rows$", re.MULTILINE)

# Validate every row's ng_trajectory, then hand over to the `gym` CLI's entry
# point with the argv the `gym` script would give it.
_CHECK = """
import json, sys
from nemo_gym.rollout_observability import TrajectoryRecord
from nemo_gym.cli.main import main
run_dir = sys.argv[1]
count = 0
for line in open(f"{run_dir}/rollouts.jsonl", "rb"):
    if line.strip():
        TrajectoryRecord.model_validate(json.loads(line)["ng_trajectory"])
        count += 1
print(f"TrajectoryRecord accepted {count} rows")
sys.argv = ["gym", "eval", "health-check", run_dir]
main()
"""


@dataclass(frozen=True)
class GymVerdicts:
    validated: int
    """How many rows Gym's TrajectoryRecord accepted; the check fails on the first it rejects."""
    health: dict[str, int]
    """`gym eval health-check` of the run directory, as counts."""


def gym_verdicts(stack: GymStack, run_dir: Path) -> GymVerdicts:
    """Gym's verdicts on ``run_dir/rollouts.jsonl``."""
    result = stack.python(_CHECK, str(run_dir))
    validated = VALIDATED.search(result.stdout)
    assert validated is not None, result.stderr[-3000:]
    health = HEALTH.search(result.stdout + result.stderr)
    assert health is not None, result.stdout[-3000:] + result.stderr[-3000:]
    counts = (int(count) for count in health.groups())
    return GymVerdicts(int(validated.group(1)), dict(zip(HEALTH_KEYS, counts, strict=True)))
