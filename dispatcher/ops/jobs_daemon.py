"""Which daemon ``dispatcher jobs`` talks to and how (its address, token and trusted
certificate, from flags or the environment), and its refusals said as one line for
the command line: what to check, and the exit code."""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from dispatcher.client.wire import TOKEN_ENV, ClientError, Unauthorized, resolve_token
from dispatcher.errors import ConfigError, DispatcherError, ExitCode

URL_ENV = "DISPATCHER_URL"
DEFAULT_URL = "http://127.0.0.1:8080"  # `dispatcher serve`'s default --listen


class DaemonError(DispatcherError):
    """What the daemon answered, or that it did not, said for the command line."""

    def __init__(self, message: str, exit_code: ExitCode = ExitCode.BAD_INPUT) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Daemon:
    """Where the daemon is and how this command authenticates (never shown: the token)."""

    url: str
    token: str | None
    token_from: str | None
    trust: ssl.SSLContext | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Daemon:
        url = (args.address or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
        if not url.startswith(("http://", "https://")):
            where = "--address" if args.address else URL_ENV
            raise ConfigError(f"{where}: {url!r} is not an http(s) URL (http://HOST:PORT)")
        trust = None if args.tls_ca_file is None else _trust(args.tls_ca_file)
        if args.api_token_file is None:
            token = resolve_token(None)
            return cls(url, token, TOKEN_ENV if token is not None else None, trust)
        token_from = f"--api-token-file {args.api_token_file}"
        return cls(url, _read_token(args.api_token_file), token_from, trust)


def _trust(path: Path) -> ssl.SSLContext:
    """A context that trusts the certificates in ``path`` (a CA's, or a self-signed one)."""
    try:
        return ssl.create_default_context(cafile=str(path))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"--tls-ca-file {path}: not a PEM certificate file ({exc})") from None


def _read_token(path: Path) -> str:
    try:
        token = resolve_token(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-token-file {path}: cannot read it ({exc})") from None
    if token is None:
        raise ConfigError(f"--api-token-file {path}: the file is empty")
    return token


def said(exc: ClientError, daemon: Daemon, job_id: str | None) -> DaemonError:
    """A client error as one line naming what to check; exit 2 unless the daemon failed."""
    url = daemon.url
    if isinstance(exc, Unauthorized):
        return DaemonError(_token_refused(daemon))
    if exc.http_status is None:  # no HTTP answer came
        return _no_answer(exc.message, url)
    if exc.status == 404 and job_id is not None:
        return DaemonError(f"no job {job_id!r} at the daemon at {url} (`dispatcher jobs list`)")
    if exc.status < 500:
        return DaemonError(f"the daemon at {url} refused it: {exc.status}: {exc.message}")
    message = f"the daemon at {url} failed: {exc.status}: {exc.message}"
    return DaemonError(message, ExitCode.UNEXPECTED)


def _token_refused(daemon: Daemon) -> str:
    if daemon.token is None:
        return (
            f"the daemon at {daemon.url} wants an API token and none was given: "
            f"pass --api-token-file FILE or set {TOKEN_ENV}"
        )
    return (
        f"the daemon at {daemon.url} refused the API token of {daemon.token_from}: it is "
        "not the one the daemon was started with (its --api-token-file)"
    )


def _no_answer(message: str, url: str) -> DaemonError:
    """No HTTP answer: nothing listens there, a certificate not trusted, or a bad answer."""
    if "CERTIFICATE_VERIFY_FAILED" in message:
        return DaemonError(
            f"the daemon at {url} has a certificate this command does not trust: pass "
            "--tls-ca-file FILE (its CA's certificate, or its own if self-signed)"
        )
    if message.startswith(("no answer within", "POST /v1/jobs: ")):
        why = message.split(" [", 1)[0]  # aiohttp's "[Connect call failed (...)]" repeats it
        return DaemonError(
            f"no answer from a daemon at {url} ({why}): is `dispatcher serve` running "
            f"there? The address is --address or {URL_ENV} (default {DEFAULT_URL})"
        )
    return DaemonError(f"the daemon at {url}: {message}", ExitCode.UNEXPECTED)
