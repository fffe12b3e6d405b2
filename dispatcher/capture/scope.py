"""Which captures belong to one attempt of one hop (contracts §6, issue: capture scope).

An agent that follows the protocol calls the model under the ``_ng_capture_id``
its body carries (``<rollout_id>.<hop token>``), so a request left running by
a killed hop writes under its own hop's id and never into the rerun's row.
An agent that ignores that key still calls under the plain rollout id (§2);
its captures are read as before, without that protection.
"""

from __future__ import annotations

from pathlib import Path

from dispatcher.capture.store import capture_path, claims_path, incomplete_path
from dispatcher.tasks.materialize import Rollout


def capture_key(capture_dir: Path, rollout: Rollout) -> str:
    """The id whose capture files are this attempt's (blocking: a few ``stat`` calls).

    A scoped call takes its claim before the agent sees any byte of the
    model's answer, so once the agent has answered, a scoped id it used has
    a claim, a capture file or an ``.incomplete`` marker.
    """
    scoped = rollout.capture_id
    if scoped is None:
        return rollout.rollout_id
    paths = (capture_path, incomplete_path, claims_path)
    if any(path(capture_dir, scoped).exists() for path in paths):
        return scoped
    return rollout.rollout_id
