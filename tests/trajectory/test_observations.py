"""An agent's ``ng_agent_observations`` joined to the captured calls as NeMo Gym joins them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from dispatcher.capture.records import parse_record
from dispatcher.capture.store import capture_path
from dispatcher.rows.capture import attach_agent_trajectory, attach_capture
from dispatcher.trajectory.observations import observed_from
from dispatcher.trajectory.schema import TrajectoryRecord

SERVER = {"type": "responses_api_models", "name": "policy_model"}


def record(call_id: str, *, session: str | None = None, response_id: str | None = None) -> bytes:
    line: dict[str, Any] = {
        "model_call_id": call_id,
        "dialect": "chat",
        "model_ref": SERVER,
        "started_at": 1.0,
        "status_code": 200,
        "request": {"messages": [{"role": "user", "content": "q"}]},
        "response": {
            "id": response_id or f"resp-{call_id}",
            "choices": [{"message": {"role": "assistant", "content": call_id}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 2},
        },
    }
    if session is not None:
        line["client_session_id"] = session
    return orjson.dumps(line) + b"\n"


def bundle(*invocations: dict[str, Any], tools: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    records = [{"kind": "agent_invocation", **i} for i in invocations]
    records += [{"kind": "tool_call", **t} for t in tools]
    return {"source": "harness", "records": records, "gaps": []}


def codes(trajectory: dict[str, Any]) -> list[tuple[str, str | None]]:
    return [(g["code"], g["detail"]) for g in trajectory["gaps"]]


def write_capture(capture_dir: Path, lines: bytes) -> None:
    capture_dir.mkdir()
    capture_path(capture_dir, "0-0").write_bytes(lines)


async def attach(tmp_path: Path, lines: bytes, result: dict[str, Any]) -> dict[str, Any]:
    write_capture(tmp_path / "c", lines)
    row: dict[str, Any] = {"_ng_task_index": 0, "_ng_rollout_index": 0}
    await attach_capture(
        row,
        capture_dir=tmp_path / "c",
        rollout_id="0-0",
        task_id=0,
        agent_result=result,
        total_latency_ms=1.0,
    )
    TrajectoryRecord.model_validate(row["ng_trajectory"])
    return row


async def test_session_ids_and_refs_give_each_invocation_its_calls(tmp_path: Path) -> None:
    lines = record("a", session="root") + record("b", session="sub") + record("judge")
    sent = bundle(
        {"invocation_id": "root", "status": "completed"},
        {
            "invocation_id": "sub",
            "parent_invocation_id": "root",
            "model_calls": [{"model_ref": SERVER, "response_id": "resp-b"}],
        },
        tools=({"invocation_id": "root", "tool_call_id": "t1", "tool_name": "spawn"},),
    )

    row = await attach(tmp_path, lines, {"ng_agent_observations": sent})

    trajectory = row["ng_trajectory"]
    refs = {i["invocation_id"]: i["model_calls"] for i in trajectory["invocations"]}
    assert [r["model_call_id"] for r in refs["root"]] == ["a"]
    assert refs["sub"] == [{"model_call_id": "b", "model_ref": SERVER, "response_id": "resp-b"}]
    # One turn per owned answered call, numbered within its invocation; the judge is no turn.
    turns = [(t["invocation_id"], t["turn_no"]) for t in trajectory["turns"]]
    assert turns == [("root", 1), ("sub", 1)]
    assert [t["tool_call_id"] for t in trajectory["tool_calls"]] == ["t1"]
    assert ("model_call_ownership_unavailable", "capture:judge:call_index=2") in codes(trajectory)
    perf = row["ng_perf"]
    assert (perf["num_turns"], perf["prompt_tokens"], perf["token_observability_coverage"]) == (
        2,
        20,
        1.0,
    )
    # The agent's own key is left as it sent it.
    assert "ng_agent_observations" not in row


async def test_unmatched_ambiguous_and_conflicting_refs_are_gaps(tmp_path: Path) -> None:
    lines = record("a") + record("b", response_id="same") + record("c", response_id="same")
    sent = bundle(
        {"invocation_id": "one", "model_calls": [{"model_call_id": "a"}, {"model_call_id": "x"}]},
        {
            "invocation_id": "two",
            "model_calls": [
                {"model_call_id": "a"},
                {"model_ref": SERVER, "response_id": "same"},
            ],
        },
    )

    row = await attach(tmp_path, lines, {"ng_agent_observations": sent})

    found = codes(row["ng_trajectory"])
    assert ("model_call_reference_unmatched", "x") in found
    assert ("model_call_reference_conflict", "a") in found
    assert ("model_call_reference_ambiguous", "same") in found


def test_a_bundle_that_is_not_one_is_a_gap_not_an_error() -> None:
    for broken in ([1, 2], {"records": 5}, bundle({"invocation_id": 5}), bundle({}, {})):
        observed = observed_from(broken, [])
        assert observed is not None
        assert [g.code for g in observed.gaps] == ["agent_observations_invalid"]


def test_without_capture_observations_still_make_a_trajectory() -> None:
    row: dict[str, Any] = {"_ng_task_index": 0, "_ng_rollout_index": 0}
    sent = bundle({"invocation_id": "root", "model_calls": [{"model_call_id": "a"}]})

    attach_agent_trajectory(
        row, rollout_id="0-0", task_id=0, agent_result={"ng_agent_observations": sent}
    )

    trajectory = TrajectoryRecord.model_validate(row["ng_trajectory"])
    assert [i.invocation_id for i in trajectory.invocations] == ["root"]
    assert "model_calls_unavailable" in [g.code for g in trajectory.gaps]


def test_a_ref_naming_another_model_server_does_not_match() -> None:
    call = parse_record(record("a"), include_payloads=False)
    assert call is not None
    other = {"type": "responses_api_models", "name": "judge"}
    sent = bundle(
        {"invocation_id": "root", "model_calls": [{"model_ref": other, "response_id": "resp-a"}]}
    )

    observed = observed_from(sent, [call])

    assert observed is not None
    assert [g.code for g in observed.gaps] == [
        "model_call_reference_unmatched",
        "model_call_ownership_unavailable",
    ]
