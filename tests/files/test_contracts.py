"""The JSON contracts several modules read (contracts.py): manifest, last run, failure keys."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orjson
import pytest

from dispatcher.delivery.client import Failure
from dispatcher.errors import ConfigError
from dispatcher.files.atomic import read_manifest, write_json_atomic, write_manifest
from dispatcher.files.contracts import (
    FAILURE_KEYS,
    HISTORY_HOPS,
    NOT_DELIVERED,
    JobStatus,
    LastRun,
    RunManifest,
)
from dispatcher.files.delivery_history import HopDelivery, summarize
from dispatcher.lifecycle import JobState
from dispatcher.ops.runfiles import read_manifest as read_for_status
from dispatcher.run.prepare import prepare_run
from dispatcher.settings.config import load_settings
from tests.helpers import write_tasks

# What a run writes (prepare, then the service at the end of a hop), plus keys
# this version does not know, at the top and inside ``last_run``.
WRITTEN: dict[str, Any] = {
    "run_id": "0f" * 16,
    "created_at": "2026-01-01T00:00:00Z",
    "hops": 2,
    "hop_started_at": "2026-01-01T01:00:00Z",
    "dispatcher_version": "0.1.0",
    "input": "tasks.jsonl",
    "input_rows": 3,
    "input_digest": "a" * 64,
    "materialized_digest": "b" * 64,
    "task_settings": {"num_repeats": {"a": 2, "_default": 1}, "limit": None},
    "task_settings_digest": "c" * 64,
    "max_attempts": 3,
    "rollout_timeout_s": 30,
    "tasks": 3,
    "rollouts": 6,
    "rollouts_by_agent": {"a": 6},
    "metrics_url": "http://127.0.0.1:9100/metrics",
    "delivery_history": [{"finished_at": "2026-01-01T00:30:00Z", "retries": {}}],
    "last_run": {
        "finished_at": "2026-01-01T00:30:00Z",
        "exit_code": 75,
        "drained": 1,
        "cancelled": 0,
        "kill_shaped": 2,
        "summary": {"median_s": 1.5, "drained": 1},
        "from_a_newer_version": [1, 2],
    },
    "from_a_newer_version": {"x": 1},
}


def test_a_manifest_survives_a_read_and_a_write_byte_for_byte(tmp_path: Path) -> None:
    original, again = tmp_path / "a.json", tmp_path / "b.json"
    write_json_atomic(original, WRITTEN)
    manifest = read_manifest(original)
    assert manifest is not None
    write_manifest(again, manifest)
    assert again.read_bytes() == original.read_bytes()
    assert manifest.last_run is not None and manifest.last_run.kill_shaped == 2


def test_absent_keys_stay_absent() -> None:
    assert RunManifest.parse({"run_id": "r"}).to_json() == {"run_id": "r"}
    assert RunManifest.parse({"rollout_timeout_s": None}).to_json() == {"rollout_timeout_s": None}


def test_a_bad_value_stops_a_resume_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "x_manifest.json"
    path.write_bytes(orjson.dumps({**WRITTEN, "hops": "two"}))
    with pytest.raises(ConfigError, match=r"x_manifest.json: manifest key 'hops'"):
        read_manifest(path)


def test_read_only_tools_read_a_bad_value_as_absent(tmp_path: Path) -> None:
    path = tmp_path / "x_manifest.json"
    last = {**WRITTEN["last_run"], "drained": -1, "exit_code": "x"}
    path.write_bytes(orjson.dumps({**WRITTEN, "max_attempts": 0, "last_run": last}))
    manifest = read_for_status(path)
    assert manifest is not None and manifest.last_run is not None
    assert manifest.max_attempts is None
    assert (manifest.last_run.drained, manifest.last_run.exit_code) == (0, None)
    assert manifest.last_run.kill_shaped == 2 and manifest.run_id == WRITTEN["run_id"]
    path.write_bytes(b"[1]")
    assert read_for_status(path) is None


def test_ending_a_hop_records_last_run_and_keeps_a_bounded_history() -> None:
    manifest = RunManifest.parse({**WRITTEN, "delivery_history": [{"n": i} for i in range(60)]})
    last = LastRun(finished_at="2026-01-02T00:00:00Z", exit_code=0, summary={"ok": True})
    ended = manifest.ended_hop(last, HopDelivery.model_validate({"n": 60})).to_json()
    assert ended["last_run"] == {
        "finished_at": "2026-01-02T00:00:00Z",
        "exit_code": 0,
        "summary": {"ok": True},
    }
    assert [h["n"] for h in ended["delivery_history"]] == list(range(61 - HISTORY_HOPS, 61))
    assert ended["from_a_newer_version"] == {"x": 1}


def test_prepare_keeps_unknown_keys_across_hops(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "tasks.jsonl", 2)
    cli = {
        "input": tasks,
        "output": tmp_path / "out" / "x.jsonl",
        "agents": {"sim": ["http://h:1"]},
    }
    settings = load_settings(cli, env={})
    first = prepare_run(settings, None)
    first.lock.release()
    path = first.paths.manifest
    assert orjson.loads(path.read_bytes()) == first.record.to_json()
    path.write_bytes(
        orjson.dumps({**first.record.to_json(), "last_run": WRITTEN["last_run"], "own": 1})
    )

    second = prepare_run(settings, None)
    second.lock.release()

    written = orjson.loads(path.read_bytes())
    assert written["own"] == 1 and written["last_run"] == WRITTEN["last_run"]
    assert written["hops"] == 2 and written["run_id"] == first.record.run_id
    assert second.resumed and written == second.record.to_json()


def test_failure_rows_carry_exactly_the_contract_keys() -> None:
    failure = Failure("agent_request_failed", "ClientError", "refused", not_delivered=True)
    assert set(failure.as_row_keys()) == FAILURE_KEYS
    assert NOT_DELIVERED in FAILURE_KEYS
    plain = Failure("agent_run_error", "HTTPError", "500", http_status=500)
    assert set(plain.as_row_keys()) == FAILURE_KEYS - {NOT_DELIVERED}


def test_the_delivery_history_is_read_as_typed_hops_and_summed() -> None:
    hop = {
        "finished_at": "2026-01-01T00:30:00Z",
        "retries": {"a": {"refused": 2}},
        "replicas": {"a": {"http://one": {"state": "open", "sent": 5, "not_delivered": 5}}},
        "agents_down": ["a"],
        "local_faults": 1,
        "from_a_newer_version": True,
    }
    manifest = RunManifest.parse({**WRITTEN, "delivery_history": [hop, hop]})
    assert manifest.delivery_history is not None
    assert manifest.delivery_history[0].replicas["a"]["http://one"].not_delivered == 5
    assert manifest.to_json()["delivery_history"] == [hop, hop]  # written back as read
    total = summarize(manifest.delivery_history)
    assert total["retries"] == {"a": {"refused": 4}} and total["local_faults"] == 2
    [replica] = total["replicas"]
    assert (replica["sent"], replica["not_delivered"], replica["last_state"]) == (10, 10, "open")
    assert total["agents_down_last_hop"] == ["a"]


def test_a_hop_of_the_delivery_history_that_does_not_read_is_left_out_not_fatal() -> None:
    good = {"finished_at": "2026-01-01T00:30:00Z", "retries": {"a": {"refused": 1}}}
    bad = {"retries": {"a": {"refused": "2"}}}
    manifest = RunManifest.parse({**WRITTEN, "delivery_history": [bad, good]})
    assert manifest.delivery_history is not None
    assert [hop.retries for hop in manifest.delivery_history] == [{"a": {"refused": 1}}]
    assert RunManifest.parse({**WRITTEN, "delivery_history": "garbage"}).delivery_history is None


def test_a_job_status_as_json_is_every_field_in_order_its_dicts_copied() -> None:
    status = JobStatus(
        job_id="j",
        state=JobState.RUNNING,
        final=False,
        outcomes={"success": 3},
        metadata={"run": {"step": [1, 2]}},
        start_order={"window": 8},
        target_groups_by_agent={"sim": 2},
    )
    body = status.to_json()
    # What ``dataclasses.asdict`` gave, field for field and in the same order.
    expected = {**dataclasses.asdict(status), "state": "running"}
    assert list(body) == list(expected)
    assert body == expected
    assert orjson.dumps(body) == orjson.dumps(expected)
    # The answer is the caller's: changing it changes nothing of the status.
    body["outcomes"]["success"] = 0
    body["start_order"]["window"] = 0
    assert status.outcomes == {"success": 3} and status.start_order == {"window": 8}
