"""JSON that several modules read, typed and defined here once (contracts §3, §4, §5).

- ``RunManifest``: ``X_manifest.json``. ``prepare`` writes it at the start of
  each hop, ``Job`` adds the hop's ``last_run`` and delivery history when
  it ends, and the operator commands (``status``, ``report``, ``merge``,
  ``validate``) read it.
- ``LastRun``: the manifest's ``last_run``, what ``dispatcher status`` needs
  to say why rollouts wrote no row.
- Its ``delivery_history``: a list of ``delivery_history.HopDelivery``, one
  per hop (retries, replica health, agents down, our own faults).
- ``JobStatus``: a job's status in service mode (``GET /v1/jobs/<id>``),
  built by ``serve/jobs.py`` and read by ``dispatcher.client``.
- The failure-row keys (``_ng_failure_*``) and the other outcome keys an
  agent's result may carry (``_ng_no_persist``); ``FailureKeys`` types them.

The manifest is a pydantic model: it is read and written a few times a hop,
never on the hot path. Keys it does not know (written by an older or newer
dispatcher, or by hand) are kept, so a read-modify-write leaves them as
they were; dumping writes exactly the keys that were read or set. Failure
rows are not models: one is built per failed attempt and read per line when
millions of rows are scanned on resume, so they stay dicts with a
``TypedDict`` for their keys.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields
from typing import Annotated, Any, Final

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from dispatcher.files.delivery_history import HopDelivery
from dispatcher.lifecycle import JobState
from dispatcher.tasks.keys import (
    DISPATCH_KEY as DISPATCH_KEY,
)
from dispatcher.tasks.keys import (  # the row-key names, re-exported
    FAILURE_CLASS as FAILURE_CLASS,
)
from dispatcher.tasks.keys import (
    FAILURE_HTTP_STATUS as FAILURE_HTTP_STATUS,
)
from dispatcher.tasks.keys import (
    FAILURE_KEYS as FAILURE_KEYS,
)
from dispatcher.tasks.keys import (
    FAILURE_MESSAGE as FAILURE_MESSAGE,
)
from dispatcher.tasks.keys import (
    FAILURE_RESPONSE_BODY as FAILURE_RESPONSE_BODY,
)
from dispatcher.tasks.keys import (
    FAILURE_TERMINAL as FAILURE_TERMINAL,
)
from dispatcher.tasks.keys import (
    FAILURE_TYPE as FAILURE_TYPE,
)
from dispatcher.tasks.keys import (
    NO_PERSIST as NO_PERSIST,
)
from dispatcher.tasks.keys import (
    NOT_DELIVERED as NOT_DELIVERED,
)
from dispatcher.tasks.keys import (
    OMITTED_ROLLOUT as OMITTED_ROLLOUT,
)
from dispatcher.tasks.keys import (
    FailureKeys as FailureKeys,
)

# -- a job's status (§12) -----------------------------------------------------------


@dataclass(frozen=True)
class JobStatus:
    """A job's status as the daemon reports it (``GET /v1/jobs/<id>``)."""

    job_id: str
    state: JobState
    final: bool
    priority: int | None = None
    policy_version: int | None = None
    expected: int | None = None
    done: int = 0
    remaining: int | None = None
    in_flight: int = 0
    committing: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    eta_s: float | None = None
    rows_durable: int = 0
    groups_complete: int = 0
    output: str | None = None
    submitted_at: str | None = None
    error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    # Step control (contracts §13), for a job with a target or a group filter.
    target_groups: int | None = None
    groups_kept: int = 0
    groups_filtered: int = 0
    groups_open: int = 0
    satisfied_at: str | None = None
    # The line of the target-th kept group: ``after=`` it reads the tail.
    satisfied_seq: int | None = None
    # Seconds from the job's submission (or the daemon's restart) to its first kept
    # group, 50%, 90% and 100% of the target.
    timeline: dict[str, float | None] | None = None
    # Per-agent quotas (``target_groups_by_agent``): each agent's quota, its kept groups
    # that count, and the kept groups beyond a met quota (surplus, not counted).
    target_groups_by_agent: dict[str, int] | None = None
    groups_kept_by_agent: dict[str, int] | None = None
    groups_surplus: int = 0
    # A token target (``target_tokens``), and the generated tokens the kept groups hold.
    target_tokens: int | None = None
    tokens_kept: int | None = None
    # The start order (contracts §13, start order): rollouts started unseen and expected, the
    # median of |ln(actual / expected)|; None in input order.
    start_order: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """Its fields as JSON, in order; a dict field is copied (one level: its values
        are JSON read or counted, never changed in place). A tenth of
        ``dataclasses.asdict``'s time, which deep-copies every value: the status
        answers every submit and is saved with every final record."""
        body = {name: getattr(self, name) for name in _STATUS_FIELDS}
        body["state"] = self.state.value
        for name in _STATUS_DICTS:
            if body[name] is not None:
                body[name] = dict(body[name])
        return body

    @classmethod
    def from_json(cls, body: Any) -> JobStatus:
        """Parse a status object; a field not known here is ignored. ValueError if bad."""
        if not isinstance(body, dict):
            raise ValueError(f"job status is not an object: {str(body)[:200]}")
        try:
            return cls(
                job_id=str(body["job_id"]),
                state=JobState(body["state"]),
                final=bool(body["final"]),
                priority=body.get("priority"),
                policy_version=body.get("policy_version"),
                expected=body.get("expected"),
                done=int(body.get("done") or 0),
                remaining=body.get("remaining"),
                in_flight=int(body.get("in_flight") or 0),
                committing=int(body.get("committing") or 0),
                outcomes=dict(body.get("outcomes") or {}),
                eta_s=body.get("eta_s"),
                rows_durable=int(body.get("rows_durable") or 0),
                groups_complete=int(body.get("groups_complete") or 0),
                output=body.get("output"),
                submitted_at=body.get("submitted_at"),
                error=body.get("error"),
                metadata=dict(body.get("metadata") or {}),
                target_groups=body.get("target_groups"),
                groups_kept=int(body.get("groups_kept") or 0),
                groups_filtered=int(body.get("groups_filtered") or 0),
                groups_open=int(body.get("groups_open") or 0),
                satisfied_at=body.get("satisfied_at"),
                satisfied_seq=body.get("satisfied_seq"),
                timeline=dict(body["timeline"]) if body.get("timeline") else None,
                target_groups_by_agent=_mapping(body.get("target_groups_by_agent")),
                groups_kept_by_agent=_mapping(body.get("groups_kept_by_agent")),
                groups_surplus=int(body.get("groups_surplus") or 0),
                target_tokens=body.get("target_tokens"),
                tokens_kept=body.get("tokens_kept"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad job status: {exc!r}") from None


_STATUS_FIELDS = tuple(f.name for f in fields(JobStatus))
_STATUS_DICTS = tuple(f.name for f in fields(JobStatus) if str(f.type).startswith("dict["))


def _mapping(value: Any) -> dict[str, int] | None:
    return {str(k): int(v) for k, v in value.items()} if isinstance(value, dict) else None


# -- failure rows (§5) and agent results (§3) -----------------------------------


def is_terminal(row: dict[str, Any]) -> bool:
    """A failure row (or an agent's result) that must never be retried."""
    return row.get(FAILURE_TERMINAL) is True


def is_omitted(row: dict[str, Any]) -> bool:
    """A sidecar row that records a rollout left without a result (§15): no reader
    counts it as a failure or an attempt, and resume runs the rollout again."""
    return row.get(OMITTED_ROLLOUT) is True


def is_not_delivered(row: dict[str, Any]) -> bool:
    """A failure row of a rollout that never reached an agent (§11): it spends no attempt."""
    return row.get(NOT_DELIVERED) is True


# -- the run manifest (§4) --------------------------------------------------------

HISTORY_KEY: Final = "delivery_history"
HISTORY_HOPS: Final = 50  # hops kept in the manifest; older ones drop off

Count = Annotated[StrictInt, Field(ge=0)]
Seconds = StrictInt | StrictFloat


class LastRun(BaseModel):
    """The manifest's ``last_run``: how the last hop that ended cleanly ended."""

    model_config = ConfigDict(extra="allow", frozen=True)

    # ISO-8601 UTC as the dispatcher writes it; Unix seconds are read too.
    finished_at: StrictStr | Seconds | None = None
    exit_code: StrictInt | None = None
    drained: Count = 0
    cancelled: Count = 0
    kill_shaped: Count = 0
    summary: dict[str, Any] | None = None


class RunManifest(BaseModel):
    """``X_manifest.json``: the run's identity and what its hops recorded."""

    model_config = ConfigDict(extra="allow", frozen=True)

    run_id: StrictStr | None = None
    created_at: StrictStr | None = None
    hops: Count = 0
    hop_started_at: StrictStr | None = None
    dispatcher_version: StrictStr | None = None
    input: StrictStr | None = None
    input_rows: Count | None = None
    input_digest: StrictStr | None = None
    materialized_digest: StrictStr | None = None
    # The task-affecting settings as JSON (prepare.TASK_SETTINGS) and their digest.
    task_settings: dict[str, Any] | None = None
    task_settings_digest: StrictStr | None = None
    max_attempts: Annotated[StrictInt, Field(ge=1)] | None = None
    rollout_timeout_s: Seconds | None = None
    tasks: Count | None = None
    rollouts: Count | None = None
    rollouts_by_agent: dict[str, Count] | None = None
    metrics_url: StrictStr | None = None
    delivery_history: list[HopDelivery] | None = None
    last_run: LastRun | None = None

    @field_validator(HISTORY_KEY, mode="wrap")
    @classmethod
    def _readable_hops(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """The history is what operators read, not what resume needs: a hop that does
        not read (edited by hand, say) is left out rather than stopping the run."""
        try:
            return handler(value)
        except ValidationError:
            if not isinstance(value, list):
                return None
            hops = []
            for hop in value:
                with contextlib.suppress(ValidationError):
                    hops.append(HopDelivery.model_validate(hop))
            return hops

    @classmethod
    def parse(cls, data: Any) -> RunManifest:
        """The manifest the dispatcher resumes from; ``ValidationError`` names a bad key."""
        return cls.model_validate(data)

    @classmethod
    def lenient(cls, data: Any) -> RunManifest | None:
        """For read-only tools, which never fail on a manifest: a bad value reads as absent."""
        if not isinstance(data, dict):
            return None
        for _ in range(len(data) + 1):
            try:
                return cls.model_validate(data)
            except ValidationError as exc:
                data = _without(data, [error["loc"] for error in exc.errors()])
        return None

    def to_json(self) -> dict[str, Any]:
        """The JSON object to write: the keys read or set, unknown ones included."""
        return self.model_dump(exclude_unset=True)

    def ended_hop(self, last_run: LastRun, history_entry: HopDelivery) -> RunManifest:
        """This manifest with a hop's end recorded: its ``last_run`` and delivery history."""
        return self.model_copy(
            update={
                "last_run": last_run,
                HISTORY_KEY: appended_history(self.delivery_history, history_entry),
            }
        )

    def with_metrics_url(self, url: str) -> RunManifest:
        return self.model_copy(update={"metrics_url": url})


def appended_history(hops: list[HopDelivery] | None, entry: HopDelivery) -> list[HopDelivery]:
    """The delivery history with one more hop, the oldest dropped past ``HISTORY_HOPS``."""
    return [*(hops or []), entry][-HISTORY_HOPS:]


def _without(data: dict[str, Any], locations: list[tuple[int | str, ...]]) -> dict[str, Any]:
    """``data`` without each error's key: the key of a nested object, else the top-level one."""
    data = dict(data)
    for loc in locations:
        top, inner = loc[0], loc[1] if len(loc) > 1 else None
        nested = data.get(top) if isinstance(top, str) else None
        if isinstance(nested, dict) and isinstance(inner, str):
            data[str(top)] = {k: v for k, v in nested.items() if k != inner}
        elif isinstance(top, str):
            data.pop(top, None)
    return data


# The attempt cap of a run whose manifest names none (``--max-attempts``' default).
DEFAULT_MAX_ATTEMPTS = 3


def max_attempts_for(given: int | None, manifest: RunManifest | None) -> int:
    """The attempt cap: as given, else the manifest's ``max_attempts``, else the default."""
    if given is not None:
        return given
    recorded = manifest.max_attempts if manifest is not None else None
    return recorded if recorded is not None else DEFAULT_MAX_ATTEMPTS
