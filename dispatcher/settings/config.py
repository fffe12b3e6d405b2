"""One validated settings model for a run: TOML file < ``DISPATCHER_*`` env < CLI flags.

``dispatcher serve`` takes its own keys (``settings/serve.py``) from the same
three places (``layered``); one file and one environment serve both commands.

Every key has a unit in its name where it has one and a default where one is
safe. A bad value is a ``ConfigError`` naming the key and where it came from;
nothing falls back silently.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Literal, cast

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
)

from dispatcher.delivery.limits import DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_READ_TIMEOUT_S
from dispatcher.errors import ConfigError
from dispatcher.files.writer import FsyncPolicy
from dispatcher.settings.gym_habits import agent_flag_hint
from dispatcher.settings.gym_head import (
    FETCH_TIMEOUT_S,
    MAX_CONFIG_BYTES,
    HeadBounds,
    with_head_agents,
)
from dispatcher.settings.serve import SERVE_KEYS
from dispatcher.tasks.keys import repeats_problem
from dispatcher.tasks.lines import DEFAULT_MAX_LINE_BYTES
from dispatcher.tasks.materialize import MaterializeSpec
from dispatcher.urls import agent_url_problem, hide_url_secret, redact_url, redact_urls

ENV_PREFIX = "DISPATCHER_"
LogFormat = Literal["json", "console"]


class RunSettings(BaseModel):
    """Settings of ``dispatcher run``."""

    # nan and inf are never a meaningful timeout, budget or margin.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    input: Path
    output: Path
    agents: dict[str, list[str]] = Field(default_factory=dict)
    # contracts §15: agents from a Gym head server's config; `agents` wins by name.
    gym_head_server: str | None = None
    gym_head_timeout_s: float = Field(default=FETCH_TIMEOUT_S, gt=0)
    gym_head_max_bytes: int = Field(default=MAX_CONFIG_BYTES, ge=1)
    # Agent -> its environment server and that server's implementation, from the head
    # server's config: stamped on its rows (contracts §15).
    gym_environments: dict[str, tuple[str, str]] = Field(default_factory=dict)
    default_agent: str | None = None
    num_repeats: int | dict[str, int] = 1
    limit: int | None = Field(default=None, ge=0)
    responses_create_params: dict[str, Any] = Field(default_factory=dict)
    skip_invalid_rows: bool = False
    max_task_line_bytes: int = Field(default=DEFAULT_MAX_LINE_BYTES, ge=1, le=1024 * 1024 * 1024)
    allow_empty: bool = False
    shard: str | None = None

    concurrency: int | Literal["auto"] | None = Field(default=64)
    # Load caps (``delivery/adaptive.py``); hard, never exceeded, in every mode.
    concurrency_min: int = Field(default=1, ge=1)
    concurrency_max: int = Field(default=1024, ge=1)
    agent_concurrency: dict[str, int] = Field(default_factory=dict)
    replica_concurrency: int | None = Field(default=None, ge=1)
    max_starts_per_s: float | None = Field(default=None, gt=0)
    rollout_timeout_s: float | None = Field(default=None, gt=0)
    # While admission is paused (a colocated engine trains), rollout timeouts stop.
    pause_deadlines: bool = False
    dispatch_budget_s: float | Literal["auto"] | None = None
    budget_reserve_s: float = Field(default=300.0, ge=0)
    drain_margin_s: float | None = Field(default=None, ge=0)
    max_attempts: int = Field(default=3, ge=1)
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    fresh: bool = False
    max_response_bytes: int = Field(default=DEFAULT_MAX_RESPONSE_BYTES, ge=1024)
    response_read_timeout_s: float = Field(default=DEFAULT_READ_TIMEOUT_S, gt=0)

    # contracts §11: faults of the infrastructure are retried, never charged to the task.
    delivery_deadline_s: float = Field(default=600.0, ge=0)
    connect_timeout_s: float = Field(default=10.0, gt=0)
    # `run`: an agent none of whose replicas accepted a connection this long after
    # the start is a wrong URL or an agent never started (exit 2), not a fault to retry.
    wait_for_agents_s: float = Field(default=30.0, gt=0)
    first_byte_timeout_s: float | None = Field(default=None, gt=0)
    retry_backoff_base_s: float = Field(default=0.5, gt=0)
    retry_backoff_cap_s: float = Field(default=30.0, gt=0)
    breaker_failures: int = Field(default=5, ge=1)
    breaker_open_s: float = Field(default=1.0, gt=0)
    breaker_open_cap_s: float = Field(default=30.0, gt=0)
    local_fault_persist_s: float = Field(default=60.0, gt=0)

    fsync: FsyncPolicy = "batch"
    fsync_batch_interval_s: float = Field(default=0.05, gt=0)
    fsync_batch_rows: int = Field(default=256, ge=1)
    # Answered rows waiting for their commit, in bytes of the agents' bodies:
    # past it, rollouts hold their slots (backpressure) instead of memory.
    commit_queue_bytes: int = Field(default=32 * 1024 * 1024, ge=1)
    # Answers bigger than this are split, merged and serialized in a worker.
    offload_bytes: int = Field(default=256 * 1024, ge=0)

    capture_dir: Path | None = None
    # The capture proxy, told when each rollout's attempt ends (it forgets the session).
    capture_proxy_url: str | None = None
    capture_poll_s: float = Field(default=0.05, gt=0)
    capture_wait_limit_s: float = Field(default=10.0, ge=0)
    capture_include_payloads: bool = False

    log_format: LogFormat | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # "auto": a free port on 127.0.0.1, so that several runs on one node (shards)
    # never collide; the port is logged, in the manifest, /status and the
    # Prometheus file_sd target file (metrics_sd_dir, default: beside the output).
    metrics_listen: str = "auto"
    metrics_sd_dir: Path | None = None
    progress_interval_s: float = Field(default=30.0, gt=0)

    # Which waiting rollout starts next (contracts §13, start order).
    start_order: Literal["longest", "input"] = "longest"
    start_order_window: int = Field(default=65_536, ge=1)
    task_history: Path | None = None
    task_history_max_tasks: int = Field(default=100_000, ge=1)

    # NeMo Gym Main's run contracts (contracts §15).
    record_omitted: bool = False
    max_failure_fraction: float | None = Field(default=None, ge=0, le=1)
    extend_attempts: int = Field(default=0, ge=0)

    @field_validator("agents")
    @classmethod
    def _agents_have_urls(cls, agents: dict[str, list[str]]) -> dict[str, list[str]]:
        for name, urls in agents.items():
            if not urls:
                raise ValueError(f"agent {name!r} has no URL")
            for url in urls:
                hide_url_secret(url)
                problem = agent_url_problem(url)
                if problem is not None:
                    raise ValueError(f"agent {name!r}: {redact_url(url)!r} {problem}")
        return {name: [u.rstrip("/") for u in urls] for name, urls in agents.items()}

    @field_validator("concurrency", mode="before")
    @classmethod
    def _concurrency_parses(cls, value: Any) -> int | str | None:
        # Parsed here, not by the union, so a bad value gets one plain message.
        if value is None or value == "auto":
            return cast(str | None, value)
        number = value if type(value) is int else None
        if isinstance(value, str) and value.strip().isdigit():
            number = int(value)
        if number is None or number < 1:
            raise ValueError("must be an integer >= 1, 'auto' or 'unbounded'")
        return number

    @field_validator("concurrency_max")
    @classmethod
    def _max_not_below_min(cls, value: int, info: ValidationInfo) -> int:
        if value < info.data.get("concurrency_min", 1):
            raise ValueError("must be >= concurrency_min")
        return value

    @field_validator("agent_concurrency")
    @classmethod
    def _agent_caps(cls, caps: dict[str, int], info: ValidationInfo) -> dict[str, int]:
        for name, cap in caps.items():
            if "agents" in info.data and name not in info.data["agents"]:
                raise ValueError(f"agent {name!r} is not among the agents")
            if cap < 1:
                raise ValueError(f"agent {name!r}: must be >= 1")
        return caps

    @property
    def attempt_cap(self) -> int:
        """Counted failures that make a rollout final: ``max_attempts`` raised by
        ``extend_attempts`` for this hop (contracts §15)."""
        return self.max_attempts + self.extend_attempts

    @property
    def adaptive(self) -> bool:
        return self.concurrency == "auto"

    @property
    def pool_concurrency(self) -> int | None:
        """Rollouts in flight at most across agents: the setting, or the ceiling of ``auto``."""
        if self.concurrency == "auto":
            return self.concurrency_max
        return self.concurrency

    def materialize_spec(self, shard_filter: Callable[[int], bool] | None) -> MaterializeSpec:
        """The task-affecting settings: what materialization reads of these."""
        return MaterializeSpec(
            input_path=self.input,
            agents=frozenset(self.agents),
            default_agent=self.default_agent,
            num_repeats=self.num_repeats,
            limit=self.limit,
            overrides=self.responses_create_params,
            skip_invalid_rows=self.skip_invalid_rows,
            shard_filter=shard_filter,
            max_line_bytes=self.max_task_line_bytes,
        )

    @field_validator("num_repeats")
    @classmethod
    def _repeats_bounded(cls, value: int | dict[str, int]) -> int | dict[str, int]:
        # Bounded so that rollout keys cannot collide (keys.MAX_REPEATS).
        counts = [value] if isinstance(value, int) else list(value.values())
        for problem in map(repeats_problem, counts):
            if problem is not None:
                raise ValueError(problem)
        return value

    @field_validator("dispatch_budget_s")
    @classmethod
    def _budget_not_negative(cls, value: float | str | None) -> float | str | None:
        if isinstance(value, float) and value < 0:
            raise ValueError("must be >= 0 (or 'auto')")
        return value

    @field_validator("metrics_listen")
    @classmethod
    def _listen_parses(cls, value: str) -> str:
        from dispatcher.telemetry.discovery import resolve_listen

        resolve_listen(value)
        return value

    # Cross-key checks are field validators (reading earlier fields from
    # ``info.data``) so the error's location names the key and its source.
    @field_validator("dispatch_budget_s")
    @classmethod
    def _budget_needs_bound(
        cls, value: float | str | None, info: ValidationInfo
    ) -> float | str | None:
        if value is not None and "concurrency" in info.data and info.data["concurrency"] is None:
            raise ValueError(
                "needs a concurrency bound (concurrency is unbounded): without one every "
                "rollout starts at once and the budget can drain nothing"
            )
        return value

    @field_validator("default_agent")
    @classmethod
    def _default_agent_known(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and "agents" in info.data and value not in info.data["agents"]:
            raise ValueError(f"agent {value!r} is not among the agents")
        return value


# Keys whose environment value is JSON (objects, lists, maps).
_JSON_ENV_KEYS = {"agents", "num_repeats", "responses_create_params", "agent_concurrency"}


def load_settings(cli: Mapping[str, Any], env: Mapping[str, str] | None = None) -> RunSettings:
    """Merge the TOML file named by ``cli['config']``, the environment, then CLI flags."""
    env = os.environ if env is None else env
    sources: dict[str, str] = {}
    merged: dict[str, Any] = {}
    config_path, file_values = config_file(cli, env)
    for key, value in file_values.items():
        # One file serves both commands: the service's own keys are serve's to read.
        if key not in SERVE_KEYS:
            merged[key], sources[key] = value, f"{config_path}"
    for key, value in _from_env(env).items():
        merged[key], sources[key] = value, f"{ENV_PREFIX}{key.upper()}"
    for key, value in cli.items():
        if key != "config" and value is not None:
            merged[key], sources[key] = value, flag_for(key)
    _normalize_unbounded(merged)
    if merged.get("gym_head_server"):
        _add_head_agents(merged, sources)
    try:
        return RunSettings.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, sources)) from None


def config_file(cli: Mapping[str, Any], env: Mapping[str, str]) -> tuple[str, dict[str, Any]]:
    """The config file's path (``--config``, else ``DISPATCHER_CONFIG``) and its keys;
    ``("", {})`` for none."""
    config_path = cli.get("config") or env.get(f"{ENV_PREFIX}CONFIG")
    if not config_path:
        return "", {}
    return str(config_path), _read_toml(Path(config_path))


def layered(
    keys: Collection[str], cli: Mapping[str, Any], env: Mapping[str, str]
) -> dict[str, tuple[Any, str]]:
    """Keys that are not ``RunSettings``' (the service's own), the same way: each
    key's value and where it came from, a flag over ``DISPATCHER_*`` over the file.
    Keys given nowhere are left out."""
    path, file_values = config_file(cli, env)
    found: dict[str, tuple[Any, str]] = {}
    for key in keys:
        name = f"{ENV_PREFIX}{key.upper()}"
        if cli.get(key) is not None:
            found[key] = cli[key], flag_for(key)
        elif name in env:
            found[key] = env[name], name
        elif key in file_values:
            found[key] = file_values[key], path
    return found


_HEAD_BOUNDS = ("gym_head_timeout_s", "gym_head_max_bytes")


def _add_head_agents(merged: dict[str, Any], sources: Mapping[str, str]) -> None:
    """The head server's agents into ``merged``, fetched within the bounds it sets
    (checked first: a bad bound is named, not used)."""
    # The two fields of RunSettings, with their constraints, checked on their own.
    fields: dict[str, Any] = {
        k: (RunSettings.model_fields[k].annotation, RunSettings.model_fields[k])
        for k in _HEAD_BOUNDS
    }
    try:
        checked = create_model("HeadBounds", **fields).model_validate(
            {k: merged[k] for k in _HEAD_BOUNDS if k in merged}
        )
    except ValidationError as exc:
        raise ConfigError(_describe(exc, sources)) from None
    bounds = HeadBounds(checked.gym_head_timeout_s, checked.gym_head_max_bytes)
    head = with_head_agents(merged["gym_head_server"], merged.get("agents"), bounds)
    merged["agents"] = head.agents
    merged["gym_environments"] = head.environments


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None


# DISPATCHER_* variables that are not settings: the config file's path, the
# shard count a Kubernetes indexed Job gives `--shard auto` (ops/shard.py),
# the service's API token (serve/auth.py: never a setting, never dumped), and
# what a trainer's shell holds for the client (the docs' snippets export
# DISPATCHER_URL): one shell may run both, and they say nothing to a daemon.
_NOT_SETTINGS = frozenset(
    f"{ENV_PREFIX}{name}" for name in ("CONFIG", "SHARD_COUNT", "API_TOKEN", "URL", "STATE")
)


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name in _NOT_SETTINGS:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key in SERVE_KEYS:
            continue  # the service's own (``layered``)
        if key not in RunSettings.model_fields:
            raise ConfigError(f"{name}: unknown setting (no config key {key!r})")
        if key in _JSON_ENV_KEYS:
            try:
                values[key] = orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise ConfigError(f"{name}: expected a JSON value") from None
        else:
            values[key] = raw
    return values


def _normalize_unbounded(merged: dict[str, Any]) -> None:
    # "unbounded" is how a file or flag says "no concurrency bound"; None
    # cannot be written in TOML.
    if merged.get("concurrency") in ("unbounded", "none"):
        merged["concurrency"] = None
    agents = merged.get("agents")
    if isinstance(agents, dict):
        merged["agents"] = {k: [v] if isinstance(v, str) else v for k, v in agents.items()}


def _describe(exc: ValidationError, sources: Mapping[str, str]) -> str:
    first = exc.errors()[0]
    loc = [str(part) for part in first["loc"]]
    key = loc[0] if loc else ""
    where = sources.get(key)
    message = first["msg"].removeprefix("Value error, ")
    if not key:
        return f"config: {message}"
    if first["type"] == "extra_forbidden":
        return f"config key {key!r} (from {where}): unknown setting"
    if first["type"] == "missing":
        return f"config key {key!r}: required (flag {flag_for(key)} or config file)"
    shown = ".".join(loc)
    return f"config key {shown!r} (from {where}): {message}"


def flag_for(key: str) -> str:
    """The ``dispatcher run`` flag that sets ``key`` (``agents`` is the repeatable ``--agent``)."""
    return "--agent" if key == "agents" else f"--{key.replace('_', '-')}"


def parse_agent_flags(values: list[str] | None) -> dict[str, list[str]] | None:
    """``--agent NAME=URL[,URL...]`` flags → ``{name: [urls]}``."""
    if not values:
        return None
    agents: dict[str, list[str]] = {}
    for value in values:
        name, sep, urls = value.partition("=")
        if not sep or not name or not urls:
            # Most likely a bare URL: never repeat its password.
            raise ConfigError(
                f"--agent {redact_urls(value)!r}: expected NAME=URL[,URL...]"
                + agent_flag_hint(value)
            )
        agents.setdefault(name, []).extend(u for u in urls.split(",") if u)
    return agents


def parse_agent_caps(values: list[str] | None) -> dict[str, int] | None:
    """``--agent-concurrency NAME=N`` flags → ``{name: n}``."""
    if not values:
        return None
    caps: dict[str, int] = {}
    for value in values:
        name, sep, count = value.partition("=")
        if not sep or not name or not count.isdigit():
            raise ConfigError(f"--agent-concurrency {value!r}: expected NAME=N")
        caps[name] = int(count)
    return caps
