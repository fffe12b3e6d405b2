"""Where an agent call goes: a replica's ``POST`` target, its request head built once."""

from __future__ import annotations

import base64
from dataclasses import dataclass

from yarl import URL

from dispatcher import __version__


@dataclass(frozen=True, slots=True)
class Target:
    """Where a ``POST`` goes: host, port, TLS, and the request head up to its length."""

    host: str
    port: int
    tls: bool
    head: bytes
    # ``scheme://host:port``: the key of its idle connections (a str caches its hash).
    origin: str

    @classmethod
    def of(cls, url: str) -> Target:
        """The target of ``url`` (``scheme://[user:password@]host[:port]/path``)."""
        parsed = URL(url)
        host = parsed.raw_host or ""
        port = parsed.port or 0
        shown = f"[{host}]" if ":" in host else host
        lines = [
            f"POST {parsed.raw_path or '/'} HTTP/1.1",
            f"Host: {shown if parsed.is_default_port() else f'{shown}:{port}'}",
            f"User-Agent: rollout-dispatcher/{__version__}",
            "Accept: */*",
            "Accept-Encoding: gzip, deflate",
            "Content-Type: application/json",
        ]
        if parsed.user is not None:
            secret = f"{parsed.user}:{parsed.password or ''}".encode()
            lines.append(f"Authorization: Basic {base64.b64encode(secret).decode()}")
        head = "\r\n".join([*lines, "Content-Length: "]).encode("latin-1")
        origin = f"{parsed.scheme}://{shown}:{port}"
        return cls(host, port, parsed.scheme == "https", head, origin)
