"""Operating a run: status, timing report, shards and merge, walltime from the scheduler.

Everything here reads a run's files (contracts §4) without changing them, except
``merge``, which writes a new output set of its own.
"""

from __future__ import annotations

import argparse


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``status``, ``report`` and ``merge`` subcommands (each sets ``handler``)."""
    from dispatcher.ops import merge, report
    from dispatcher.ops import status_command as status

    for command in (status, report, merge):
        command.add_parser(subparsers)
