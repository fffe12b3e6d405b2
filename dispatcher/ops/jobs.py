"""``dispatcher jobs list|show|submit|cancel|tail|pause|resume|policy``: a running
``dispatcher serve``, from the command line, through ``dispatcher.client``.

The daemon is ``--address URL``, else ``DISPATCHER_URL``, else serve's default
listen address; its token comes from ``--api-token-file``, else
``DISPATCHER_API_TOKEN``, and goes in the Authorization header only (never in
what is printed). Text for a person, ``--json`` (and ``tail``'s NDJSON) for jq.

Exit codes: 0 done; 2 when the command cannot do its work as typed (the daemon
does not answer at the address, its certificate is not trusted, a token missing
or wrong, no such job, a body the daemon refuses); 1 when the daemon failed
(5xx). ``submit --wait`` and ``tail --follow`` end with the job: 0 done or
satisfied, 75 incomplete, 1 failed or cancelled.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import orjson

from dispatcher import jsonx
from dispatcher.client.aio import AsyncClient
from dispatcher.client.wire import TOKEN_ENV, ClientError, JobStatus
from dispatcher.commands import command_help
from dispatcher.errors import ConfigError
from dispatcher.lifecycle import JobState
from dispatcher.ops import jobs_view
from dispatcher.ops.jobs_daemon import DEFAULT_URL, URL_ENV, Daemon, said
from dispatcher.settings.args import positive_float, positive_int

# How long one call may take: a few seconds tells a daemon that is not there; a
# submit sends its rows (up to the daemon's --max-body-bytes) in its one call.
CALL_TIMEOUT_S = 10.0
SUBMIT_TIMEOUT_S = 300.0
# Retries for a daemon that does not answer: short for the first call, so a
# wrong address is said within seconds; long once following a job, so a
# daemon restarted meanwhile (it resumes its jobs) is waited for.
REACH_DEADLINE_S = 5.0
FOLLOW_DEADLINE_S = 120.0
WAIT_POLL_S = 0.5


# --- the command line -------------------------------------------------------------

Action = Callable[[AsyncClient, argparse.Namespace], Awaitable[int]]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "jobs",
        help=command_help("jobs"),
        description=(
            "Talk to a running `dispatcher serve` (its jobs API) from the command line: "
            f"--address URL (default: ${URL_ENV}, else {DEFAULT_URL}) and its token from "
            f"--api-token-file FILE or ${TOKEN_ENV}. Exit 0 done; 2 when the daemon does "
            "not answer at the address, its certificate is not trusted (--tls-ca-file), it "
            "refuses the token, has no such job or refuses the body; 1 when it failed. "
            "`submit --wait` and `tail --follow` exit with the job: 0 done or satisfied, "
            "75 incomplete, 1 failed or cancelled."
        ),
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    common = _common_flags()
    for name, help_line, add_flags, action in _ACTIONS:
        sub = actions.add_parser(name, help=help_line, description=help_line, parents=[common])
        add_flags(sub)
        sub.set_defaults(run_action=action)
    parser.set_defaults(handler=run_jobs, is_async=True)


def _common_flags() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--address",
        metavar="URL",
        help=f"the daemon's URL (default: ${URL_ENV}, else {DEFAULT_URL})",
    )
    common.add_argument(
        "--api-token-file",
        type=Path,
        metavar="FILE",
        help=f"the daemon's API token, the file's one line (default: ${TOKEN_ENV})",
    )
    common.add_argument(
        "--tls-ca-file",
        type=Path,
        metavar="FILE",
        help="for https: the certificate(s) to trust for the daemon's, PEM (its own if "
        "self-signed; default: the system's trust store)",
    )
    common.add_argument(
        "--timeout-s",
        type=positive_float,
        default=None,
        metavar="S",
        help=f"how long one call may take (default {CALL_TIMEOUT_S:g}; "
        f"submit {SUBMIT_TIMEOUT_S:g})",
    )
    return common


def run_jobs(args: argparse.Namespace) -> Awaitable[int]:
    """The ACTION against the daemon; the daemon's refusals said as one line."""
    daemon = Daemon.from_args(args)
    return _run(daemon, args)


async def _run(daemon: Daemon, args: argparse.Namespace) -> int:
    default_s = SUBMIT_TIMEOUT_S if args.action == "submit" else CALL_TIMEOUT_S
    client = AsyncClient(
        daemon.url,
        # Daemon chose the token (the file, else the environment): "" for none
        # keeps the client from reading the environment on its own.
        token=daemon.token or "",
        ssl_context=daemon.trust,
        timeout_s=args.timeout_s or default_s,
        retry_deadline_s=REACH_DEADLINE_S,
    )
    action: Action = args.run_action
    try:
        async with client:
            return await action(client, args)
    except ClientError as exc:
        raise said(exc, daemon, getattr(args, "job_id", None)) from None


# --- the actions --------------------------------------------------------------------


def _json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON (for jq)")


def _job_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job_id", metavar="ID", help="the job's id")


def _list_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state",
        type=_states,
        default=(),
        metavar="S[,S...]",
        help=f"only the jobs in these states ({', '.join(s.value for s in JobState)})",
    )
    _json_flag(parser)


def _states(text: str) -> tuple[str, ...]:
    states = tuple(s.strip() for s in text.split(",") if s.strip())
    known = {s.value for s in JobState}
    unknown = [s for s in states if s not in known]
    if unknown or not states:
        raise argparse.ArgumentTypeError(f"not a job state: {','.join(unknown) or text!r}")
    return states


async def list_jobs(client: AsyncClient, args: argparse.Namespace) -> int:
    jobs = await client.jobs(*args.state)
    if args.json:
        _print_json({"jobs": [job.to_json() for job in jobs]})
        return 0
    policy = await client.policy_version()
    admission = await client.admission()
    _print(jobs_view.render_list(client.base_url, jobs, policy, admission))
    return 0


def _show_flags(parser: argparse.ArgumentParser) -> None:
    _job_flag(parser)
    _json_flag(parser)


async def show(client: AsyncClient, args: argparse.Namespace) -> int:
    _print_status(await client.status(args.job_id), args.json)
    return 0


async def cancel(client: AsyncClient, args: argparse.Namespace) -> int:
    job = await client.cancel(args.job_id)
    if job.final and job.state is not JobState.CANCELLED:
        _print(f"job {job.job_id}: {job.state.value} (it had ended: nothing to cancel)\n")
    else:
        # Its rollouts at the agents are being cancelled; none of them writes a row.
        _print(f"job {job.job_id}: cancelled\n")
    return 0


def _tail_flags(parser: argparse.ArgumentParser) -> None:
    _job_flag(parser)
    parser.add_argument(
        "--after", type=int, default=0, metavar="SEQ", help="start after this _ng_seq"
    )
    parser.add_argument("--group", action="store_true", help="one line per complete group")
    parser.add_argument(
        "--filtered", action="store_true", help="with --group: the groups its filter dropped too"
    )
    parser.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="keep streaming until the job ends (exit code from its end)",
    )


async def tail(client: AsyncClient, args: argparse.Namespace) -> int:
    """The job's durable rows (or groups) as NDJSON, each line as it comes."""
    # One quick call first: a wrong address, token or job is said within
    # seconds; then the stream may wait out a restart of the daemon.
    await client.status(args.job_id)
    client.retry_deadline_s = FOLLOW_DEADLINE_S
    results = client.results(
        args.job_id, after=args.after, group=args.group, wait=args.follow, filtered=args.filtered
    )
    out = sys.stdout.buffer
    try:
        async with aclosing(results):  # a reader gone: the connection is let go now
            async for item in results:
                out.write(jsonx.dumps(item, orjson.OPT_APPEND_NEWLINE))
                out.flush()
    except BrokenPipeError:
        return _reader_left()
    return jobs_view.end_exit_code(results.final_state) if args.follow else 0


def _reader_left() -> int:
    """``tail | head``: the reader has what it wanted; leave quietly."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush must not fail
    return 0


def _pause_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ttl-s",
        type=positive_float,
        default=None,
        metavar="S",
        help="the pause ends by itself after this long (daemon's default 300, at most 3600)",
    )
    parser.add_argument(
        "--reason", metavar="TEXT", help="why, shown by `jobs list` and the daemon's log"
    )


async def pause(client: AsyncClient, args: argparse.Namespace) -> int:
    admission = await client.pause(ttl_s=args.ttl_s, reason=args.reason)
    _print(jobs_view.admission_line(admission) + "\n")
    return 0


async def resume(client: AsyncClient, args: argparse.Namespace) -> int:
    _print(jobs_view.admission_line(await client.resume()) + "\n")
    return 0


def _policy_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "version",
        nargs="?",
        type=int,
        metavar="VERSION",
        help="set the trainer's policy version (an integer >= 0; it also ends a pause)",
    )


async def policy(client: AsyncClient, args: argparse.Namespace) -> int:
    if args.version is None:
        version = await client.policy_version()
    else:
        version = await client.set_policy_version(args.version)
    _print(f"{version}\n")
    return 0


# --- submit -------------------------------------------------------------------------


def _submit_flags(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--input", metavar="PATH", help="a task file on the daemon's host, inside its --input-root"
    )
    source.add_argument(
        "--rows", type=Path, metavar="FILE", help="a JSONL file here, sent as the job's rows"
    )
    parser.add_argument(
        "--job-id", metavar="ID", help="the job's id (the same body again is the same job)"
    )
    parser.add_argument("--num-repeats", type=positive_int, metavar="N", help="rollouts per task")
    parser.add_argument("--default-agent", metavar="NAME", help="the agent of rows that name none")
    parser.add_argument(
        "--policy-version", type=int, metavar="V", help="the training step the job feeds"
    )
    parser.add_argument("--priority", type=int, metavar="P", help="higher runs first")
    parser.add_argument(
        "--metadata", type=_json_object, metavar="JSON", help="a JSON object kept with the job"
    )
    parser.add_argument(
        "--responses-create-params",
        type=_json_object,
        metavar="JSON",
        help="merged over each row's (a temperature, a token limit...)",
    )
    _step_flags(parser)
    parser.add_argument(
        "--wait", action="store_true", help="wait for the job's end (exit code from it)"
    )
    _json_flag(parser)


def _step_flags(parser: argparse.ArgumentParser) -> None:
    """Step control's fields (contracts §13): the daemon checks them."""
    parser.add_argument(
        "--target-groups", type=positive_int, metavar="N", help="satisfied at N kept groups"
    )
    parser.add_argument("--overprovision", type=float, metavar="F", help="start up to N x F groups")
    parser.add_argument(
        "--on-target", choices=("finish", "cancel"), help="the rollouts in flight then"
    )
    parser.add_argument(
        "--group-filter", choices=("nonzero_reward_std",), help="drop groups that teach nothing"
    )
    parser.add_argument(
        "--target-groups-by-agent",
        type=_json_object,
        metavar="JSON",
        help='exactly N kept groups of each agent: {"agent": N, ...}',
    )
    parser.add_argument(
        "--target-tokens", type=positive_int, metavar="N", help="satisfied at N generated tokens"
    )


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = jsonx.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    return value


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file (``-``: stdin); a bad line is an error naming file:line."""
    try:
        raw = sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--rows {path}: cannot read it ({exc.strerror})") from None
    rows = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = jsonx.loads(line)
        except ValueError as exc:
            raise ConfigError(f"--rows {path}:{number}: not JSON ({exc})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"--rows {path}:{number}: not a JSON object")
        rows.append(row)
    if not rows:
        raise ConfigError(f"--rows {path}: no rows")
    return rows


async def submit(client: AsyncClient, args: argparse.Namespace) -> int:
    rows = None if args.rows is None else await asyncio.to_thread(read_rows, args.rows)
    job = await client.submit(
        rows, input=args.input, job_id=args.job_id, num_repeats=args.num_repeats,
        default_agent=args.default_agent, policy_version=args.policy_version,
        priority=args.priority, metadata=args.metadata,
        responses_create_params=args.responses_create_params,
        target_groups=args.target_groups, overprovision=args.overprovision,
        on_target=args.on_target, group_filter=args.group_filter,
        target_groups_by_agent=args.target_groups_by_agent, target_tokens=args.target_tokens,
    )  # fmt: skip
    if not args.wait:
        _print_submitted(job, args.json)
        return 0
    if not args.json:
        _print(f"job {job.job_id}: {job.state.value}\n")
    # From here on a restart of the daemon is waited for: it resumes the job.
    client.retry_deadline_s = FOLLOW_DEADLINE_S
    final = await _wait(client, job.job_id, progress=sys.stderr.isatty())
    _print_submitted(final, args.json)
    return jobs_view.end_exit_code(final.state)


async def _wait(client: AsyncClient, job_id: str, progress: bool) -> JobStatus:
    """The job's status once final; on a terminal, one progress line meanwhile."""
    while True:
        job = await client.status(job_id)
        if progress:
            # Rewritten in place, then erased: stdout keeps only the end.
            line = "" if job.final else jobs_view.progress_line(job)
            sys.stderr.write(f"\r\033[K{line}")
            sys.stderr.flush()
        if job.final:
            return job
        await asyncio.sleep(WAIT_POLL_S)


def _print_submitted(job: JobStatus, as_json: bool) -> None:
    if as_json:
        _print_json(job.to_json())
    else:
        error = f": {job.error}" if job.error else ""
        _print(f"job {job.job_id}: {job.state.value}{error}\n")


# --- output -------------------------------------------------------------------------


def _print_status(job: JobStatus, as_json: bool) -> None:
    if as_json:
        _print_json(job.to_json())
    else:
        _print(jobs_view.render_job(job))


def _print_json(value: Any) -> None:
    # One line: jq pretty-prints, and a loop of submits gives one object a line.
    _print(jsonx.dumps(value, orjson.OPT_APPEND_NEWLINE).decode())


def _print(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


_ACTIONS: tuple[tuple[str, str, Callable[[argparse.ArgumentParser], None], Action], ...] = (
    ("list", "the daemon's jobs, a table (policy version and admission above it)",
     _list_flags, list_jobs),
    ("show", "one job's status", _show_flags, show),
    ("submit", "submit a job (the fields of POST /v1/jobs)", _submit_flags, submit),
    ("cancel", "cancel a job: its rollouts at the agents are cancelled, write nothing",
     _job_flag, cancel),
    ("tail", "a job's durable rows as NDJSON (--follow: until it ends)", _tail_flags, tail),
    ("pause", "stop every rollout from starting (around a weight update)", _pause_flags, pause),
    ("resume", "end the admission pause", lambda parser: None, resume),
    ("policy", "print the trainer's policy version, or set it", _policy_flags, policy),
)  # fmt: skip
