"""``dispatcher`` command line: ``run`` plus the helper servers and run inspection tools."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import re
import sys
from collections.abc import Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import structlog

from dispatcher import __version__
from dispatcher.aio import tune_gc
from dispatcher.errors import DispatcherError, ExitCode
from dispatcher.settings.flags import add_run_arguments, budget_seconds, run_epilog, run_settings
from dispatcher.telemetry.logs import configure_logging, flush_logs

if TYPE_CHECKING:
    pass


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
    from dispatcher.ops import init, merge, report, validate
    from dispatcher.ops import status_command as status
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


async def _run_command(args: argparse.Namespace) -> int:
    from dispatcher.run.one_job import Dispatcher

    settings, shard = run_settings(args)
    configure_logging(settings.log_format, level=settings.log_level)
    tune_gc()
    dispatcher = Dispatcher(
        settings,
        budget_s=budget_seconds(settings),
        shard_filter=shard.contains if shard is not None else None,
    )
    return int(await dispatcher.run())


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
