"""Which job ids the archive may hold, in memory: Bloom filters, never a wrong "no"
and a fraction of a percent of wrong "maybe"s each.

A submit whose job_id the archive cannot hold needs no lookup in its index, and
a small body of rows then no thread at all (``submission.py``): its check runs
on the loop. The ids archived before the daemon started are added once, in a
thread after the start (``load``); until then every id is a "maybe". The ids
a fold archives are added as its index commits (``archive.Compaction``).

Python's ``hash`` of a string differs from one process to the next: a filter
lives and dies with its daemon, never written anywhere.
"""

from __future__ import annotations

from collections.abc import Iterable

# 14 bits an id and 5 probes: about 0.25 % of the ids never archived are a "maybe"
# in a full filter (a chain of filters adds theirs up: a few at 100,000 jobs).
BITS_PER_ID = 14
PROBES = 5
FIRST_CAPACITY = 4096
_MASK_32 = 0xFFFFFFFF


class Bits:
    """One fixed Bloom filter, for ``capacity`` ids."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.count = 0
        self._size = capacity * BITS_PER_ID
        self._bits = bytearray((self._size + 7) // 8)

    def add(self, job_id: str) -> None:
        bits = self._bits
        for at in self._probes(job_id):
            bits[at >> 3] |= 1 << (at & 7)
        self.count += 1

    def __contains__(self, job_id: str) -> bool:
        bits = self._bits
        return all(bits[at >> 3] >> (at & 7) & 1 for at in self._probes(job_id))

    def _probes(self, job_id: str) -> list[int]:
        # Double hashing: PROBES positions from the two halves of one 64-bit hash.
        whole = hash(job_id)
        first, step = whole & _MASK_32, (whole >> 32 & _MASK_32) | 1
        return [(first + i * step) % self._size for i in range(PROBES)]


def bits_of(ids: Iterable[str], capacity: int) -> Bits:
    """A filter of ``ids`` (blocking, in a thread: what ``ArchivedIds.load`` adopts)."""
    bits = Bits(max(capacity, 1))
    for job_id in ids:
        bits.add(job_id)
    return bits


class ArchivedIds:
    """The ids the archive may hold: the ones loaded at the start, then the ones each
    fold adds (a chain of filters, each twice the last one's size once it is full)."""

    def __init__(self) -> None:
        self._chain: list[Bits] = [Bits(FIRST_CAPACITY)]
        # False until the ids archived before the start are in (``load``).
        self.loaded = False

    def load(self, bits: Bits) -> None:
        """The ids the archive held at the start (``bits_of``, from its index)."""
        self._chain.insert(0, bits)
        self.loaded = True

    def add(self, job_id: str) -> None:
        last = self._chain[-1]
        if last.count >= last.capacity:
            last = Bits(last.capacity * 2)
            self._chain.append(last)
        last.add(job_id)

    def may_hold(self, job_id: str) -> bool:
        """False only for an id the archive does not hold."""
        return not self.loaded or any(job_id in bits for bits in self._chain)
