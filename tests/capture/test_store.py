"""Claims under contention: writers of one rollout take and release claims at once."""

from __future__ import annotations

import threading
from pathlib import Path

from dispatcher.capture.store import claims_path, create_claim, has_claims, release_claim


def test_claims_of_one_rollout_taken_and_released_concurrently_never_fail(
    tmp_path: Path,
) -> None:
    # A release removes the rollout's claims directory with its last claim,
    # while another writer is creating it: each create must still succeed.
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        for i in range(500):
            try:
                release_claim(create_claim(tmp_path, "9-2", f"w{n}.{i}.claim"))
            except BaseException as exc:
                errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert not has_claims(tmp_path, "9-2")
    assert not claims_path(tmp_path, "9-2").exists()
