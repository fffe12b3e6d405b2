"""``dispatcher capture-proxy``: the capture proxy as a command of its own (its flags,
their checks, the server until a signal); ``proxy.py`` is the proxy itself."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dispatcher.capture.proxy import build_proxy_app
from dispatcher.capture.routing import (
    DEFAULT_MARGIN,
    RoutePolicy,
)
from dispatcher.commands import command_help
from dispatcher.delivery.limits import ProxyLimits
from dispatcher.errors import ConfigError
from dispatcher.settings.args import positive_int
from dispatcher.telemetry.http_app import serve_until_signal
from dispatcher.urls import redact_url


def add_parser(subparsers: Any) -> None:
    """Register ``capture-proxy --listen HOST:PORT --upstream URL --capture-dir DIR``."""
    p = subparsers.add_parser("capture-proxy", help=command_help("capture-proxy"))
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0 = any free port)")
    p.add_argument(
        "--upstream",
        required=True,
        action="append",
        help="model server root URL, e.g. http://h:8000; repeat it for replicas serving one model",
    )
    p.add_argument(
        "--route",
        choices=[policy.value for policy in RoutePolicy],
        help="how a call picks an upstream: round_robin (per call), session (a rollout's "
        "calls stay together), group (a task's repeats stay together; default with several)",
    )
    p.add_argument(
        "--route-margin",
        type=positive_int,
        default=DEFAULT_MARGIN,
        help="group, session: at every call, a pinned upstream with more than this many "
        "calls in flight above the least loaded one (a group's own not counted) is passed over "
        f"(default {DEFAULT_MARGIN})",
    )
    p.add_argument(
        "--session-release-url",
        help='POST {"session_id": ID} here once when the dispatcher ends a rollout',
    )
    p.add_argument("--capture-dir", required=True, type=Path, help="where capture files go")
    p.add_argument(
        "--upstream-timeout-s", type=float, default=600.0, help="limit for one whole model call"
    )
    _add_limit_flags(p)
    p.set_defaults(handler=_main, is_async=True)


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    defaults = ProxyLimits()
    p.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=defaults.max_request_bytes,
        help="largest request body; larger ones get 413 (default 64 MiB)",
    )
    p.add_argument(
        "--max-record-bytes",
        type=positive_int,
        default=defaults.max_record_bytes,
        help="largest answer kept for the record, raw plus decoded (default 64 MiB)",
    )
    p.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=defaults.max_concurrency,
        help="calls handled at once; more wait (default 1024)",
    )


def _limits_from(args: argparse.Namespace) -> ProxyLimits:
    return ProxyLimits(args.max_request_bytes, args.max_record_bytes, args.max_concurrency)


async def _main(args: argparse.Namespace) -> int:
    for url in [*args.upstream, *([args.session_release_url] if args.session_release_url else [])]:
        if not str(url).startswith(("http://", "https://")):
            raise ConfigError(f"{redact_url(url)!r}: expected an http(s) URL")
    if args.upstream_timeout_s <= 0:
        raise ConfigError("--upstream-timeout-s must be > 0")
    app = build_proxy_app(
        args.upstream,
        args.capture_dir,
        upstream_timeout_s=args.upstream_timeout_s,
        limits=_limits_from(args),
        route=RoutePolicy(args.route) if args.route else None,
        route_margin=args.route_margin,
        release_url=args.session_release_url,
    )
    return await serve_until_signal(app, args.listen, "capture-proxy")
