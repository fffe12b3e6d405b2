"""What bench/routing.py watches beside the model servers' counts: when the proxy forgot
each rollout's session (its log) and when it told the upstream (``--session-release-url``
pointed here), and the calls in flight per upstream over time (sampled from the proxy's
``GET /ng-metrics``)."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson

_TOKEN = re.compile(r"\.[0-9a-f]{8}$")


class Releases:
    """Unix time of the first release POST per rollout id (its capture token dropped)."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self._lock = threading.Lock()

    def note(self, session_id: str) -> None:
        now = time.time()
        with self._lock:
            self.at.setdefault(_TOKEN.sub("", session_id), now)


def released_at_proxy(log: Path) -> dict[str, float]:
    """Unix time at which the proxy forgot each rollout's session (its ``session_released``
    events), by rollout id (the capture token dropped)."""
    at: dict[str, float] = {}
    for line in log.read_bytes().splitlines():
        if line.startswith(b"{"):
            event = orjson.loads(line)
            if event.get("event") == "session_released":
                stamp = datetime.fromisoformat(event["timestamp"]).timestamp()
                at.setdefault(_TOKEN.sub("", event["rollout_id"]), stamp)
    return at


def release_delays(at: dict[str, float], finished: list[dict[str, Any]]) -> list[float]:
    """Each release's delay, in seconds, after the end of its rollout as the dispatcher
    recorded it (its ``rollout_finished`` event); a rollout never released counts as
    infinitely late."""
    delays = []
    for event in finished:
        ended = datetime.fromisoformat(event["timestamp"]).timestamp()
        released = at.get(event["rollout_id"])
        delays.append(float("inf") if released is None else max(0.0, released - ended))
    return delays


@contextmanager
def release_listener() -> Iterator[tuple[str, Releases]]:
    """An HTTP server noting each ``{"session_id": ...}`` POSTed to it; its URL."""
    releases = Releases()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            releases.note(str(orjson.loads(body)["session_id"]))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    class Server(ThreadingHTTPServer):
        # A group's rollouts end together: with http.server's backlog of 5, the rest of
        # a burst had their connections dropped and retried a second later.
        request_queue_size = 1024

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/release", releases
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def in_flight_sampler(proxy: str, every_s: float = 0.02) -> Iterator[list[list[float]]]:
    """Samples of calls in flight per upstream, in upstream order, while in the block."""
    samples: list[list[float]] = []
    stop = threading.Event()

    def sample() -> None:
        pattern = re.compile(rb"^dispatcher_capture_upstream_calls_in_flight\{.*\} (\S+)$", re.M)
        while not stop.wait(every_s):
            try:
                with urllib.request.urlopen(f"{proxy}/ng-metrics", timeout=5) as answer:
                    text = answer.read()
            except OSError:
                continue
            samples.append([float(v) for v in pattern.findall(text)])

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()
