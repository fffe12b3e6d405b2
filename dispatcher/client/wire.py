"""What the client and the daemon exchange: errors, the job status, the admission
pause, URLs and bodies, and the NDJSON results stream read as exact positions (pure:
no I/O)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

from dispatcher import jsonx
from dispatcher.files import contracts
from dispatcher.lifecycle import JobState
from dispatcher.tasks.keys import SEQ
from dispatcher.tasks.schema import FAILURE_SEQ

# A failure without an HTTP status, as a trainer's typed retry budgets read ``.status``:
# the infrastructure's (the daemon or an agent never answered) or the task's data.
INFRASTRUCTURE_STATUS = 503
DATA_STATUS = 422


class ClientError(Exception):
    """The daemon refused a call (its HTTP status and one-line error), or never answered.

    ``status`` is always an integer (contracts §12): the HTTP status, or 503 when
    there was none (no answer: the infrastructure's failure); ``http_status`` is
    the status as it came, None without one. It pickles (Ray carries it).
    """

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(f"{status}: {message}" if status is not None else message)
        self.http_status = status
        self.status = status if status is not None else INFRASTRUCTURE_STATUS
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        # The default pickles the formatted message as the only argument.
        return (type(self), (self.http_status, self.message), self.__dict__)


class Unauthorized(ClientError):
    """A 401: the daemon wants a bearer token, and none was sent or it is wrong."""


TOKEN_ENV = "DISPATCHER_API_TOKEN"


def unauthorized(message: str, token_sent: bool) -> Unauthorized:
    """The 401's error, saying which of the two it is and where a token comes from."""
    if token_sent:
        why = "the daemon refused the API token: it is wrong"
    else:
        why = f"the daemon wants an API token: none was given (token= or {TOKEN_ENV})"
    return Unauthorized(401, f"{why} ({message})")


def resolve_token(token: str | None) -> str | None:
    """``token``, else ``DISPATCHER_API_TOKEN``; white space around it dropped, empty is none."""
    value = token if token is not None else os.environ.get(TOKEN_ENV)
    if value is None:
        return None
    return value.strip() or None


class JobStatus(contracts.JobStatus):
    """A job's status (``dispatcher.files.contracts.JobStatus``); a bad one is a ``ClientError``."""

    @classmethod
    def from_json(cls, body: Any) -> JobStatus:
        try:
            status = contracts.JobStatus.from_json(body)
        except ValueError as exc:
            raise ClientError(None, f"from the daemon: {exc}") from None
        return cls(**vars(status))


@dataclass(frozen=True)
class Admission:
    """The daemon's admission pause and what is in flight (``/v1/admission``)."""

    paused: bool
    in_flight: int
    idle: bool
    reason: str | None = None
    ttl_remaining_s: float | None = None

    @classmethod
    def from_json(cls, body: Any) -> Admission:
        try:
            return cls(
                paused=bool(body["paused"]),
                in_flight=int(body["in_flight"]),
                idle=bool(body["idle"]),
                reason=body.get("reason"),
                ttl_remaining_s=body.get("ttl_remaining_s"),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ClientError(None, f"from the daemon: bad admission answer: {exc!r}") from None


# --- pure pieces: URLs, bodies, the NDJSON stream ----------------------------------


def job_path(job_id: str, suffix: str = "") -> str:
    """``/v1/jobs/<id>[suffix]`` with the id quoted as one path segment."""
    return f"/v1/jobs/{quote(job_id, safe='')}{suffix}"


def results_query(
    after: int, group: bool, wait: bool, filtered: bool = False, failures_after: int | None = None
) -> str:
    """The query string of a results request (``failures_after``: failure lines too)."""
    flag = {True: "true", False: "false"}
    query = {"after": str(after), "group": flag[group], "wait": flag[wait]}
    if filtered:
        query["filtered"] = "true"
    if failures_after is not None:
        query.update(failures="true", failures_after=str(failures_after))
    return urlencode(query)


# Fields a caller may give as any mapping: the body holds a dict of each (a JSON object).
_MAPPING_FIELDS = frozenset({"metadata", "responses_create_params", "target_groups_by_agent"})


def submit_body(
    rows: Sequence[Mapping[str, Any]] | None,
    input: str | os.PathLike[str] | None,
    **fields: Any,
) -> dict[str, Any]:
    """The JSON body of ``POST /v1/jobs``: only the fields given (the daemon validates)."""
    body: dict[str, Any] = {
        k: dict(v) if k in _MAPPING_FIELDS else v for k, v in fields.items() if v is not None
    }
    if rows is not None:
        body["rows"] = list(rows)
    if input is not None:
        body["input"] = os.fspath(input)
    return body


def error_message(raw: bytes, reason: str) -> str:
    """The daemon's one-line ``{"error": ...}``, or the start of whatever came instead."""
    try:
        body = jsonx.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return str(body["error"])
    text = raw.decode("utf-8", "replace").strip().splitlines()
    return text[0][:200] if text else reason


class NdjsonSplitter:
    """Complete lines out of a byte stream cut anywhere; blank lines (keep-alives) skipped."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[bytes]:
        # Search only the new bytes: a 20 MB row in 64 KB chunks stays linear.
        start = len(self._buffer)
        self._buffer += chunk
        newline = self._buffer.find(b"\n", start)
        lines: list[bytes] = []
        begin = 0
        while newline >= 0:
            line = bytes(self._buffer[begin:newline]).strip()
            if line:
                lines.append(line)
            begin = newline + 1
            newline = self._buffer.find(b"\n", begin)
        del self._buffer[:begin]
        return lines

    @property
    def partial(self) -> bool:
        """Whether bytes of an unfinished line are held (a stream cut mid-line)."""
        return bool(self._buffer.strip())


@dataclass
class StreamPosition:
    """Where a results stream stands: the last ``_ng_seq`` yielded, the final state once seen."""

    last_seq: int = 0
    #: The ``_ng_failure_seq`` of the last failure line yielded (a stream with failures).
    last_failure_seq: int = 0
    final_state: JobState | None = None
    #: Whether the daemon has answered 200 for this stream once.
    connected: bool = False

    def accept(self, line: bytes) -> dict[str, Any] | None:
        """The row (or group) to yield, or None for a repeat or the end line."""
        try:
            item = jsonx.loads(line)
        except ValueError:
            raise ClientError(None, f"results line is not JSON: {line[:200]!r}") from None
        if not isinstance(item, dict):
            raise ClientError(None, f"results line is not an object: {line[:200]!r}")
        if "failure" in item and FAILURE_SEQ in item:
            return self._failure(item, line)
        seq = item.get(SEQ)
        if seq is None:
            if "end" not in item:
                raise ClientError(None, f"results line without _ng_seq: {line[:200]!r}")
            self.final_state = _end_state(item["end"])
            return None
        if not isinstance(seq, int):
            raise ClientError(None, f"results line with a bad _ng_seq: {seq!r}")
        if seq <= self.last_seq:
            return None  # a peer that resent what we already yielded: never twice
        self.last_seq = seq
        return item

    def _failure(self, item: dict[str, Any], line: bytes) -> dict[str, Any] | None:
        seq = item[FAILURE_SEQ]
        if not isinstance(seq, int) or not isinstance(item["failure"], dict):
            raise ClientError(None, f"results failure line malformed: {line[:200]!r}")
        if seq <= self.last_failure_seq:
            return None
        self.last_failure_seq = seq
        return item


def _end_state(end: Any) -> JobState:
    """The final state an end line names: ``"done"``, or a status object holding it."""
    state = end.get("state") if isinstance(end, dict) else end
    try:
        return JobState(str(state))
    except ValueError:
        raise ClientError(None, f"results end line with an unknown state: {end!r}") from None
