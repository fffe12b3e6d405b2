"""The registry's final record (contracts §12): a job's end writes its manifest,
status, coverage and aggregate files without fsync, so saving its final record
makes them durable first; a final record read after a power cut then never
stands beside a torn file of its job."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from dispatcher.run.job_figures import end_files
from dispatcher.serve.registry import OUTPUT_FILE, JobRecord, Registry, now_iso
from dispatcher.serve.spec import STORED
from tests.serve.test_service_e2e import rows


def fsynced_paths(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of every file this process fsyncs, in order."""
    synced: list[str] = []
    real = os.fsync

    def recorded(fd: Any) -> None:
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", recorded)
    return synced


def test_the_final_record_is_saved_after_the_files_of_the_jobs_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = Registry(tmp_path / "state")
    registry.jobs_dir.mkdir(parents=True)
    spec = {"job_id": "j", "responses_create_params": {"input": "q"}}
    fields = {"spec": spec, "digest": "d", "submitted_seq": 1, "submitted_at": now_iso(),
              "rows_file": "input.jsonl"}  # fmt: skip
    record = JobRecord.model_validate(fields, context=STORED)
    registry.create(record, rows(1))
    # The end of its last hop, written without fsync.
    written = end_files(registry.job_dir("j") / OUTPUT_FILE)
    for path in written:
        path.write_bytes(b"{}")
    synced = fsynced_paths(monkeypatch)
    registry.save_final(record)
    # The job.json written last: its temporary file, then the folder.
    record_at = next(n for n, name in enumerate(synced) if name.startswith(".job.json"))
    before = set(synced[:record_at])
    assert {path.name for path in written} | {"input.jsonl"} <= before
    assert synced[record_at + 1 :] == ["j"]
