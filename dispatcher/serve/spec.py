"""A job's body (contracts §12, §13), validated whole before anything touches the disk.

``JobSpec.parse`` turns a request body into a spec or a ``BadJob`` whose one
line names the field. ``check_tasks`` then runs the rows (or the task file)
through the same validation as ``dispatcher run`` into a scratch file, so a
malformed row is a 400 naming ``rows[i]`` and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from dispatcher import jsonx
from dispatcher.admission.pause import DEFAULT_TTL_S, MAX_TTL_S
from dispatcher.errors import ConfigError
from dispatcher.serve.bodies import BadBody, load_json
from dispatcher.settings.config import RunSettings
from dispatcher.settings.serve import ServeLimits
from dispatcher.tasks.keys import (
    AGENT_REF,
    MAX_REPEATS,
    MAX_ROLLOUT_ID_LEN,
    ROLLOUT_ID_PATTERN,
    TASK_INDEX,
)
from dispatcher.tasks.materialize import materialize


class BadJob(BadBody):
    """A job body that cannot be run: a 400 with this one-line message."""


class TooBig(BadJob):
    """A job whose files would outgrow ``--max-job-bytes``: a 413."""


# The job-body fields that set a target (``policy.policy_of``): at most one.
TARGETS = ("target_groups", "target_groups_by_agent", "target_tokens")
GROUP_TARGETS = (["target_groups"], ["target_groups_by_agent"])
# Validating a record read back from ``job.json``: its rows are in its own file.
STORED = {"stored": True}
# A job's metadata is kept with its status for the daemon's life: a bound.
MAX_METADATA_BYTES = 64 * 1024
# A job's own attempt cap: every attempt is a failure row kept on disk, so a bound.
MAX_JOB_ATTEMPTS = 100
MAX_JOB_IN_FLIGHT = 1_000_000


class JobSpec(BaseModel):
    """What a trainer submits; ``job_id`` makes the submission idempotent."""

    # Strict: an integer is an integer (not true, "3" or 2.0).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    job_id: str | None = Field(
        default=None, pattern=ROLLOUT_ID_PATTERN, max_length=MAX_ROLLOUT_ID_LEN
    )
    rows: list[dict[str, Any]] | None = None
    input: str | None = None
    num_repeats: int | None = Field(default=None, ge=1, le=MAX_REPEATS)
    default_agent: str | None = None
    policy_version: int | None = Field(default=None, ge=0)
    priority: int = 0
    metadata: dict[str, Any] = Field(default_factory=dict)
    # Merged shallowly over the daemon's --responses-create-params, then over each row's.
    responses_create_params: dict[str, Any] | None = None
    # Step control (contracts §13, ``policy.py``): at most one target.
    target_groups: int | None = Field(default=None, ge=1)
    target_groups_by_agent: dict[str, Annotated[int, Field(ge=1)]] | None = Field(
        default=None, min_length=1
    )
    target_tokens: int | None = Field(default=None, ge=1)
    overprovision: float | None = Field(default=None, ge=1.0)
    on_target: Literal["finish", "cancel"] | None = None
    group_filter: Literal["nonzero_reward_std"] | None = None
    # Counted failed attempts that make one of the job's rollouts final, in place of
    # the daemon's --max-attempts: 1 when the caller retries itself (contracts §12).
    max_attempts: int | None = Field(default=None, ge=1, le=MAX_JOB_ATTEMPTS)
    # At most this many of the job's rollouts at agents at once: a freed one starts
    # the job's next (a trainer's window of resident tasks, as one job).
    max_in_flight: int | None = Field(default=None, ge=1, le=MAX_JOB_IN_FLIGHT)
    # At most this many of the job's rollouts started until the caller admits more
    # (``POST /v1/jobs/<id>/admit``, ``window.py``): a window freed as results are taken.
    admit: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _rows_or_input(self, info: ValidationInfo) -> JobSpec:
        if info.context == STORED and self.rows is None:
            return self  # its rows are in the job's folder
        if (self.rows is None) == (self.input is None):
            raise ValueError("give exactly one of rows or input")
        if self.rows is not None and not self.rows:
            raise ValueError("rows: a job needs at least one row")
        return self

    @model_validator(mode="after")
    def _step_needs_a_target(self) -> JobSpec:
        targets = [name for name in TARGETS if getattr(self, name) is not None]
        if len(targets) > 1:
            raise ValueError(f"{targets[1]}: not with {targets[0]} (a job has one target)")
        if not targets and self.on_target is not None:
            raise ValueError("on_target: only with a target (" + ", ".join(TARGETS) + ")")
        if self.overprovision is not None and targets[:1] not in GROUP_TARGETS:
            raise ValueError("overprovision: only with target_groups or target_groups_by_agent")
        return self

    @model_validator(mode="after")
    def _small_metadata(self) -> JobSpec:
        if self.metadata and len(jsonx.dumps(self.metadata)) > MAX_METADATA_BYTES:
            raise ValueError(f"metadata: more than {MAX_METADATA_BYTES} bytes of JSON")
        return self

    @classmethod
    def parse(cls, body: bytes, agents: dict[str, list[str]]) -> JobSpec:
        """The spec of a request body (blocking: big bodies take a while); ``BadJob``
        naming the field when it is not one."""
        try:
            data = load_json(body)
        except BadBody as exc:
            raise BadJob(str(exc)) from None
        if not isinstance(data, dict):
            raise BadJob("body: must be a JSON object")
        try:
            spec = cls.model_validate(data)
        except ValidationError as exc:
            raise BadJob(first_error(exc)) from None
        if spec.default_agent is not None and spec.default_agent not in agents:
            known = ", ".join(sorted(agents))
            raise BadJob(f"default_agent: unknown agent {spec.default_agent!r} (known: {known})")
        for agent in spec.target_groups_by_agent or {}:
            if agent not in agents:
                known = ", ".join(sorted(agents))
                raise BadJob(f"target_groups_by_agent.{agent}: unknown agent (known: {known})")
        return spec

    def rooted(self, root: Path, state_dir: Path) -> JobSpec:
        """The spec with ``input`` resolved (symlinks, ``..``) inside ``root``, else ``BadJob``.

        A relative ``input`` is relative to ``root``. The resolved path is what
        the job opens at every hop. Files of the state directory (other
        jobs' rows) are refused wherever it is. The message never says more
        of the path than the trainer sent, nor anything of the file.
        """
        if self.input is None:
            return self
        try:
            path = (root / self.input).resolve()
            inside = path.is_relative_to(root) and not path.is_relative_to(state_dir.resolve())
        except (OSError, RuntimeError, ValueError):
            inside = False  # a symlink loop, a NUL byte: nowhere a file can be
        if not inside:
            raise BadJob(
                f"input: must resolve inside the input root {root} (--input-root), "
                "symlinks and '..' followed, and not into the state directory"
            )
        return self.model_copy(update={"input": str(path)})

    def with_id(self) -> JobSpec:
        """The spec with its ``job_id``, one made up when the trainer gave none."""
        if self.job_id is not None:
            return self
        return self.model_copy(update={"job_id": f"job-{uuid.uuid4().hex[:12]}"})

    def digest(self) -> str:
        """The job's identity: the same body again is the same job. Fields added
        since the first release count only when given, so the record of a job
        submitted before them keeps its digest."""
        unset = {name for name in _LATER_FIELDS if getattr(self, name) is None}
        data = self.model_dump(mode="json", exclude=unset)
        return hashlib.sha256(jsonx.dumps(data, option=orjson.OPT_SORT_KEYS)).hexdigest()

    def settings(self, base: RunSettings, input_path: Path, output: Path) -> RunSettings:
        """The job's run settings: the daemon's, with this job's files and task keys.

        A copy of the daemon's settings with the job's fields set: each of them is
        validated by the body's own model (``num_repeats``, ``max_attempts``), its
        agent checked against the daemon's, and the merged ``responses_create_params``
        is a dict. (Validating every setting again, model_dump then model_validate,
        took more CPU than the rest of a job's start on the loop.) A job whose agent
        the daemon no longer has (a record read back) is validated whole, and its
        error is the one it always was."""
        values: dict[str, Any] = {
            # A job resumes its own files at every hop: never moved aside (fresh).
            "input": Path(input_path),
            "output": Path(output),
            "shard": None,
            "fresh": False,
        }
        if self.num_repeats is not None:
            values["num_repeats"] = self.num_repeats
        if self.default_agent is not None:
            values["default_agent"] = self.default_agent
        if self.max_attempts is not None:
            values.update(max_attempts=self.max_attempts, extend_attempts=0)
        if self.responses_create_params is not None:
            values["responses_create_params"] = {
                **base.responses_create_params,
                **self.responses_create_params,
            }
        if self.default_agent is not None and self.default_agent not in base.agents:
            return RunSettings.model_validate({**base.model_dump(), **values})
        return base.model_copy(update=values)


# Fields that a digest leaves out when they are not given (see ``JobSpec.digest``).
_LATER_FIELDS = (
    "responses_create_params",
    "target_groups",
    "target_groups_by_agent",
    "target_tokens",
    "overprovision",
    "on_target",
    "group_filter",
    "max_attempts",
)


class AdmissionChange(BaseModel):
    """A body of ``POST /v1/admission`` (contracts §13): pause with a TTL, or resume."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    paused: bool
    ttl_s: float = Field(default=DEFAULT_TTL_S, gt=0, le=MAX_TTL_S)
    reason: str | None = Field(default=None, max_length=1000)

    @classmethod
    def parse(cls, body: bytes) -> AdmissionChange:
        """The change a request body asks for; ``BadBody`` naming the field when it is not one."""
        return _parse_body(cls, body, "POST /v1/admission")


class AdmitChange(BaseModel):
    """A body of ``POST /v1/jobs/<id>/admit`` (contracts §12): the rollouts the job may
    have started in all, a running total (``window.py``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    admit: int = Field(ge=0, le=2**63 - 1)

    @classmethod
    def parse(cls, body: bytes, of: str = "POST /v1/jobs/<id>/admit") -> AdmitChange:
        """A body (or an admit channel's message, ``of``), as a change; ``BadBody`` naming
        the field when it is not one."""
        return _parse_body(cls, body, of)


# A policy version is a step counter: 64 bits, as the files and the metric hold it.
MAX_POLICY_VERSION = 2**63 - 1


class PolicyChange(BaseModel):
    """A body of ``POST /v1/policy`` (contracts §12): the trainer's new version; a lower
    one than the current only with ``force`` (a trainer restarted from an
    older checkpoint), since a version that goes back unasked is a mistake."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    version: int = Field(ge=0, le=MAX_POLICY_VERSION)
    force: bool = False

    @classmethod
    def parse(cls, body: bytes) -> PolicyChange:
        """The change a request body asks for; ``BadBody`` naming the field when it is not one."""
        return _parse_body(cls, body, "POST /v1/policy")


_Body = TypeVar("_Body", bound=BaseModel)


def _parse_body(model: type[_Body], body: bytes, of: str) -> _Body:
    """A JSON object body as ``model``; ``BadBody`` naming the field when it is not one."""
    data = load_json(body)
    if not isinstance(data, dict):
        raise BadBody("body: must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise BadBody(first_error(exc, of)) from None


def first_error(exc: ValidationError, of: str = "a job") -> str:
    """The first problem pydantic found, on one line, naming the field."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "body"
    if error["type"] == "extra_forbidden":
        return f"{where}: not a field of {of}" if of != "a job" else f"{where}: not a job field"
    message = " ".join(str(error["msg"]).removeprefix("Value error, ").split())
    if not error["loc"] and message.partition(": ")[0] in JobSpec.model_fields:
        return message  # a check of the whole body that names its field
    return f"{where}: {message}"


def _keep_small(path: Path) -> None:
    """Empty a file a check leaves, if it is bigger than ``KEPT_BYTES``."""
    with contextlib.suppress(FileNotFoundError):
        if path.stat().st_size > KEPT_BYTES:
            path.write_bytes(b"")


# What a check leaves in its scratch folder at most (a bigger file is emptied).
KEPT_BYTES = 1 << 20
# What the submitted rows are called in a check's errors, before ``_rows_named``.
SUBMITTED_ROWS = "rows"


def check_tasks(
    spec: JobSpec,
    settings: Callable[[Path], RunSettings],
    scratch: Path,
    limits: ServeLimits,
) -> None:
    """Validate the job's rows or task file as ``dispatcher run`` would (blocking),
    its size against the daemon's bounds, and its ``target_groups`` against its tasks.

    Submitted rows are checked as the lines of a task file in memory, read from
    no file: a check creates, truncates and removes no file on the state
    directory's disk, each a wait for its journal when the disk is busy, and a
    job of a few rows is checked in a fraction of a millisecond. Only a check of
    quotas writes there (in a folder of ``scratch`` of the calling thread's own),
    what it leaves at most ``KEPT_BYTES``.
    """
    folder = scratch / f"check-{threading.get_ident()}"
    lines = None
    with contextlib.ExitStack() as stack:
        if spec.rows is not None:
            # The name its rows' errors are given (``_rows_named``): no file is.
            tasks = Path(SUBMITTED_ROWS)
            lines = [jsonx.dumps(row) for row in spec.rows]
        else:
            tasks = _readable_input(spec.input)
        # Only a check of quotas reads the materialized rows back.
        quotas = spec.target_groups_by_agent
        materialized = None
        if quotas is not None:
            folder.mkdir(parents=True, exist_ok=True)
            materialized = folder / "m.jsonl"
            stack.callback(_keep_small, materialized)
        try:
            run_settings = settings(tasks)
            _check_size(spec, tasks, run_settings, limits, lines)
            task_spec = run_settings.materialize_spec(None)
            # A task file's every line is a task: it names its model call. A
            # file that is not one (a log, a config) is refused at its first line.
            task_spec = replace(task_spec, require_params=spec.input is not None)
            result = materialize(task_spec, materialized, durable=False, lines=lines)
        except ConfigError as exc:
            raise BadJob(_rows_named(str(exc), tasks, spec.rows is not None)) from None
        if quotas is not None:
            assert materialized is not None
            _check_quotas(quotas, _tasks_by_agent(materialized))
    if spec.target_groups is not None and spec.target_groups > result.tasks:
        raise BadJob(
            f"target_groups: {spec.target_groups} is more than the job's {result.tasks} tasks"
        )


def _check_quotas(quotas: dict[str, int], tasks: Counter[str]) -> None:
    """Every agent of the job's tasks has a quota, and every quota is within its tasks."""
    for agent in sorted(tasks):
        if agent not in quotas:
            raise BadJob(f"target_groups_by_agent: no quota for agent {agent!r} of the job's rows")
    for agent, quota in quotas.items():
        if quota > tasks[agent]:
            raise BadJob(
                f"target_groups_by_agent.{agent}: {quota} is more than the job's "
                f"{tasks[agent]} tasks of that agent"
            )


def _tasks_by_agent(materialized: Path) -> Counter[str]:
    """How many tasks each agent has in a materialized file (blocking)."""
    seen: dict[int, str] = {}
    with materialized.open("rb") as f:
        for line in f:
            row = jsonx.loads(line)
            seen[row[TASK_INDEX]] = row[AGENT_REF]["name"]
    return Counter(seen.values())


def _check_size(
    spec: JobSpec,
    tasks: Path,
    settings: RunSettings,
    limits: ServeLimits,
    lines: list[bytes] | None,
) -> None:
    """Rows x repeats and the bytes the job materializes against the daemon's bounds,
    before anything of that size is written: one request must not fill the disk.
    ``lines``: the submitted rows' (the task file is ``tasks`` without them)."""
    repeats = settings.num_repeats
    most = max(repeats.values(), default=1) if isinstance(repeats, dict) else repeats
    rows = len(spec.rows) if spec.rows is not None else _lines(tasks)
    if rows * most > limits.max_job_rollouts:
        raise BadJob(
            f"num_repeats: {rows} rows x {most} repeats = {rows * most} rollouts, more than "
            f"the daemon's --max-job-rollouts {limits.max_job_rollouts}"
        )
    size = sum(map(len, lines)) + len(lines) if lines is not None else tasks.stat().st_size
    _check_bytes(size, rows, most, _params_bytes(settings), limits)


def _params_bytes(settings: RunSettings) -> int:
    """The bytes of the ``responses_create_params`` merged into every row of the job."""
    params = settings.responses_create_params
    return len(jsonx.dumps(params)) if params else 0


def _check_bytes(
    rows_bytes: int, rows: int, repeats: int, params: int, limits: ServeLimits
) -> None:
    """What the job materializes, counted as (its rows' bytes + the merged params once
    per row) x repeats: its materialized file's size but for the few keys each line
    gains (a row whose own params share keys with them takes less)."""
    bound = limits.max_job_bytes
    plain = rows_bytes * repeats
    if plain > bound:
        raise TooBig(
            f"num_repeats: {rows_bytes} bytes of rows x {repeats} repeats = {plain} "
            f"bytes, more than the daemon's --max-job-bytes {bound}"
        )
    size = plain + params * rows * repeats
    if size > bound:
        raise TooBig(
            f"responses_create_params: {params} bytes merged into each of {rows} rows x "
            f"{repeats} repeats, with {rows_bytes} bytes of rows, = {size} bytes, more than "
            f"the daemon's --max-job-bytes {bound}"
        )


def _lines(path: Path) -> int:
    """How many lines a file holds (blocking), a last one without a newline included."""
    count = 0
    last = b"\n"
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def _readable_input(value: str | None) -> Path:
    assert value is not None
    path = Path(value)
    if not path.is_file() or not os.access(path, os.R_OK):
        raise BadJob(f"input: {value!r} is not a readable file")
    return path


def _rows_named(message: str, tasks: Path, inline: bool) -> str:
    """Name a submitted row ``rows[i]`` instead of its line in the file checked."""
    prefix = f"{tasks}:"
    if not message.startswith(prefix) or not inline:
        return message
    line, _, rest = message[len(prefix) :].partition(":")
    return f"rows[{int(line) - 1}]:{rest}" if line.isdigit() else message
