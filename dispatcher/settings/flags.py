"""The flags of ``dispatcher run`` (``validate`` takes the same; ``serve`` most of them),
mapped onto ``RunSettings`` keys, and the settings they make with the environment
and a TOML file.
"""

from __future__ import annotations

import argparse
import os
import textwrap
import time
from typing import TYPE_CHECKING, Any

import orjson

from dispatcher.errors import ConfigError
from dispatcher.settings.config import (
    RunSettings,
    load_settings,
    parse_agent_caps,
    parse_agent_flags,
)

if TYPE_CHECKING:
    from dispatcher.settings.shard import Shard

# Flags of `run` that map one-to-one onto RunSettings keys (values validated there).
_RUN_FLAGS: dict[str, str] = {
    "--input": "task file (JSONL), streamed",
    "--output": "output file X.jsonl; sidecars are named after it",
    "--default-agent": "agent for rows without agent_ref",
    "--gym-head-server": "URL of a running NeMo Gym head server: its agents, by name "
    "(--agent wins for a name it gives)",
    "--gym-head-timeout-s": "seconds the head server's whole answer may take (default 10)",
    "--gym-head-max-bytes": "largest head server config answer (default 16 MiB)",
    "--num-repeats": 'repeats per task: N, or a JSON map like {"a": 4, "_default": 1}',
    "--limit": "read at most N input rows",
    "--max-task-line-bytes": "longest task line; a longer one is an error naming it "
    "(default 64 MiB, at most 1 GiB)",
    "--concurrency": "rollouts in flight at most (default 64; 'unbounded' for no bound), "
    "or 'auto': each replica's limit adapts to its latency and 429s",
    "--concurrency-min": "with 'auto': an agent's limit never below this (default 1)",
    "--concurrency-max": "with 'auto': rollouts in flight never above this (default 1024)",
    "--replica-concurrency": "hard cap of rollouts in flight per replica",
    "--max-starts-per-s": "hard cap of requests sent to agents in any second",
    "--rollout-timeout-s": "per-rollout timeout in seconds",
    "--dispatch-budget-s": "walltime budget for dispatch in seconds, or 'auto' (Slurm)",
    "--budget-reserve-s": "with 'auto': seconds kept back before the job's end (default 300)",
    "--drain-margin-s": "do not start a rollout with less time left (default: this run's p75)",
    "--max-attempts": "attempts per rollout before it is final (default 3)",
    "--shutdown-grace-s": "on SIGTERM/SIGINT, seconds in-flight rollouts get (default 30)",
    "--delivery-deadline-s": "seconds a rollout may keep failing to reach an agent (default 600)",
    "--connect-timeout-s": "seconds to connect to an agent before trying again (default 10)",
    "--wait-for-agents-s": "exit 2 when an agent none of whose replicas accepted a connection "
    "this long after the start (default 30)",
    "--first-byte-timeout-s": "seconds to an agent's status line before trying again "
    "(default: none with --rollout-timeout-s, else 7200)",
    "--fsync": "always | batch (default: group commit) | never",
    "--commit-queue-bytes": "answered rows waiting to be written, in body bytes (default 32 MiB)",
    "--offload-bytes": "answers bigger than this are handled off the event loop (default 256 KiB)",
    "--log-format": "json | console (default: console on a terminal, else json)",
    "--log-level": "debug | info (default) | warning | error",
    "--metrics-listen": (
        "HOST:PORT of /metrics /healthz /status; 'auto' (default): a free port on "
        "127.0.0.1, logged and written to the manifest and /status; 'off'"
    ),
    "--metrics-sd-dir": (
        "directory for a Prometheus file_sd target file (default: beside the output)"
    ),
    "--progress-interval-s": "seconds between progress events (default 30)",
    "--capture-dir": "capture directory shared with the capture proxy",
    "--capture-proxy-url": "the capture proxy's URL: told when each rollout ends, so it "
    "releases the rollout's session (routing by rollout)",
    "--capture-poll-s": "capture quiescence poll interval (default 0.05)",
    "--capture-wait-limit-s": "capture quiescence limit (default 10)",
    "--responses-create-params": "JSON object merged over each row's responses_create_params",
    "--shard": "K/N: run only tasks with task_index %% N == K; 'auto' from Slurm/Kubernetes",
    "--max-response-bytes": "largest agent answer, decompressed (default 64 MiB)",
    "--response-read-timeout-s": "seconds an agent's answer body may take to arrive (default 600)",
    "--start-order": "longest (default): rollouts expected to run longest start first, "
    "unseen tasks before them; input: in the task file's order",
    "--start-order-window": "a rollout starts before any rollout this many places after it "
    "in input order (default 65536)",
    "--task-history": "file of each task's latency, kept across runs (default: "
    "task_history.jsonl beside the output)",
    "--task-history-max-tasks": "tasks the history keeps, the least recently run "
    "forgotten first (default 100000)",
    # NeMo Gym Main's run contracts (contracts §15).
    "--max-failure-fraction": "stop starting rollouts (exit 1) once counted failures exceed "
    "this fraction of the expected rollouts",
    "--extend-attempts": "raise the attempt cap by N for this hop (a resume gives failed "
    "rollouts N more attempts)",
}
_JSON_FLAGS = {"num_repeats", "responses_create_params"}
_SWITCHES = {
    "--fresh": "start over: move the earlier run's files aside (never deleted)",
    "--skip-invalid-rows": "log and skip task lines that are not JSON objects",
    "--capture-include-payloads": "keep raw request/response payloads in attached calls",
    "--pause-deadlines": "while admission is paused (serve: a colocated engine trains), "
    "rollout timeouts stop counting",
    "--allow-empty": "accept a task file with no tasks (default: exit 2)",
    "--record-omitted": "write one _ng_omitted_rollout row to the failures sidecar for each "
    "rollout this hop left without a result (drained, cancelled, kill-shaped)",
}


_EXIT_CODES = """\
exit codes:
  0   every rollout has a final outcome
  75  some rollouts remain: rerun the same command to run them
  2   bad configuration or input; nothing was dispatched
  1   unexpected error (named in the message), or no rollout succeeded and every one
      failed the same way (a broken agent): fix it, then --extend-attempts N
"""
_ENVIRONMENT = (
    "Every setting is also an environment variable DISPATCHER_<KEY> (flags win over the "
    "environment, which wins over --config): {keys}. DISPATCHER_AGENTS, "
    "DISPATCHER_NUM_REPEATS and DISPATCHER_RESPONSES_CREATE_PARAMS take JSON. "
    "DISPATCHER_CONFIG names the TOML file; DISPATCHER_SHARD_COUNT is the shard count "
    "of a Kubernetes indexed Job (--shard auto)."
)


def run_epilog() -> str:
    keys = ", ".join(f"DISPATCHER_{key.upper()}" for key in RunSettings.model_fields)
    environment = textwrap.fill(
        _ENVIRONMENT.format(keys=keys), width=78, initial_indent="  ", subsequent_indent="  "
    )
    return f"{_EXIT_CODES}\nenvironment:\n{environment}\n"


def add_run_arguments(p: argparse.ArgumentParser, exclude: frozenset[str] = frozenset()) -> None:
    """The flags of ``run`` (``validate`` takes the same ones; ``serve`` all but ``exclude``)."""
    p.add_argument("--config", help="TOML file with the same settings as keys")
    p.add_argument(
        "--agent",
        action="append",
        metavar="NAME=URL[,URL...]",
        help="an agent and its replicas (repeatable)",
    )
    p.add_argument(
        "--agent-concurrency",
        action="append",
        metavar="NAME=N",
        help="hard cap of an agent's rollouts in flight (repeatable)",
    )
    for flag, text in _RUN_FLAGS.items():
        if flag not in exclude:
            p.add_argument(flag, help=text)
    for flag, text in _SWITCHES.items():
        if flag not in exclude:
            p.add_argument(flag, action="store_const", const=True, default=None, help=text)


def run_flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The flags the user gave, as settings keys (absent flags are left out)."""
    values: dict[str, Any] = {
        "config": args.config,
        "agents": parse_agent_flags(args.agent),
        "agent_concurrency": parse_agent_caps(args.agent_concurrency),
    }
    for flag in (*_RUN_FLAGS, *_SWITCHES):
        key = flag.removeprefix("--").replace("-", "_")
        value = getattr(args, key, None)
        if value is not None and key in _JSON_FLAGS and value.lstrip().startswith("{"):
            value = _json_flag(flag, value)
        values[key] = value
    return values


def _json_flag(flag: str, value: str) -> Any:
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError:
        raise ConfigError(f"{flag}: not valid JSON") from None


def run_settings(args: argparse.Namespace) -> tuple[RunSettings, Shard | None]:
    """The run's settings from file, environment and flags, with the shard's output applied."""
    from dispatcher.settings.shard import resolve_shard

    settings = load_settings(run_flag_values(args))
    shard = resolve_shard(settings.shard, os.environ)
    if shard is not None:
        settings = settings.model_copy(
            update={"shard": str(shard), "output": shard.output_for(settings.output)}
        )
    return settings, shard


def budget_seconds(settings: RunSettings) -> float | None:
    if settings.dispatch_budget_s != "auto":
        return settings.dispatch_budget_s
    from dispatcher.settings.walltime import resolve_budget_auto

    return resolve_budget_auto(os.environ, reserve_s=settings.budget_reserve_s, now=time.time())
