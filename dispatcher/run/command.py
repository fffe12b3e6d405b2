"""``dispatcher run``: dispatch a task file to agent servers (one job in this process)."""

from __future__ import annotations

import argparse
from typing import Any

from dispatcher.aio import tune_gc
from dispatcher.commands import command_help
from dispatcher.settings.flags import add_run_arguments, budget_seconds, run_epilog, run_settings
from dispatcher.telemetry.logs import configure_logging


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
    return int(await dispatcher.run())
