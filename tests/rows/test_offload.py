"""Where an answer is classed: parsed whole, split on the loop, or split in a worker.

``AnswerClassifier`` parses a small 2xx body whole; from ``split_bytes`` it keeps
its values as the agent's bytes (``WireResult``) on the loop; past
``offload_bytes`` a worker splits it. An error status is read the same at any size.
"""

from __future__ import annotations

from typing import Any

import pytest

from dispatcher.delivery.answers import BODY_EXCERPT_CHARS
from dispatcher.delivery.faults import LocalFault
from dispatcher.outcome import Outcome
from dispatcher.rows import offload
from dispatcher.rows.wire import WireResult
from tests.rows.test_big_rows import big_body

KIB = 1024


@pytest.fixture
def no_worker(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The worker hops a classifier makes, recorded instead of run."""
    hops: list[str] = []

    async def hop(*_: Any, **__: Any) -> Any:
        hops.append("worker")
        raise AssertionError("no worker is asked")

    monkeypatch.setattr(offload, "off_loop", hop)
    monkeypatch.setattr(offload, "_run_in", hop)
    return hops


async def test_an_answer_from_the_split_size_is_kept_as_bytes_on_the_loop(
    no_worker: list[str],
) -> None:
    classify = offload.AnswerClassifier(offload_bytes=256 * KIB, split_bytes=16 * KIB)
    raw = big_body(row_bytes=32 * KIB)
    outcome, result, failure = await classify(200, raw)
    assert outcome is Outcome.SUCCESS and failure is None
    assert isinstance(result, WireResult)
    assert result["reward"] == 1.0 and result["_ng_task_index"] == 7
    assert no_worker == []


async def test_an_answer_under_the_split_size_is_parsed_whole(no_worker: list[str]) -> None:
    classify = offload.AnswerClassifier(offload_bytes=256 * KIB, split_bytes=16 * KIB)
    raw = big_body(row_bytes=4 * KIB)
    assert len(raw) <= 16 * KIB
    _, result, _ = await classify(200, raw)
    assert type(result) is dict and result["big_int"] == 123456789012345678901234567890
    assert no_worker == []


async def test_the_default_split_size_is_below_the_default_offload_size(
    no_worker: list[str],
) -> None:
    classify = offload.AnswerClassifier(offload_bytes=256 * KIB)
    _, result, _ = await classify(200, big_body(row_bytes=offload.SPLIT_BYTES + KIB))
    assert isinstance(result, WireResult)


async def test_an_offload_size_under_the_split_size_sends_every_bigger_answer_to_a_worker(
    no_worker: list[str],
) -> None:
    classify = offload.AnswerClassifier(offload_bytes=0, split_bytes=16 * KIB)
    with pytest.raises(AssertionError, match="no worker"):
        await classify(200, big_body(row_bytes=1 * KIB))
    assert no_worker == ["worker"]


async def test_an_error_status_reads_only_an_excerpt_at_any_size(no_worker: list[str]) -> None:
    classify = offload.AnswerClassifier(offload_bytes=256 * KIB, split_bytes=16 * KIB)
    outcome, result, failure = await classify(500, big_body(row_bytes=64 * KIB))
    assert outcome is Outcome.AGENT_RUN_ERROR and result is None
    assert failure is not None and len(failure.response_body or "") <= BODY_EXCERPT_CHARS + 1


async def test_running_out_of_memory_while_splitting_is_our_fault(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def out_of_memory(*_: Any) -> Any:
        raise MemoryError

    monkeypatch.setattr(offload, "classify_big", out_of_memory)
    classify = offload.AnswerClassifier(offload_bytes=256 * KIB, split_bytes=16 * KIB)
    with pytest.raises(LocalFault, match="out of memory"):
        await classify(200, big_body(row_bytes=32 * KIB))
