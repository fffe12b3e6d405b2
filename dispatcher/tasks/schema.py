"""Every key the dispatcher owns or reads on a row, declared once (contracts §4).

A declaration says where the key appears (the body sent to ``POST /run``, a
success row, a failure row, a result stream's line, a group line, the
aggregate metrics file), who may set it (the dispatcher alone, or an agent's
result too), whether a task row may carry it, whether the Gym drop-in strips it
from the answer it hands back, its type and one line of meaning. Everything
else is read off the declarations:

- ``reserved_result_keys`` (dropped from an agent's result, the dispatcher's
  value wins), ``reserved_input_keys`` (a task row carrying one is refused),
  ``stripped_keys`` (the Gym drop-in's strip list), all made by ``derive``;
- ``facts_decoder``: a msgspec decoder of a row that decodes only the named
  keys, with their declared types, and skips every other value without
  building it (the agent's answer stays bytes); every reader of a run's rows
  (resume, ``status``, ``report``, ``merge``, service mode's groups) reads
  through one, as ``FactsReader`` in keys.py;
- ``docs_table``: the key table of docs/contracts.md §4, which a test
  compares with this file.

Adding a key is one ``declare`` here (and the code that produces its value).
``keys.py`` names each key for the modules that use it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

import msgspec


class Where(enum.Flag):
    """The places a key appears."""

    REQUEST = enum.auto()  # the body of POST /run (contracts §3)
    ROW = enum.auto()  # a success row of X.jsonl
    FAILURE = enum.auto()  # a failure row of X_failures.jsonl
    # A row's line on a results stream (service mode): its row's keys, and these.
    STREAM = enum.auto()
    GROUP = enum.auto()  # a group line of a results stream (service mode)
    AGGREGATE = enum.auto()  # an entry of X_aggregate_metrics.json
    # The Gym drop-in's result for an example it never ran (contracts §15).
    DROP_IN = enum.auto()


class Source(enum.Enum):
    """Who sets a key's value."""

    # The dispatcher alone: an agent's result carrying it is dropped (contracts §3).
    DISPATCHER = "dispatcher"
    # An agent's result may carry it; the dispatcher reads it.
    AGENT = "agent"
    # An agent's result may carry it on a failure it reports, never on a success.
    AGENT_FAILURE = "agent, on a failure"


ROWS = Where.ROW | Where.FAILURE
IDENTITY = Where.REQUEST | ROWS


@dataclass(frozen=True, slots=True)
class Key:
    """One key's declaration."""

    name: str
    type: Any
    where: Where
    source: Source
    # A task row may carry it (its value is the row's own, or replaced as §1 says).
    input_ok: bool
    # The Gym drop-in leaves it out of the agent's answer it hands back (contracts §15).
    stripped: bool
    doc: str


_DECLARED: dict[str, Key] = {}


def declare(
    name: str,
    type_: Any,
    where: Where,
    doc: str,
    *,
    source: Source = Source.DISPATCHER,
    input_ok: bool = True,
    stripped: bool | None = None,
    registry: dict[str, Key] = _DECLARED,
) -> str:
    """Declare a key (in ``registry``: this module's, unless a test brings its own);
    returns its name. ``stripped`` defaults to the dispatcher's own."""
    if name in registry:
        raise ValueError(f"row key {name} declared twice")
    if stripped is None:
        stripped = source is Source.DISPATCHER
    registry[name] = Key(name, type_, where, source, input_ok, stripped, doc)
    return name


# -- identity (contracts §1, §2) -----------------------------------------------------

TASK_INDEX = declare("_ng_task_index", int, IDENTITY, "the task: the row's own, else numbered (§1)")
ROLLOUT_INDEX = declare(
    "_ng_rollout_index", int, IDENTITY, "the repeat of its task, 0 to k - 1 (§1)"
)
ATTEMPT_INDEX = declare(
    "_ng_attempt_index",
    int,
    IDENTITY,
    "the attempt, when > 0: reserved before it is sent, never reused (§5)",
    input_ok=False,
)
ROLLOUT_ID = declare(
    "_ng_rollout_id",
    str,
    IDENTITY,
    "the rollout's stable id: the task row's own, else task-rollout; no -aN (§2)",
)
AGENT_REF = declare(
    "agent_ref",
    dict[str, Any],
    IDENTITY | Where.AGGREGATE,
    '`{"name": AGENT}` (§1)',
)
CAPTURE_ID = declare(
    "_ng_capture_id",
    str,
    Where.REQUEST,
    "the id an agent's model calls are captured under (§2)",
    input_ok=False,
)
ENVIRONMENT_SERVER = declare(
    "_ng_environment_server",
    str,
    IDENTITY | Where.AGGREGATE,
    "the Gym environment server that fronts the agent: the row's own, else the Gym config's (§15)",
)
RESULT_TYPE = declare(
    "_ng_result_type",
    str,
    ROWS,
    "that environment server's implementation, the kind of result the row holds (§15)",
)
RUN_ID = declare("_ng_run_id", str, ROWS, "the run's id (§15)")
DISPATCH_KEY = declare(
    "_ng_dispatch",
    dict[str, Any],
    ROWS,
    "how the dispatcher saw the attempt: rollout_id, replica, started_at, duration_s (§4)",
    input_ok=False,
)

# -- failures (contracts §5, §11, §15) --------------------------------------------------

FAILURE_CLASS = declare(
    "_ng_failure_class",
    str,
    Where.FAILURE,
    "the failure's class (§5)",
    source=Source.AGENT,
    input_ok=False,
)
FAILURE_TYPE = declare(
    "_ng_failure_type",
    str,
    Where.FAILURE,
    "the exception's or the error's name (§5)",
    source=Source.AGENT,
    input_ok=False,
)
FAILURE_MESSAGE = declare(
    "_ng_failure_message",
    str,
    Where.FAILURE,
    "one line for a human (§5)",
    source=Source.AGENT,
    input_ok=False,
)
FAILURE_HTTP_STATUS = declare(
    "_ng_failure_http_status",
    int | None,
    Where.FAILURE,
    "the agent's HTTP status, or null (§5)",
    source=Source.AGENT,
    input_ok=False,
)
FAILURE_RESPONSE_BODY = declare(
    "_ng_failure_response_body",
    str | None,
    Where.FAILURE,
    "the start of the agent's body, or null (§5)",
    source=Source.AGENT,
    input_ok=False,
)
FAILURE_TERMINAL = declare(
    "_ng_failure_terminal",
    bool,
    Where.FAILURE,
    "true: never retried (§5)",
    source=Source.AGENT_FAILURE,
    input_ok=False,
)
# Whether a rollout reached an agent is the dispatcher's verdict: an agent
# claiming otherwise would make resume never count its failure.
NOT_DELIVERED = declare(
    "_ng_failure_not_delivered",
    bool,
    Where.FAILURE,
    "true: not delivered before the delivery deadline; spends no attempt (§11)",
    input_ok=False,
)
FAILURE_STAGE = declare(
    "_ng_failure_stage",
    str,
    Where.FAILURE,
    "where the agent's failure happened: kept in the failure record when it is Gym's stage (§15)",
    source=Source.AGENT,
)
FAILURE_RECORD = declare(
    "_ng_failure_record", dict[str, Any], Where.FAILURE, "Gym's typed failure record (§15)"
)
OMITTED_ROLLOUT = declare(
    "_ng_omitted_rollout",
    bool,
    Where.FAILURE,
    "true: a sidecar row of a rollout left without a result, never a failure (§15)",
)
OMITTED_CAUSE = declare(
    "_ng_omitted_cause", str, Where.FAILURE, "why that rollout was left without a result (§15)"
)
# The Gym drop-in's mark on an example it never ran, beside ``_ng_no_persist`` (Gym's own).
DISPATCH_DRAINED = declare(
    "_ng_dispatch_drained",
    bool,
    Where.DROP_IN,
    "true: the Gym drop-in never ran the example, as Gym's collector marks it (§15)",
)
# An agent's "write nothing" (a kill-shaped interruption): read from a result, never written.
NO_PERSIST = declare(
    "_ng_no_persist",
    bool,
    Where(0),
    "an agent's result asking that nothing be written (§3)",
    source=Source.AGENT,
    input_ok=False,
)

# -- attachments (contracts §6, §7) -------------------------------------------------

MODEL_CALL_CAPTURE = declare(
    "ng_model_call_capture", dict[str, Any], ROWS, "the captured model calls (§6)"
)
PERF = declare("ng_perf", dict[str, Any], ROWS, "per-rollout performance (§7)")
TRAJECTORY = declare(
    "ng_trajectory",
    dict[str, Any],
    ROWS,
    "the trajectory: the agent's, normalized, or built from capture (§7)",
    source=Source.AGENT,
    stripped=True,
)

AGENT_OBSERVATIONS = declare(
    "ng_agent_observations",
    Any,
    Where.ROW,
    "the agent's observation bundle, joined to the captured calls for the trajectory (§7)",
    source=Source.AGENT,
)

# -- service mode (contracts §12) -----------------------------------------------------

POLICY_VERSION_START = declare(
    "_ng_policy_version_start",
    int,
    Where.ROW,
    "the policy version when the rollout started (§12)",
)
POLICY_VERSION_END = declare(
    "_ng_policy_version_end",
    int,
    Where.ROW,
    "the policy version when its row was written (§12)",
)
# A second ``_ng_seq`` on a streamed line is the one JSON parsers keep: a client
# resuming with ``after=`` would skip or repeat rows, so it is the dispatcher's alone.
SEQ = declare(
    "_ng_seq", int, Where.STREAM | Where.GROUP, "the line's number on the results stream (§12)"
)
FAILURE_SEQ = declare(
    "_ng_failure_seq",
    int,
    Where.STREAM,
    "a failure line's number on the results stream, apart from the rows' (§12)",
)
GROUP_TASK = declare("task_index", int, Where.GROUP, "the group's task (§12)")
GROUP_ROWS = declare(
    "rows", list[int], Where.GROUP, "its rows' line numbers in the job's output (§12)"
)
GROUP_FAILURES = declare("failures", int, Where.GROUP, "its rollouts that ended failed (§12)")
GROUP_FILTERED = declare(
    "filtered", bool, Where.GROUP, "true: the job's group filter left it out (§13)"
)
GROUP_AGENT = declare(
    "agent", str, Where.GROUP, "its task's agent, with a target that reads it (§13)"
)
GROUP_TOKENS = declare(
    "tokens", int, Where.GROUP, "its rows' generated tokens, with a target that reads them (§13)"
)
GROUP_SURPLUS = declare(
    "surplus", bool, Where.GROUP, "true: kept after its agent's quota was met (§13)"
)

# -- the agent's keys the dispatcher reads ---------------------------------------------

REWARD = declare(
    "reward",
    Any,
    Where.ROW,
    "the agent's reward: step control's filter and the coverage file read it (§13, §15)",
    source=Source.AGENT,
)
MASK_SAMPLE = declare(
    "mask_sample",
    Any,
    Where.ROW,
    "the agent's true: a masked sample, counted apart in coverage (§15)",
    source=Source.AGENT,
)


# -- what follows from the declarations ------------------------------------------------

KEYS: tuple[Key, ...] = tuple(_DECLARED.values())


def key(name: str) -> Key:
    return _DECLARED[name]


@dataclass(frozen=True, slots=True)
class Derived:
    """The key sets read off a list of declarations."""

    # What an agent's result may not set: the dispatcher writes them into every row it builds.
    reserved_result: frozenset[str]
    # On a success, also what an agent may say only of a failure it reports.
    reserved_success: frozenset[str]
    # What a task row may not carry: an agent that echoes its input would forge an outcome.
    reserved_input: frozenset[str]
    # What the Gym drop-in leaves out of the agent's answer.
    stripped: frozenset[str]
    # The flat failure keys (``FailureKeys`` in keys.py types them).
    failure_flat: frozenset[str]
    # The row keys; the group line's are not: a result's "rows" or "failures" are the agent's.
    on_rows: frozenset[str]


def derive(keys: Iterable[Key]) -> Derived:
    """The key sets of ``keys`` (the module's constants are those of ``KEYS``)."""
    keys = tuple(keys)

    def names(keep: Callable[[Key], bool]) -> frozenset[str]:
        return frozenset(k.name for k in keys if keep(k))

    on_rows = names(lambda k: k.where != Where.GROUP)
    reserved = names(lambda k: k.source is Source.DISPATCHER) & on_rows
    return Derived(
        reserved_result=reserved,
        reserved_success=reserved | names(lambda k: k.source is Source.AGENT_FAILURE),
        reserved_input=names(lambda k: not k.input_ok),
        stripped=names(lambda k: k.stripped) & on_rows,
        failure_flat=names(
            lambda k: (
                k.where == Where.FAILURE
                and k.name.startswith("_ng_failure_")
                and k.name not in (FAILURE_RECORD, FAILURE_STAGE)
            )
        ),
        on_rows=on_rows,
    )


_DERIVED = derive(KEYS)
RESERVED_RESULT_KEYS = _DERIVED.reserved_result
RESERVED_SUCCESS_KEYS = _DERIVED.reserved_success
RESERVED_INPUT_KEYS = _DERIVED.reserved_input
STRIPPED_KEYS = _DERIVED.stripped
FAILURE_FLAT_KEYS = _DERIVED.failure_flat


def facts_decoder(
    names: Iterable[str], keys: Iterable[Key] = KEYS, shapes: Mapping[str, Any] | None = None
) -> msgspec.json.Decoder[dict[str, Any]]:
    """A decoder of a JSON object that keeps only ``names``, decoded as declared in
    ``keys``, or as ``shapes`` gives (a narrower type, whose own unnamed fields are
    skipped too; or a key of the agent's that is not declared); every other value is
    skipped without being built. A type that does not match is a
    ``msgspec.ValidationError`` (a ``DecodeError``)."""
    declared = {k.name: k for k in keys}
    shapes = shapes or {}
    fields = {name: shapes[name] if name in shapes else declared[name].type for name in names}
    shape: Any = TypedDict("Facts", fields, total=False)  # type: ignore[misc]
    return msgspec.json.Decoder(shape)


_PLACES = (
    (Where.REQUEST, "request"),
    (Where.ROW, "row"),
    (Where.FAILURE, "failure row"),
    (Where.STREAM, "stream line"),
    (Where.GROUP, "group line"),
    (Where.AGGREGATE, "aggregate"),
    (Where.DROP_IN, "drop-in result"),
)


def _type_name(type_: Any) -> str:
    if type_ is Any:
        return "any"
    names = {str: "string", int: "integer", bool: "boolean", type(None): "null"}
    if type_ in names:
        return names[type_]
    origin = getattr(type_, "__origin__", None)
    if origin is dict:
        return "object"
    if origin is list:
        return "array"
    return " or ".join(_type_name(arg) for arg in type_.__args__)


def docs_table(keys: Iterable[Key] = KEYS) -> str:
    """The key table of docs/contracts.md §4, as Markdown."""
    lines = [
        "| key | type | where | set by | in a task row | Gym drop-in | meaning |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    keys = tuple(keys)
    row_keys = derive(keys).on_rows
    for k in keys:
        where = ", ".join(label for flag, label in _PLACES if flag in k.where) or "agent result"
        on_rows = k.name in row_keys
        task_row = ("allowed" if k.input_ok else "refused") if on_rows else "-"
        drop_in = ("stripped" if k.stripped else "kept") if on_rows else "-"
        lines.append(
            f"| `{k.name}` | {_type_name(k.type)} | {where} | {k.source.value} | {task_row} "
            f"| {drop_in} | {k.doc} |"
        )
    return "\n".join(lines) + "\n"
