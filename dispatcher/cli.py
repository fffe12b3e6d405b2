"""``dispatcher`` command line: ``run`` plus the helper servers and run inspection tools."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import gc
import os
import re
import sys
import textwrap
import time
from collections.abc import Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import orjson
import structlog

from dispatcher import __version__
from dispatcher.config import RunSettings, load_settings, parse_agent_caps, parse_agent_flags
from dispatcher.errors import ConfigError, DispatcherError, ExitCode
from dispatcher.telemetry.logs import configure_logging, flush_logs

if TYPE_CHECKING:
    from dispatcher.ops.shard import Shard

# Flags of `run` that map one-to-one onto RunSettings keys (values validated there).
_RUN_FLAGS: dict[str, str] = {
    "--input": "task file (JSONL), streamed",
    "--output": "output file X.jsonl; sidecars are named after it",
    "--default-agent": "agent for rows without agent_ref",
    "--num-repeats": 'repeats per task: N, or a JSON map like {"a": 4, "_default": 1}',
    "--limit": "read at most N input rows",
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
    "--capture-poll-s": "capture quiescence poll interval (default 0.05)",
    "--capture-wait-limit-s": "capture quiescence limit (default 10)",
    "--responses-create-params": "JSON object merged over each row's responses_create_params",
    "--shard": "K/N: run only tasks with task_index %% N == K; 'auto' from Slurm/Kubernetes",
    "--max-response-bytes": "largest agent answer, decompressed (default 64 MiB)",
    "--response-read-timeout-s": "seconds an agent's answer body may take to arrive (default 600)",
}
_JSON_FLAGS = {"num_repeats", "responses_create_params"}
_SWITCHES = {
    "--fresh": "start over: move the earlier run's files aside (never deleted)",
    "--skip-invalid-rows": "log and skip task lines that are not JSON objects",
    "--capture-include-payloads": "keep raw request/response payloads in attached calls",
    "--allow-empty": "accept a task file with no tasks (default: exit 2)",
}


_EXIT_CODES = """\
exit codes:
  0   every rollout has a final outcome
  75  some rollouts remain: rerun the same command to run them
  2   bad configuration or input; nothing was dispatched
  1   unexpected error (named in the message)
"""
_ENVIRONMENT = (
    "Every setting is also an environment variable DISPATCHER_<KEY> (flags win over the "
    "environment, which wins over --config): {keys}. DISPATCHER_AGENTS, "
    "DISPATCHER_NUM_REPEATS and DISPATCHER_RESPONSES_CREATE_PARAMS take JSON. "
    "DISPATCHER_CONFIG names the TOML file; DISPATCHER_SHARD_COUNT is the shard count "
    "of a Kubernetes indexed Job (--shard auto)."
)


class CliParser(argparse.ArgumentParser):
    """An argument parser that takes exact flags only and suggests one on a typo.

    Abbreviations are refused: ``--conc`` must not quietly mean
    ``--concurrency`` today and something else once a flag is added.
    Subcommand parsers are of this class too (argparse builds them with the
    parent's class).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        super().error(message + suggestion(message, self._option_string_actions))


# Choices are quoted by some Python versions and not by others.
_INVALID_CHOICE = re.compile(r"invalid choice: '?([^' ]*)'? \(choose from (.*)\)")


def suggestion(message: str, options: Iterable[str]) -> str:
    """ " (did you mean X?)" for an unknown flag or command in ``message``, else ""."""
    choice = _INVALID_CHOICE.search(message)
    if choice is not None:
        word, known = choice[1], [c.strip("'") for c in choice[2].split(", ")]
    elif message.startswith("unrecognized arguments: "):
        flags = [t for t in message.split()[2:] if t.startswith("-")]
        if not flags:
            return ""
        word, known = flags[0].partition("=")[0], [o for o in options if o.startswith("--")]
    else:
        return ""
    match = closest(word, known)
    return f" (did you mean {match}?)" if match else ""


def closest(word: str, known: Iterable[str]) -> str | None:
    """The known name ``word`` most likely meant: the closest one it starts, else the nearest."""
    names = sorted(set(known))
    starts = [name for name in names if name.startswith(word)]
    if starts:
        # `--conc` names --concurrency more than --concurrency-max: the closest.
        return difflib.get_close_matches(word, starts, n=1, cutoff=0.0)[0]
    near = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return near[0] if near else None


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="dispatcher", description="Run the rollout side of LLM reinforcement-learning jobs."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run_parser(sub)
    for module in _command_modules():
        module.add_parser(sub)
    return parser


def _command_modules() -> list[Any]:
    from dispatcher.capture import proxy
    from dispatcher.ops import init, merge, report, status, validate
    from dispatcher.serve import command as serve
    from dispatcher.sim import agent, model

    return [serve, agent, model, proxy, status, report, merge, validate, init]


def _add_run_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="dispatch a task file to agent servers",
        epilog=run_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(p)
    p.set_defaults(handler=_run_command, is_async=True)


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
    from dispatcher.ops.shard import resolve_shard

    settings = load_settings(run_flag_values(args))
    shard = resolve_shard(settings.shard, os.environ)
    if shard is not None:
        settings = settings.model_copy(
            update={"shard": str(shard), "output": shard.output_for(settings.output)}
        )
    return settings, shard


async def _run_command(args: argparse.Namespace) -> int:
    from dispatcher.service import Dispatcher

    settings, shard = run_settings(args)
    configure_logging(settings.log_format, level=settings.log_level)
    tune_gc()
    dispatcher = Dispatcher(
        settings,
        budget_s=budget_seconds(settings),
        shard_filter=shard.contains if shard is not None else None,
    )
    return int(await dispatcher.run())


def tune_gc() -> None:
    """Make the cyclic GC rare: its pauses, not our code, were the loop's longest stalls.

    A thousand rollouts in flight keep ~100k young container objects alive;
    with the default threshold (700 net allocations) the collector runs
    hundreds of times a second and its generation-1/2 passes stall the loop
    for 5-25 ms. Nearly everything a rollout allocates is freed by reference
    counting: collecting young objects every 20,000 net allocations (a pass
    then takes a few ms) and the old generation far more rarely loses nothing
    but pauses. Objects alive after imports and setup are frozen out of every
    pass.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


def budget_seconds(settings: RunSettings) -> float | None:
    if settings.dispatch_budget_s != "auto":
        return settings.dispatch_budget_s
    from dispatcher.ops.walltime import resolve_budget_auto

    return resolve_budget_auto(os.environ, reserve_s=settings.budget_reserve_s, now=time.time())


def _run_async(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line; an unknown flag is reported by its subcommand, with a suggestion."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        # Unknown flags surface at the top level, which knows only its own
        # options: let the subcommand's parser report them, with its flags.
        command = _subparser(parser, args.command)
        command.error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    return parser  # pragma: no cover - the parser always has subcommands


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Logs go to stderr: server commands print their URL on stdout for scripts.
    configure_logging(None)
    try:
        result = args.handler(args)
        if getattr(args, "is_async", False):
            result = _run_async(result)
        return int(result)
    except DispatcherError as exc:
        flush_logs()
        sys.stderr.write(f"error: {exc}\n")
        return int(exc.exit_code)
    except KeyboardInterrupt:
        return int(ExitCode.RESUMABLE)
    except Exception as exc:
        structlog.get_logger("dispatcher").exception("unexpected_error")
        flush_logs()
        sys.stderr.write(f"error: unexpected {type(exc).__name__}: {exc}\n")
        return int(ExitCode.UNEXPECTED)
