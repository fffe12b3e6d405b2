"""HTTP client to agent servers (DESIGN A3, A5): replicas, the call, failure classes.

An attempt is one ``POST {replica}/run``. Whatever happens to it becomes an
``Attempt`` value: the agent's result, or a failure with its class from the
dispatcher's point of view. Nothing here raises for an agent's misbehaviour.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from dispatcher.outcome import Outcome
from dispatcher.state import FAILURE_CLASS, FAILURE_TERMINAL, NO_PERSIST

# Statuses after which the rollout most likely never ran (A5).
REQUEST_FAILED_STATUSES = frozenset({429, 502, 503, 504})
BODY_EXCERPT_BYTES = 8000
BODY_EXCERPT_CHARS = 2000
# No per-rollout timeout: skip building a timeout scope for every call.
_NO_TIMEOUT: contextlib.AbstractAsyncContextManager[None] = contextlib.nullcontext()


@dataclass
class Replica:
    """One base URL of an agent, with its live in-flight count."""

    agent: str
    url: str
    in_flight: int = 0
    run_url: str = field(init=False)

    def __post_init__(self) -> None:
        self.run_url = f"{self.url}/run"


@dataclass(frozen=True, slots=True)
class Failure:
    """Why an attempt failed, as the failure row's ``_ng_failure_*`` keys."""

    failure_class: str
    type: str
    message: str
    http_status: int | None = None
    response_body: str | None = None
    terminal: bool = False

    def as_row_keys(self) -> dict[str, Any]:
        return {
            "_ng_failure_class": self.failure_class,
            "_ng_failure_type": self.type,
            "_ng_failure_message": self.message,
            "_ng_failure_http_status": self.http_status,
            "_ng_failure_response_body": self.response_body,
            "_ng_failure_terminal": self.terminal,
        }


@dataclass(frozen=True, slots=True)
class Attempt:
    """What one POST /run came to."""

    outcome: Outcome
    replica: str
    started_at: float
    duration_s: float
    result: dict[str, Any] | None = None
    failure: Failure | None = None


class AgentClient:
    """Sends rollouts to agents, spreading each agent's load over its replicas."""

    def __init__(self, agents: dict[str, list[str]], session: aiohttp.ClientSession) -> None:
        self._session = session
        self._replicas = {
            name: [Replica(name, url) for url in urls] for name, urls in agents.items()
        }
        # Ties rotate so equally idle replicas share the load evenly.
        self._turn = {name: itertools.cycle(range(len(urls))) for name, urls in agents.items()}

    def in_flight(self) -> dict[str, dict[str, int]]:
        return {
            name: {r.url: r.in_flight for r in replicas}
            for name, replicas in self._replicas.items()
        }

    def pick(self, agent: str) -> Replica:
        """The replica with the fewest rollouts in flight."""
        replicas = self._replicas[agent]
        if len(replicas) == 1:
            return replicas[0]
        start = next(self._turn[agent])
        ordered = replicas[start:] + replicas[:start]
        return min(ordered, key=lambda r: r.in_flight)

    async def run(self, agent: str, body: dict[str, Any], timeout_s: float | None) -> Attempt:
        replica = self.pick(agent)
        replica.in_flight += 1
        started_at, t0 = time.time(), time.perf_counter()
        try:
            status, raw, failure = await self._post(replica, body, timeout_s)
        finally:
            replica.in_flight -= 1
        duration_s = time.perf_counter() - t0
        if failure is None:
            outcome, result, failure = classify_response(status, raw)
        else:
            outcome, result = Outcome(failure.failure_class), None
        return Attempt(outcome, replica.url, started_at, duration_s, result, failure)

    async def _post(
        self, replica: Replica, body: dict[str, Any], timeout_s: float | None
    ) -> tuple[int, bytes, Failure | None]:
        try:
            deadline = _NO_TIMEOUT if timeout_s is None else asyncio.timeout(timeout_s)
            async with (
                deadline,
                self._session.post(
                    replica.run_url,
                    data=orjson.dumps(body),
                    headers={"Content-Type": "application/json"},
                ) as resp,
            ):
                return resp.status, await resp.read(), None
        except TimeoutError as exc:
            message = f"no answer from {replica.url} within {timeout_s} s"
            return 0, b"", _failure(Outcome.TIMEOUT_EXCEEDED, exc, message)
        except (aiohttp.ClientError, OSError) as exc:
            message = f"request to {replica.url} failed: {exc}"
            return 0, b"", _failure(Outcome.AGENT_REQUEST_FAILED, exc, message)


def _failure(outcome: Outcome, exc: BaseException, message: str) -> Failure:
    return Failure(outcome.value, type(exc).__name__, message)


Classified = tuple[Outcome, dict[str, Any] | None, Failure | None]


def classify_response(status: int, raw: bytes) -> Classified:
    """Class an HTTP answer (A3, A5): a result, an agent-reported failure, or ours."""
    if not 200 <= status < 300:
        failure_class = (
            Outcome.AGENT_REQUEST_FAILED
            if status in REQUEST_FAILED_STATUSES
            else Outcome.AGENT_RUN_ERROR
        )
        failure = Failure(
            failure_class.value,
            "ClientResponseError",
            f"agent answered HTTP {status}",
            http_status=status,
            response_body=body_excerpt(raw),
        )
        return failure_class, None, failure
    try:
        result = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return _protocol_violation(status, raw, type(exc).__name__, f"body is not JSON: {exc}")
    if not isinstance(result, dict):
        kind = type(result).__name__
        return _protocol_violation(
            status, raw, "TypeError", f"body is a JSON {kind}, not an object"
        )
    if result.get(NO_PERSIST) is True:
        return Outcome.KILL_SHAPED, result, None
    # A null class is no failure: agents built on pydantic models send the key
    # on every result, and NeMo Gym's collector routes those rows as successes.
    if result.get(FAILURE_CLASS) is not None:
        return Outcome.AGENT_REPORTED_FAILURE, result, None
    return Outcome.SUCCESS, result, None


def _protocol_violation(
    status: int, raw: bytes, type_name: str, message: str
) -> tuple[Outcome, None, Failure]:
    failure = Failure(
        Outcome.PROTOCOL_VIOLATION.value,
        type_name,
        message,
        http_status=status,
        response_body=body_excerpt(raw),
        terminal=True,
    )
    return Outcome.PROTOCOL_VIOLATION, None, failure


def body_excerpt(raw: bytes) -> str:
    """At most 2000 characters decoded from at most the first 8000 bytes, ``…`` if longer."""
    text = raw[:BODY_EXCERPT_BYTES].decode("utf-8", errors="replace")
    if len(raw) > BODY_EXCERPT_BYTES or len(text) > BODY_EXCERPT_CHARS:
        return text[:BODY_EXCERPT_CHARS] + "…"
    return text


def agent_reported_terminal(result: dict[str, Any]) -> bool:
    return result.get(FAILURE_TERMINAL) is True
