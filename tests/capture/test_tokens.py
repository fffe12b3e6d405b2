"""Token counts normalized across dialects (``capture/tokens.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from dispatcher.capture.tokens import TokenCounts, normalize_usage


def test_chat_usage() -> None:
    usage = {
        "prompt_tokens": 120,
        "completion_tokens": 30,
        "total_tokens": 150,
        "prompt_tokens_details": {"cached_tokens": 64},
        "completion_tokens_details": {"reasoning_tokens": 12},
    }
    assert normalize_usage(usage) == TokenCounts(120, 30, 12, 64, 150)


def test_responses_usage() -> None:
    usage = {
        "input_tokens": 80,
        "input_tokens_details": {"cached_tokens": 16},
        "output_tokens": 20,
        "output_tokens_details": {"reasoning_tokens": 5},
        "total_tokens": 100,
    }
    assert normalize_usage(usage) == TokenCounts(80, 20, 5, 16, 100)


def test_anthropic_cache_tokens_fold_into_the_prompt() -> None:
    usage = {
        "input_tokens": 10,
        "cache_read_input_tokens": 30,
        "cache_creation_input_tokens": 5,
        "output_tokens": 7,
    }
    assert normalize_usage(usage) == TokenCounts(
        prompt=45, completion=7, reasoning=None, cached=30, total=52
    )


@pytest.mark.parametrize(
    "usage",
    [None, [], "12", {}, {"prompt_tokens": -1}, {"prompt_tokens": True}, {"prompt_tokens": 1.5}],
)
def test_unusable_usage_reports_nothing(usage: Any) -> None:
    assert normalize_usage(usage) == TokenCounts()


def test_total_needs_both_sides_when_not_reported() -> None:
    assert normalize_usage({"prompt_tokens": 3}).total is None
    assert normalize_usage({"prompt_tokens": 3, "completion_tokens": 4}).total == 7
