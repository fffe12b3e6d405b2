"""``dispatcher status PATH``: a run's output, or a ``dispatcher serve`` state directory."""

from __future__ import annotations

import argparse
from pathlib import Path

import orjson

from dispatcher.commands import command_help
from dispatcher.ops.runfiles import is_state_dir
from dispatcher.ops.status import (
    add_attempt_cap_flags,
    collect_status,
    given_attempt_cap,
    render_status,
)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "status",
        help=command_help("status"),
        description=(
            "Read a run's output files (without changing them) and report expected rollouts, "
            "successes, failures by class, what resume would run and why, coverage per agent "
            "and whether a dispatcher holds the run lock. Given a `dispatcher serve` state "
            "directory, the same for each of its jobs. Exit 0 when every rollout (every job) is "
            "final, 75 when some are left to run."
        ),
    )
    parser.add_argument(
        "output",
        type=Path,
        metavar="OUTPUT",
        help="the run's --output X.jsonl, or a `dispatcher serve` --state-dir: its jobs",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_attempt_cap_flags(parser, "for which rollouts are final")
    parser.set_defaults(handler=run_status)


def run_status(args: argparse.Namespace) -> int:
    if is_state_dir(args.output):
        return _state_dir_status(args)
    status = collect_status(args.output, given_attempt_cap(args))
    if args.json:
        print(orjson.dumps(status.to_json(), option=orjson.OPT_INDENT_2).decode())
    else:
        print(render_status(status), end="")
    return int(status.exit_code)


def _state_dir_status(args: argparse.Namespace) -> int:
    # Imported for a state directory only: it brings the service's job registry
    # and job models, which `status` of a run (the common case) never reads.
    from dispatcher.ops import serve_status

    jobs = serve_status.collect_state_dir(args.output)
    if args.json:
        print(orjson.dumps(jobs.to_json(), option=orjson.OPT_INDENT_2).decode())
    else:
        print(serve_status.render_state_dir(jobs), end="")
    return int(jobs.exit_code)
