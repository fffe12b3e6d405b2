"""``dispatcher run``: dispatch a task file to agent servers (one job in this process)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import Any

from dispatcher.aio import tune_gc
from dispatcher.commands import command_help
from dispatcher.errors import DispatcherError
from dispatcher.settings.config import RunSettings
from dispatcher.settings.flags import add_run_arguments, budget_seconds, run_epilog, run_settings
from dispatcher.telemetry.logs import configure_logging
from dispatcher.telemetry.progress import console_on_terminal, live_terminal

_BOLD, _RESET = "\x1b[1m", "\x1b[0m"


def add_parser(subparsers: Any) -> None:
    """Register ``run`` with the flags of ``dispatcher.settings.flags``."""
    p = subparsers.add_parser(
        "run",
        help=command_help("run"),
        epilog=run_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(p)
    p.set_defaults(handler=_run_command, is_async=True)


async def _run_command(args: argparse.Namespace) -> int:
    settings, shard = run_settings(args)
    # The run's machinery is imported once the settings are valid: a run
    # stopped by a bad setting exits without loading it.
    from dispatcher.run.one_job import Dispatcher

    configure_logging(settings.log_format, level=settings.log_level)
    tune_gc()
    dispatcher = Dispatcher(
        settings,
        budget_s=budget_seconds(settings),
        shard_filter=shard.contains if shard is not None else None,
    )
    if not console_on_terminal(sys.stderr):
        return int(await dispatcher.run())
    try:
        code = int(await dispatcher.run())
    except DispatcherError as exc:
        # An error before the run's files were prepared needs no table: its line says it.
        if dispatcher.job.prepared is not None:
            await _print_ending(settings, int(exc.exit_code))
        raise
    await _print_ending(settings, code)
    return code


async def _print_ending(settings: RunSettings, exit_code: int) -> None:
    """On a terminal, after the summary line: the ``status`` table and the next step."""
    from dispatcher.ops.ending import run_ending

    # The run's outcome is already decided: a table that cannot be read or
    # printed must not change its exit code.
    with contextlib.suppress(DispatcherError, OSError, ValueError):
        ending = await asyncio.to_thread(
            run_ending, settings.output, settings.attempt_cap, exit_code
        )
        terminal = live_terminal(sys.stderr)
        # The next step in bold: it is what the person came back to the terminal for.
        terminal.write(f"\n{ending.table}\n{_BOLD}{ending.step}{_RESET}\n")
        terminal.flush()
