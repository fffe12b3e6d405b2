"""Bounds on agent answers: a size cap (decompressed) and a deadline for the body.

An agent is a peer we do not control. Without a cap, an endless chunked body
or a small gzip answer that inflates a thousandfold grows the dispatcher's
memory until the OOM killer ends the run. The agent client (``http1.py``)
inflates a compressed body in bounded steps as it arrives and counts the
inflated bytes, so stopping at the cap bounds memory there.

The deadline covers the body only, from the status line to its last byte: an
answer that trickles a byte at a time would otherwise hold a rollout slot
forever when no ``--rollout-timeout-s`` is set (when one is, it still bounds
the whole call, body included).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from dispatcher.delivery.inflate import GZIP_OR_ZLIB, INFLATED

DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024 * 1024
DEFAULT_READ_TIMEOUT_S = 600.0
# What a failure keeps of a body that broke a limit: enough for its excerpt (§5).
PARTIAL_KEEP_BYTES = 16 * 1024
# A body at least this big is joined in a thread: CPython's bytes.join lets go
# of the GIL while it copies 1 MiB or more, and on the loop the join of a
# 20 MB body held it for ~13 ms (bench/big_rows.py).
JOIN_OFF_LOOP_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class ResponseLimits:
    """``--max-response-bytes`` and ``--response-read-timeout-s``."""

    max_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    read_timeout_s: float | None = DEFAULT_READ_TIMEOUT_S


# An answer's body: a big one read straight into its own buffer is a bytearray
# (``http1.DIRECT_BODY_BYTES``); each reader only reads it.
Body = bytes | bytearray


class BodyLimitError(Exception):
    """The answer's body broke a limit; ``partial`` is what was read before it did."""

    def __init__(self, kind: str, message: str, partial: bytes) -> None:
        super().__init__(message)
        self.kind = kind
        self.partial = partial


def partial_prefix(chunks: list[bytes]) -> bytes:
    """The first ``PARTIAL_KEEP_BYTES`` read, without joining the whole body."""
    kept: list[bytes] = []
    size = 0
    for chunk in chunks:
        if size >= PARTIAL_KEEP_BYTES:
            break
        kept.append(chunk[: PARTIAL_KEEP_BYTES - size])
        size += len(kept[-1])
    return b"".join(kept)


def too_large_message(max_bytes: int) -> str:
    return f"the answer is larger than --max-response-bytes ({max_bytes} bytes, decompressed)"


# --- the capture proxy ------------------------------------------------------------------

DEFAULT_PROXY_MAX_REQUEST_BYTES = 64 * 1024 * 1024
DEFAULT_PROXY_MAX_RECORD_BYTES = 64 * 1024 * 1024
# Each call holds a slot while it streams: as high as `--concurrency-max`, so a
# run at its usual concurrency does not wait on the proxy.
DEFAULT_PROXY_MAX_CONCURRENCY = 1024


@dataclass(frozen=True, slots=True)
class ProxyLimits:
    """The capture proxy's bounds: its memory stays under about
    ``max_concurrency * (max_request_bytes + max_record_bytes)``.

    A request body over ``max_request_bytes`` is refused (413). An answer is
    always relayed whole; only the copy kept for the capture record stops
    at ``max_record_bytes`` (raw plus decoded size), and the call is then
    recorded without its answer (``proxy_error``). Calls beyond
    ``max_concurrency`` wait for a slot before their body is read.
    """

    max_request_bytes: int = DEFAULT_PROXY_MAX_REQUEST_BYTES
    max_record_bytes: int = DEFAULT_PROXY_MAX_RECORD_BYTES
    max_concurrency: int = DEFAULT_PROXY_MAX_CONCURRENCY


class RecordBudget:
    """Counts what keeping an answer's copy would cost, decoded size included.

    A 1 MB gzip answer can inflate to gigabytes when the record decodes it,
    so an encoded answer is inflated here as it streams, in bounded steps and
    without keeping the output, only to measure it.
    """

    def __init__(self, max_bytes: int, content_encoding: str) -> None:
        self._left = max_bytes
        # The Content-Encodings the capture record decodes (capture/records.py).
        encoding = content_encoding.strip().lower().encode("latin-1", "replace")
        self._inflate = zlib.decompressobj(GZIP_OR_ZLIB) if encoding in INFLATED else None
        self.exceeded = False

    def admit(self, chunk: bytes) -> bool:
        """False once the copy would be too large (and from then on)."""
        if not self.exceeded:
            self._left -= len(chunk) + self._decoded_size(chunk)
            self.exceeded = self._left < 0
        return not self.exceeded

    def _decoded_size(self, chunk: bytes) -> int:
        if self._inflate is None or self._inflate.eof:
            return 0
        total, data = 0, chunk
        try:
            while data and total <= self._left:
                total += len(self._inflate.decompress(data, 1 << 16))
                data = self._inflate.unconsumed_tail
        except zlib.error:
            self._inflate = None  # the record keeps undecodable bytes raw
        return total
