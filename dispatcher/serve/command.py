"""``dispatcher serve``: one daemon for a whole training run (contracts §12).

The table of contents is ``serve``: lock the state directory, bind the
listener (jobs API, /metrics, /healthz, /status), start the daemon, resume
every unfinished job, then serve until SIGTERM/SIGINT or the budget's end;
shutdown runs the exit stack in reverse (jobs settle with the grace, then the
daemon, the listener last).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import structlog

from dispatcher.commands import command_help
from dispatcher.errors import ConfigError, ExitCode
from dispatcher.latency.window import LatencyWindow
from dispatcher.run.daemon import Daemon
from dispatcher.run.policy_clock import PolicyClock
from dispatcher.serve import api, auth
from dispatcher.serve.jobs import Service
from dispatcher.serve.registry import Registry
from dispatcher.settings.config import RunSettings, flag_for, layered, load_settings
from dispatcher.settings.gym_head import HeadUnreachable
from dispatcher.settings.serve import SERVE_KEYS, ServeLimits
from dispatcher.telemetry.discovery import sd_file_for, service_labels
from dispatcher.telemetry.http_app import listen_address
from dispatcher.telemetry.logs import configure_logging
from dispatcher.telemetry.progress import write_line

log = structlog.get_logger("dispatcher.serve")

# Loopback: the jobs API reaches beyond the host only when asked (contracts §14).
DEFAULT_LISTEN = "127.0.0.1:8080"

# How long `--gym-head-server` may not answer yet (a Gym stack started beside us).
DEFAULT_HEAD_WAIT_S = 300.0
# How often a head server that does not answer yet is asked again.
_HEAD_RETRY_S = 0.5
# How long a thread that wants the GIL waits for the loop's thread to let it go
# (Python's default: 5 ms). The journal's thread makes a dozen system calls a
# commit, each a hand-off of the GIL that a busy loop made a wait of up to 5 ms:
# at 1 ms a submit's p99 in the daemon fell 20 % (bench/many_jobs.py, 3 runs
# each way), its CPU a job did not rise.
SWITCH_INTERVAL_S = 0.001

# Flags of `run` that belong to a job (its body says them) or to `run` alone
# (`--fresh` would move a job's files aside at each of its hops).
_NOT_SERVE_FLAGS = frozenset(
    {
        "--input",
        "--output",
        "--limit",
        "--shard",
        "--metrics-listen",
        "--fresh",
        # Agents may start after a daemon that lives for days: they are probed back.
        "--wait-for-agents-s",
        # The service keeps its task history in its state directory.
        "--task-history",
    }
)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from dispatcher.settings.flags import add_run_arguments
    from dispatcher.settings.serve import add_serve_limit_arguments

    parser = subparsers.add_parser(
        "serve",
        help=command_help("serve"),
        description=(
            "Serves the jobs API (POST/GET/DELETE /v1/jobs, /v1/jobs/ID/results, /v1/policy), "
            "/metrics, /healthz and /status on --listen. Each job is a run of its own under "
            "STATE_DIR/jobs/ID. After any kill, the same command resumes every unfinished "
            "job. Takes the flags of `dispatcher run` that are not a job's."
        ),
    )
    # No defaults here: a flag not given takes DISPATCHER_* or the config file's value.
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help=f"address to serve on (default {DEFAULT_LISTEN}; beyond loopback needs a token)",
    )
    parser.add_argument("--state-dir", metavar="DIR", help="the job registry (required)")
    _add_access_arguments(parser)
    parser.add_argument(
        "--max-off-policy-steps",
        metavar="K",
        help="a job for policy version p starts rollouts only once the trainer's version "
        "is >= p - K (default: no pacing)",
    )
    parser.add_argument(
        "--gym-head-server-wait-s",
        metavar="S",
        help="with --gym-head-server: wait this long for the head server to answer "
        f"(default {DEFAULT_HEAD_WAIT_S:g}), then exit 2",
    )
    add_serve_limit_arguments(parser)
    add_run_arguments(parser, exclude=_NOT_SERVE_FLAGS)
    parser.set_defaults(handler=serve_command, is_async=True)


async def serve_command(args: argparse.Namespace) -> int:
    from dispatcher.aio import tune_gc
    from dispatcher.heap import one_heap
    from dispatcher.settings.flags import budget_seconds, run_flag_values
    from dispatcher.settings.serve import serve_limits

    # Before any thread starts: a daemon's threads share one heap (heap.py).
    one_heap()
    _take_layers(args, os.environ)
    host, _ = listen_address(args.listen)  # a bad address is named as --listen
    access = _access(args, host)
    limits = serve_limits(args)
    state_dir = Path(args.state_dir)
    values = run_flag_values(args)
    # Jobs name their own files; these are placeholders the daemon never opens.
    values.update(
        input=state_dir / "jobs", output=state_dir / "jobs" / "x.jsonl", metrics_listen=args.listen
    )
    settings = await _settings(values, _head_wait_s(args.gym_head_server_wait_s))
    configure_logging(settings.log_format, level=settings.log_level)
    tune_gc()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    steps = _steps(args.max_off_policy_steps)
    budget_s = budget_seconds(settings)
    return int(await serve(settings, state_dir, steps, budget_s, access, limits))


async def _settings(values: dict[str, Any], wait_s: float) -> RunSettings:
    """The settings, once the Gym head server answers (``--gym-head-server-wait-s``):
    `serve` may start beside a trainer that starts Gym's stack."""
    deadline = time.monotonic() + wait_s
    waiting = False
    while True:
        try:
            return await asyncio.to_thread(load_settings, values)
        except HeadUnreachable as exc:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise ConfigError(
                    f"{exc} (waited {wait_s:g} s: --gym-head-server-wait-s)"
                ) from None
            if not waiting:
                waiting = True
                _early_logging(values)
                log.info("gym_head_server_waiting", error=str(exc), wait_s=wait_s)
            await asyncio.sleep(min(_HEAD_RETRY_S, left_s))


def _early_logging(values: Mapping[str, Any]) -> None:
    """Logging as the flags ask, before the settings are whole (they wait for the head)."""
    fmt = values.get("log_format")
    configure_logging(fmt if fmt in ("json", "console") else None)


def _head_wait_s(value: str | None) -> float:
    if value is None:
        return DEFAULT_HEAD_WAIT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise ConfigError(f"--gym-head-server-wait-s {value!r}: must be a number of seconds >= 0")
    return seconds


def _take_layers(args: argparse.Namespace, env: Mapping[str, str]) -> None:
    """Serve's own flags as `run`'s: a flag over ``DISPATCHER_*`` over the config file."""
    cli = {key: getattr(args, key, None) for key in SERVE_KEYS}
    cli["config"] = args.config
    for key, (value, source) in layered(SERVE_KEYS, cli, env).items():
        setattr(args, key, _as_flag(key, value, source))
    if args.state_dir is None:
        raise ConfigError(
            "--state-dir: required (the flag, DISPATCHER_STATE_DIR or state_dir in the config file)"
        )
    args.listen = args.listen or DEFAULT_LISTEN
    args.allow_unauthenticated = bool(args.allow_unauthenticated)


_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


def _as_flag(key: str, value: Any, source: str) -> Any:
    """A value from the environment or the file as its flag gives it: text (the
    flag's own check then names a bad one), or a switch's bool."""
    flag = flag_for(key)
    if key == "allow_unauthenticated":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(f"{flag} (from {source}): {value!r} is not true or false")
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(f"{flag} (from {source}): {value!r} must be a string or a number")
    return str(value)


def _add_access_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-token-file",
        metavar="PATH",
        help="every request but /metrics and /healthz must send 'Authorization: Bearer' this "
        f"file's token (or set {auth.TOKEN_ENV})",
    )
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        default=None,
        help="listen beyond loopback without a token: anyone who connects may submit jobs",
    )
    parser.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate")
    parser.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    parser.add_argument(
        "--allowed-host",
        action="append",
        metavar="NAME",
        help="a host name clients reach the daemon by (a Service's, an ingress's), besides "
        "the listen address and, on loopback, localhost; '*.DOMAIN' for its subdomains; "
        "repeatable. Other Host headers answer 421",
    )
    parser.add_argument(
        "--input-root",
        metavar="DIR",
        help="a job's input file must resolve inside DIR (default: the working directory)",
    )


def _access(args: argparse.Namespace, host: str) -> auth.Access:
    return auth.access_from_flags(
        listen=args.listen,
        host=host,
        token_file=args.api_token_file,
        allow_unauthenticated=args.allow_unauthenticated,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        input_root=args.input_root,
        allowed_hosts=args.allowed_host or [],
        env=os.environ,
    )


def _steps(value: str | None) -> int | None:
    if value is None:
        return None
    if not value.strip().isdigit():
        raise ConfigError(f"--max-off-policy-steps {value!r}: must be an integer >= 0")
    return int(value)


async def serve(
    settings: RunSettings,
    state_dir: Path,
    max_off_policy_steps: int | None,
    budget_s: float | None,
    access: auth.Access,
    limits: ServeLimits,
) -> ExitCode:
    """Run the daemon until a stop; the exit code (75 while jobs are unfinished)."""
    async with serving(
        settings, state_dir, max_off_policy_steps, budget_s, access, limits
    ) as service:
        _announce(service.daemon, state_dir, access)
        await service.daemon.stop_requested.wait()
    return service.exit_code()


@contextlib.asynccontextmanager
async def serving(
    settings: RunSettings,
    state_dir: Path,
    max_off_policy_steps: int | None,
    budget_s: float | None,
    access: auth.Access,
    limits: ServeLimits,
) -> AsyncIterator[Service]:
    """The service of ``state_dir``, listening, its unfinished jobs resumed; on exit
    its jobs settle with the grace, then the daemon, the listener last."""
    registry = Registry(state_dir)
    await asyncio.to_thread(registry.lock)
    try:
        daemon = Daemon(settings, budget_s=budget_s, latency=LatencyWindow())
        daemon.policy = PolicyClock(await asyncio.to_thread(registry.read_policy))
        daemon.stop_at_budget_end = True
        service = Service(
            daemon, settings, registry, max_off_policy_steps, access.input_root, limits
        )
        routes = auth.protect(api.routes(service), access.token, access.hosts)
        async with contextlib.AsyncExitStack() as stack:
            await daemon.listen(
                service.status,
                daemon.healthy,
                routes,
                limits.max_body_bytes,
                tls=access.tls,
                header_timeout_s=limits.header_timeout_s,
                flag="--listen",
            )
            stack.push_async_callback(daemon.close)
            await daemon.start(service.status)
            # Before anything may start: a pause the last daemon left is still on.
            await service.restore_pause()
            daemon.begin_dispatch()
            stack.push_async_callback(service.close)
            await service.resume()
            await service.start_threads()
            await asyncio.to_thread(_publish_target, daemon, state_dir, settings)
            yield service
    finally:
        registry.unlock()


def _publish_target(daemon: Daemon, state_dir: Path, settings: RunSettings) -> None:
    """The Prometheus file_sd target of the service, as `run` writes one (blocking): in
    ``--metrics-sd-dir``, else ``STATE_DIR/serve_prometheus.json``; removed at stop."""
    endpoint = daemon.metrics_endpoint
    assert endpoint is not None
    labels = service_labels(state_dir, endpoint.scheme)
    endpoint.publish(sd_file_for(state_dir / "serve.jsonl", settings.metrics_sd_dir), labels)


def _announce(daemon: Daemon, state_dir: Path, access: auth.Access) -> None:
    endpoint = daemon.metrics_endpoint
    assert endpoint is not None
    url = endpoint.url.removesuffix("/metrics")
    log.info(
        "serve_started",
        url=url,
        state_dir=str(state_dir),
        policy_version=daemon.policy_version(),
        # Whether a token guards the API; never the token.
        auth="bearer" if access.token is not None else "none",
        input_root=str(access.input_root),
    )
    # The one line other programs wait for: it means the jobs API accepts requests.
    # On a terminal it never shares a row with the progress line (on stderr).
    write_line(sys.stdout, f"dispatcher serve listening on {url}")
