"""``dispatcher status PATH``: a run's output, or a ``dispatcher serve`` state directory."""

from __future__ import annotations

import argparse
from pathlib import Path

import orjson

from dispatcher.commands import command_help
from dispatcher.ops import serve_status
from dispatcher.ops.status import DEFAULT_MAX_ATTEMPTS, collect_status, render_status
from dispatcher.settings.args import positive_int


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
    parser.add_argument(
        "--max-attempts",
        type=positive_int,
        default=None,
        help=f"attempt cap of the run (default: the manifest's, else {DEFAULT_MAX_ATTEMPTS})",
    )
    parser.set_defaults(handler=run_status)


def run_status(args: argparse.Namespace) -> int:
    if serve_status.is_state_dir(args.output):
        jobs = serve_status.collect_state_dir(args.output)
        if args.json:
            print(orjson.dumps(jobs.to_json(), option=orjson.OPT_INDENT_2).decode())
        else:
            print(serve_status.render_state_dir(jobs), end="")
        return int(jobs.exit_code)
    status = collect_status(args.output, args.max_attempts)
    if args.json:
        print(orjson.dumps(status.to_json(), option=orjson.OPT_INDENT_2).decode())
    else:
        print(render_status(status), end="")
    return int(status.exit_code)
