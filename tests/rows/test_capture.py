"""Finalization against capture directories written with the proxy's own encoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from dispatcher.capture.records import Exchange, encode_record
from dispatcher.capture.store import (
    append_line,
    capture_path,
    claims_path,
    create_claim,
    has_claims,
    incomplete_path,
    release_claim,
)
from dispatcher.rows.capture import attach_capture, clear_rollout_captures


def exchange_line(
    response: dict[str, Any] | None, *, dialect: str = "chat", status: int = 200
) -> bytes:
    exchange = Exchange("r", dialect, "/v1/chat/completions")
    exchange.request_body = orjson.dumps({"model": "m", "messages": []})
    exchange.on_headers(status, "application/json", "")
    if response is not None:
        exchange.on_chunk(orjson.dumps(response))
    return encode_record(exchange)


def chat_answer(n: int, usage: dict[str, Any] | None) -> dict[str, Any]:
    message = {"role": "assistant", "content": f"answer {n}"}
    answer = {"id": f"id-{n}", "model": "m", "choices": [{"index": 0, "message": message}]}
    return {**answer, "usage": usage} if usage is not None else answer


USAGE = {
    "prompt_tokens": 100,
    "completion_tokens": 10,
    "total_tokens": 110,
    "prompt_tokens_details": {"cached_tokens": 40},
    "completion_tokens_details": {"reasoning_tokens": 3},
}


def write_lines(capture_dir: Path, rollout_id: str, lines: list[bytes]) -> None:
    path = capture_path(capture_dir, rollout_id)
    for line in lines:
        append_line(path, line)


async def finalize(
    capture_dir: Path, rollout_id: str, row: dict[str, Any] | None = None, **kwargs: Any
) -> dict[str, Any]:
    row = {"reward": 1.0} if row is None else row
    await attach_capture(
        row,
        capture_dir=capture_dir,
        rollout_id=rollout_id,
        task_id=4,
        agent_result=kwargs.pop("agent_result", dict(row)),
        total_latency_ms=kwargs.pop("total_latency_ms", 1.0),
        **kwargs,
    )
    return row


def gap_codes(row: dict[str, Any]) -> list[str]:
    return [gap["code"] for gap in row["ng_model_call_capture"].get("gaps", [])]


async def test_one_damaged_line_hides_nothing_else(tmp_path: Path) -> None:
    write_lines(
        tmp_path,
        "4-0",
        [
            exchange_line(chat_answer(1, USAGE)),
            b'{"model_call_id": "torn", "respo\n',
            exchange_line(chat_answer(2, USAGE)),
        ],
    )

    row = await finalize(tmp_path, "4-0")

    capture = row["ng_model_call_capture"]
    assert capture["gaps"] == [
        {"code": "model_call_capture_records_unreadable", "detail": "count=1"}
    ]
    assert [c["response_id"] for c in capture["calls"]] == ["id-1", "id-2"]
    assert capture["metrics"]["tokens_in"] == 200


async def test_no_file_gives_no_records_and_no_perf(tmp_path: Path) -> None:
    row = await finalize(tmp_path, "4-0")

    assert gap_codes(row) == ["model_call_capture_no_records"]
    assert row["ng_model_call_capture"]["calls"] == []
    assert row["ng_trajectory"]["invocations"] == []
    assert "ng_perf" not in row


async def test_incomplete_marker_gives_its_gap_beside_the_calls(tmp_path: Path) -> None:
    write_lines(tmp_path, "4-0", [exchange_line(chat_answer(1, USAGE))])
    append_line(incomplete_path(tmp_path, "4-0"), b"")

    row = await finalize(tmp_path, "4-0")

    assert gap_codes(row) == ["model_call_capture_incomplete"]
    assert row["ng_model_call_capture"]["metrics"]["num_calls"] == 1


async def test_unreadable_capture_file_is_a_gap(tmp_path: Path) -> None:
    capture_path(tmp_path, "4-0").mkdir()

    row = await finalize(tmp_path, "4-0")

    (gap,) = row["ng_model_call_capture"]["gaps"]
    assert gap["code"] == "model_call_capture_unreadable"
    assert gap["detail"].startswith("IsADirectoryError")


async def test_metrics_sum_what_was_reported_and_null_what_never_was(tmp_path: Path) -> None:
    write_lines(tmp_path, "a", [exchange_line(chat_answer(1, None))] * 2)
    only_prompt = {"prompt_tokens": 7}
    write_lines(tmp_path, "b", [exchange_line(chat_answer(1, only_prompt)), exchange_line(None)])

    silent = (await finalize(tmp_path, "a"))["ng_model_call_capture"]["metrics"]
    partial = (await finalize(tmp_path, "b"))["ng_model_call_capture"]["metrics"]

    tokens = ("tokens_in", "tokens_out", "tokens_reasoning", "tokens_total", "cached_tokens")
    assert all(silent[key] is None for key in tokens)
    assert silent["num_calls"] == 2
    assert silent["latency_total_ms"] is not None
    assert partial["tokens_in"] == 7
    assert all(partial[key] is None for key in tokens[1:])


async def test_payloads_only_when_asked(tmp_path: Path) -> None:
    write_lines(tmp_path, "4-0", [exchange_line(chat_answer(1, USAGE))])

    (lean,) = (await finalize(tmp_path, "4-0"))["ng_model_call_capture"]["calls"]
    (full,) = (await finalize(tmp_path, "4-0", include_payloads=True))["ng_model_call_capture"][
        "calls"
    ]

    assert "request" not in lean and "response" not in lean
    assert full["request"]["model"] == "m"
    assert full["response"]["id"] == "id-1"
    assert (lean["tokens_in"], lean["cached_tokens"], lean["tokens_reasoning"]) == (100, 40, 3)


async def test_the_agents_result_is_never_changed(tmp_path: Path) -> None:
    write_lines(tmp_path, "4-0", [exchange_line(chat_answer(1, USAGE))])
    result = {"reward": 0.25, "response": {"id": "x"}, "_ng_task_index": 4}
    row = dict(result)

    await finalize(tmp_path, "4-0", row=row, agent_result=result, total_latency_ms=55.0)

    assert {k: row[k] for k in result} == result
    assert set(row) - set(result) == {"ng_model_call_capture", "ng_trajectory", "ng_perf"}
    assert row["ng_perf"]["total_latency_ms"] == 55.0


async def test_failure_rows_get_the_capture_too(tmp_path: Path) -> None:
    write_lines(tmp_path, "4-0-a1", [exchange_line({"error": "boom"}, status=500)])
    row = {"_ng_failure_class": "agent_run_error", "_ng_task_index": 4}

    await finalize(tmp_path, "4-0-a1", row=row, agent_result=None)

    (call,) = row["ng_model_call_capture"]["calls"]
    assert (call["status_code"], call["error_category"]) == (500, "upstream_http_error")
    (invocation,) = row["ng_trajectory"]["invocations"]
    assert invocation["status"] == "failed"
    assert row["ng_trajectory"]["turns"] == []
    assert row["ng_perf"]["num_turns"] == 1
    assert row["ng_perf"]["token_observability_coverage"] == 1.0


async def test_observability_off_means_no_perf(tmp_path: Path) -> None:
    write_lines(tmp_path, "4-0", [exchange_line(chat_answer(1, USAGE))])

    row = await finalize(tmp_path, "4-0", observability=False)

    assert "ng_perf" not in row
    assert row["ng_trajectory"]["turns"][0]["turn_no"] == 1


async def test_claim_outstanding_past_the_limit_is_pending(tmp_path: Path) -> None:
    write_lines(tmp_path, "4-0", [exchange_line(chat_answer(1, USAGE))])
    claim = create_claim(tmp_path, "4-0", "other-host.1.0.claim")

    row = await finalize(tmp_path, "4-0", poll_s=0.01, limit_s=0.05)
    release_claim(claim)
    after = await finalize(tmp_path, "4-0", limit_s=0.0)

    assert gap_codes(row) == ["model_call_capture_pending"]
    assert row["ng_model_call_capture"]["metrics"]["num_calls"] == 1
    assert gap_codes(after) == []
    assert not claims_path(tmp_path, "4-0").exists()


async def test_clear_removes_exactly_the_given_rollouts(tmp_path: Path) -> None:
    for rollout_id in ("3-1", "3-1-a1", "3-10"):
        write_lines(tmp_path, rollout_id, [exchange_line(chat_answer(1, USAGE))])
        append_line(incomplete_path(tmp_path, rollout_id), b"")
        create_claim(tmp_path, rollout_id, "h.1.0.claim")

    await clear_rollout_captures(tmp_path, iter(["3-1-a1", "3-10", "never-ran"]))

    assert capture_path(tmp_path, "3-1").exists()
    assert incomplete_path(tmp_path, "3-1").exists()
    assert has_claims(tmp_path, "3-1")
    for gone in ("3-1-a1", "3-10"):
        assert not capture_path(tmp_path, gone).exists()
        assert not incomplete_path(tmp_path, gone).exists()
        assert not has_claims(tmp_path, gone)


async def test_clear_refuses_an_id_that_is_not_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a rollout id"):
        await clear_rollout_captures(tmp_path, ["../escape"])


async def test_clear_handles_more_ids_than_one_batch(tmp_path: Path) -> None:
    ids = [f"{i}-0" for i in range(1200)]
    for rollout_id in ids[::100]:
        write_lines(tmp_path, rollout_id, [exchange_line(chat_answer(1, USAGE))])

    await clear_rollout_captures(tmp_path, (rollout_id for rollout_id in ids))

    assert not any(capture_path(tmp_path, rollout_id).exists() for rollout_id in ids)


async def test_claims_that_cannot_be_checked_are_a_gap_not_an_error(tmp_path: Path) -> None:
    write_lines(tmp_path, "4-0", [exchange_line(chat_answer(1, USAGE))])
    append_line(tmp_path / "claims", b"not a directory")

    row = await finalize(tmp_path, "4-0")

    (gap,) = row["ng_model_call_capture"]["gaps"]
    assert gap["code"] == "model_call_capture_unreadable"
    assert gap["detail"].startswith("claims: NotADirectoryError")
    assert row["ng_model_call_capture"]["metrics"]["num_calls"] == 1
