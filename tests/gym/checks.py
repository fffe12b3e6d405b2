"""Gym's verdicts on our rows: its TrajectoryRecord model and `gym eval health-check`.

Both run in one Gym process for any number of run directories: the interpreter
and Gym's imports (about 6 s of `gym eval`'s start on 2 cores) are paid once.
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

# For each run directory: validate every row's ng_trajectory, then hand over to
# the `gym` CLI's own entry point with the argv the `gym` script would give it.
_CHECK = """
import json, sys
from nemo_gym.rollout_observability import TrajectoryRecord
from nemo_gym.cli.main import main
for run_dir in sys.argv[1:]:
    count = 0
    for line in open(f"{run_dir}/rollouts.jsonl", "rb"):
        if line.strip():
            TrajectoryRecord.model_validate(json.loads(line)["ng_trajectory"])
            count += 1
    print(f"TrajectoryRecord accepted {count} rows", flush=True)
    sys.argv = ["gym", "eval", "health-check", run_dir]
    main()
    sys.stdout.flush()
"""


@dataclass(frozen=True)
class GymVerdicts:
    validated: int
    """How many rows Gym's TrajectoryRecord accepted; the check fails on the first it rejects."""
    health: dict[str, int]
    """`gym eval health-check` of the run directory, as counts."""


def gym_verdicts(stack: GymStack, *run_dirs: Path) -> list[GymVerdicts]:
    """Gym's verdicts on each ``run_dir/rollouts.jsonl``, in order, from one Gym process."""
    result = stack.python(_CHECK, *(str(run_dir) for run_dir in run_dirs))
    # Both lines go to stdout, one pair per directory, in the order of run_dirs.
    validated = [int(count) for count in VALIDATED.findall(result.stdout)]
    health = [tuple(int(count) for count in found) for found in HEALTH.findall(result.stdout)]
    assert len(validated) == len(health) == len(run_dirs), (
        result.stdout[-3000:] + result.stderr[-3000:]
    )
    return [
        GymVerdicts(validated=count, health=dict(zip(HEALTH_KEYS, counts, strict=True)))
        for count, counts in zip(validated, health, strict=True)
    ]
