"""``dispatcher`` command line: ``run`` plus the helper servers and run inspection tools."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import gc
import importlib
import re
import sys
from collections.abc import Collection, Coroutine, Iterable, Sequence
from typing import Any, NoReturn

import structlog

from dispatcher import __version__
from dispatcher.commands import COMMANDS
from dispatcher.errors import DispatcherError, ExitCode
from dispatcher.telemetry.logs import configure_logging, flush_logs
from dispatcher.urls import scrub


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
        words = [t for t in message.split()[2:] if t.startswith(("-", "+"))]
        if not words:
            return ""
        hint = _gym_hint(words[0], message.split()[2:])
        if hint is not None:
            return f" ({hint})"
        word, known = words[0].partition("=")[0], [o for o in options if o.startswith("--")]
    else:
        return ""
    match = closest(word, known)
    return f" (did you mean {match}?)" if match else ""


def _gym_hint(word: str, extras: list[str]) -> str | None:
    """A NeMo Gym habit's hint; a flag's value, when it follows as a word, goes in it."""
    from dispatcher.settings.gym_habits import gym_hint

    if "=" not in word:
        following = extras[extras.index(word) + 1 : extras.index(word) + 2]
        if following and not following[0].startswith(("-", "+")):
            word = f"{word}={following[0]}"
    return gym_hint(word)


def closest(word: str, known: Iterable[str]) -> str | None:
    """The known name ``word`` most likely meant: the closest one it starts, else the nearest."""
    names = sorted(set(known))
    starts = [name for name in names if name.startswith(word)]
    if starts:
        # `--conc` names --concurrency more than --concurrency-max: the closest.
        return difflib.get_close_matches(word, starts, n=1, cutoff=0.0)[0]
    near = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return near[0] if near else None


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser, with the flags of ``commands`` (default: every command).

    The others get a parser with their name and help line only: enough for
    ``dispatcher --help`` and for refusing an unknown command, without
    importing their modules.
    """
    parser = CliParser(
        prog="dispatcher", description="Run the rollout side of LLM reinforcement-learning jobs."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        if commands is None or command.name in commands:
            importlib.import_module(command.module).add_parser(sub)
        else:
            sub.add_parser(command.name, help=command.help)
    return parser


def chosen_command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names: its first word that is not an option.

    The top-level options (``--help``, ``--version``) take no value, so that
    word is the one argparse takes for COMMAND; when it is not a command,
    argparse refuses it whatever is built.
    """
    return next((word for word in argv if not word.startswith("-")), None)


def _run_async(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line; an unknown flag is reported by its subcommand, with a suggestion."""
    words = sys.argv[1:] if argv is None else argv
    chosen = chosen_command(words)
    parser = build_parser(commands=() if chosen is None else (chosen,))
    args, extras = parser.parse_known_args(argv)
    if extras:
        # Unknown flags surface at the top level, which knows only its own
        # options: let the subcommand's parser report them, with its flags.
        command = _chosen_parser(parser, args)
        command.error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def _chosen_parser(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The innermost parser ``args`` went through (``jobs list``'s, not ``jobs``')."""
    while True:
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subparsers:
            return parser
        name = getattr(args, subparsers[0].dest, None)
        if name not in subparsers[0].choices:
            return parser
        parser = subparsers[0].choices[name]


def _end_startup() -> None:
    """Turn the cyclic GC back on if ``python -m dispatcher`` kept it off for the
    imports; what they built lives as long as the process, so it is frozen out
    of every later pass (as ``tune_gc`` does once a run is set up)."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _end_startup()
    # Logs go to stderr: server commands print their URL on stdout for scripts.
    configure_logging(None)
    try:
        result = args.handler(args)
        if getattr(args, "is_async", False):
            result = _run_async(result)
        return int(result)
    except DispatcherError as exc:
        flush_logs()
        sys.stderr.write(scrub(f"error: {exc}\n"))
        return int(exc.exit_code)
    except KeyboardInterrupt:
        return int(ExitCode.RESUMABLE)
    except Exception as exc:
        structlog.get_logger("dispatcher").exception("unexpected_error")
        flush_logs()
        sys.stderr.write(scrub(f"error: unexpected {type(exc).__name__}: {exc}\n"))
        return int(ExitCode.UNEXPECTED)
