"""The errors of the agent calls' HTTP/1.1 client (``http1.py``, ``http1_pool.py``):
``OSError``s, as the socket's own are."""

from __future__ import annotations


class Disconnected(ConnectionError):
    """The agent closed the connection, or sent what is not HTTP, before its answer was whole."""


class MalformedAnswer(Disconnected):
    """The answer's status line was read, then what followed is not HTTP/1.1: the
    agent had the rollout (delivered), but its answer cannot be read."""


class ConnectTimeout(TimeoutError):
    """No connection to the replica within the connect timeout."""
