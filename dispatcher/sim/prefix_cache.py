"""The simulated model's prefix cache: what an inference engine's KV cache saves.

An engine such as vLLM keeps the KV blocks of prompts it prefilled, keyed by a
hash chain over fixed-size blocks (a block's key covers every token before it),
and evicts the least recently used. A new prompt reuses its longest cached
prefix and prefills the rest. Here a prompt is its request's conversation as
bytes, four bytes a token (as the sim's usage counts them), in blocks of
``BLOCK_TOKENS``; capacity is in tokens (the KV a replica has left for cached
prefixes besides its running batch's own). Enough for routing to show its effect:
the siblings of a group share a prompt, and each turn of a rollout extends the
last one's.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

BYTES_PER_TOKEN = 4
BLOCK_TOKENS = 16
_BLOCK_BYTES = BLOCK_TOKENS * BYTES_PER_TOKEN


def prompt_tokens(prompt: bytes) -> int:
    """The tokens the sim counts in ``prompt``: at least one."""
    return max(1, len(prompt) // BYTES_PER_TOKEN)


class PrefixCache:
    """An LRU of prompt blocks, ``capacity_tokens`` at most."""

    def __init__(self, capacity_tokens: int) -> None:
        self._capacity = max(0, capacity_tokens // BLOCK_TOKENS)
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def admit(self, prompt: bytes) -> int:
        """The tokens of ``prompt`` found cached (its longest cached prefix of whole
        blocks); every block of it is cached afterwards, as the engine keeps it."""
        keys = _block_keys(prompt)
        hit = 0
        while hit < len(keys) and keys[hit] in self._blocks:
            hit += 1
        # Touched tail first, so the head is the most recently used: as vLLM frees a
        # request's blocks, a prompt under pressure loses its tail before its head
        # (whose loss would make every block after it useless to a prefix match).
        for key in reversed(keys):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)
        tokens = prompt_tokens(prompt)
        cached = min(hit * BLOCK_TOKENS, tokens)
        self.prompt_tokens += tokens
        self.cached_tokens += cached
        return cached


def _block_keys(prompt: bytes) -> list[bytes]:
    """One key per whole block: a hash of the block and of the key before it."""
    keys, previous = [], b""
    for start in range(0, len(prompt) - _BLOCK_BYTES + 1, _BLOCK_BYTES):
        previous = hashlib.blake2b(
            previous + prompt[start : start + _BLOCK_BYTES], digest_size=16
        ).digest()
        keys.append(previous)
    return keys
