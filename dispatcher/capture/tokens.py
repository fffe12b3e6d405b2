"""Token counts of one model call, normalized across the chat, responses and messages dialects.

The three APIs name the same quantities differently (``prompt_tokens`` vs
``input_tokens``), nest the details differently, and Anthropic reports cached
prompt tokens *beside* ``input_tokens`` instead of inside it. Everything that
sums tokens goes through :func:`normalize_usage` so every sum means the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TokenCounts:
    """Tokens one call reported; None where the server did not report that quantity."""

    prompt: int | None = None
    completion: int | None = None
    reasoning: int | None = None
    cached: int | None = None
    total: int | None = None


def normalize_usage(usage: object) -> TokenCounts:
    """Read a ``usage`` object of any dialect; unknown shapes give an empty TokenCounts."""
    if not isinstance(usage, Mapping):
        return TokenCounts()
    prompt = _count(usage, "prompt_tokens", "input_tokens")
    cache_read = _count(usage, "cache_read_input_tokens")
    cache_creation = _count(usage, "cache_creation_input_tokens")
    if cache_read is not None or cache_creation is not None:
        # Anthropic: input_tokens excludes both cache reads and cache writes, yet
        # the model saw them all; fold them in so prompt sizes compare across dialects.
        prompt = (prompt or 0) + (cache_read or 0) + (cache_creation or 0)
    cached = _detail(usage, ("prompt_tokens_details", "input_tokens_details"), "cached_tokens")
    if cached is None:
        cached = cache_read
    completion = _count(usage, "completion_tokens", "output_tokens")
    reasoning = _detail(
        usage, ("completion_tokens_details", "output_tokens_details"), "reasoning_tokens"
    )
    total = _count(usage, "total_tokens")
    if total is None and prompt is not None and completion is not None:
        total = prompt + completion
    return TokenCounts(prompt, completion, reasoning, cached, total)


def completion_tokens(usage: object) -> int | None:
    """``normalize_usage(usage).completion`` alone: read once per row, so without
    the other quantities."""
    if isinstance(usage, (dict, Mapping)):  # dict first: the ABC check is slow
        return _count(usage, "completion_tokens", "output_tokens")
    return None


def _count(usage: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = usage.get(key)
        # bool is an int subclass; a True token count is a broken server, not 1.
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def _detail(usage: Mapping[str, Any], parents: tuple[str, ...], key: str) -> int | None:
    for parent in parents:
        details = usage.get(parent)
        if isinstance(details, Mapping):
            value = _count(details, key)
            if value is not None:
                return value
    return None
