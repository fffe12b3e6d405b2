"""Capture lines exactly as NeMo Gym 0.7.0's model servers write them, read and joined.

Gym writes ``model_ref`` as a ``{type, name}`` object naming its model server,
``started_at``/``completed_at`` as Unix seconds, and how the answer was produced
(``upstream_attempted``, ``response_source``, ...). Its agents reference their
calls by ``(model_ref, response_id)``. These used to read as nulls, which broke
the join (``model_call_reference_unmatched``) and emptied ``ng_perf``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from dispatcher.capture.records import parse_record
from dispatcher.capture.store import capture_path
from dispatcher.rows.capture import attach_capture
from dispatcher.sim.model_client import agent_trajectory
from dispatcher.trajectory.schema import TrajectoryRecord

SERVER = {"type": "responses_api_models", "name": "policy_model"}


def gym_line(response_id: str, call_id: str) -> bytes:
    """A line of the shape Gym's model server wrote in a real 0.7.0 run."""
    record = {
        "model_call_id": call_id,
        "dialect": "responses",
        "model_ref": SERVER,
        "started_at": 1796083074.7795746,
        "completed_at": 1796083074.8486094,
        "latency_ms": 69.03,
        "latency_ttft_ms": 67.18,
        "status_code": 200,
        "error_category": None,
        "request": {"model": "sim-model", "input": [{"role": "user", "content": "q"}]},
        "response": {
            "id": response_id,
            "model": "sim-model",
            "status": "completed",
            "output": [{"type": "message", "role": "assistant", "content": []}],
            "usage": {
                "input_tokens": 30,
                "input_tokens_details": {"cached_tokens": 8},
                "output_tokens": 16,
                "output_tokens_details": {"reasoning_tokens": 4},
                "total_tokens": 46,
            },
        },
        "client_session_id": "root",
        "upstream_attempted": True,
        "response_source": "upstream",
        "upstream_status_code": None,
        "local_response_reason": None,
    }
    return orjson.dumps(record) + b"\n"


def test_a_gym_record_reads_whole() -> None:
    call = parse_record(gym_line("resp_1", "c1"), include_payloads=False)

    assert call is not None
    assert call.model_ref == SERVER
    assert (call.started_at, call.completed_at) == (1796083074.7795746, 1796083074.8486094)
    assert (call.latency_ms, call.latency_ttft_ms) == (69.03, 67.18)
    assert (call.response_id, call.response_status, call.client_session_id) == (
        "resp_1",
        "completed",
        "root",
    )
    assert call.tokens.prompt == 30 and call.tokens.cached == 8 and call.tokens.reasoning == 4
    assert call.execution == {"upstream_attempted": True, "response_source": "upstream"}


def test_our_proxys_iso_timestamps_read_as_unix_seconds() -> None:
    line = {"model_call_id": "c", "started_at": "2026-01-01T00:00:00.500+00:00"}
    call = parse_record(orjson.dumps(line), include_payloads=False)
    assert call is not None
    assert call.started_at == 1767225600.5


def write(capture_dir: Path, lines: bytes) -> None:
    capture_dir.mkdir()
    capture_path(capture_dir, "4-1").write_bytes(lines)


async def test_gym_capture_joins_the_gym_agents_trajectory(tmp_path: Path) -> None:
    write(tmp_path / "c", gym_line("resp_1", "c1") + gym_line("resp_2", "c2"))
    own = agent_trajectory(
        task_id=4,
        rollout_id="4-1",
        responses=[{"id": "resp_1"}, {"id": "resp_2"}],
        model_ref="policy_model",
    )
    row: dict[str, Any] = {"_ng_task_index": 4, "_ng_rollout_index": 1}

    await attach_capture(
        row,
        capture_dir=tmp_path / "c",
        rollout_id="4-1",
        task_id=4,
        agent_result={"ng_trajectory": own},
        total_latency_ms=200.0,
    )

    trajectory = TrajectoryRecord.model_validate(row["ng_trajectory"])
    assert [gap.code for gap in trajectory.gaps] == ["conversation_unavailable"]
    first = trajectory.model_calls[0]
    assert first.response_metadata.model_ref is not None
    assert first.response_metadata.model_ref.name == "policy_model"
    assert first.started_at == 1796083074.7795746
    assert first.response_metadata.response_source == "upstream"
    assert row["ng_perf"] == {
        "num_turns": 2,
        "num_tool_calls": 0,
        "token_observability_coverage": 1.0,
        "prompt_tokens": 60,
        "cached_prompt_tokens": 16,
        "completion_tokens": 32,
        "reasoning_tokens": 8,
        "total_latency_ms": 200.0,
    }
    [call, _] = row["ng_model_call_capture"]["calls"]
    assert call["model_ref"] == SERVER and call["started_at"] == 1796083074.7795746
    assert call["client_session_id"] == "root" and call["call_index"] == 0
