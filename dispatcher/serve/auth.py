"""Who may use the service (contracts §14): the bearer token, where it may listen, TLS.

The jobs API starts work on the agents, reads files on the daemon's host and
returns every row: it is for the trainer alone. With a token, every request
but ``/metrics`` and ``/healthz`` (open, as Prometheus and probes expect)
must say ``Authorization: Bearer <token>``; anything else is a 401 with a
one-line JSON error. Without one, the daemon listens on loopback only, unless
``--allow-unauthenticated`` says otherwise. Token or not, what a web page
could make a browser send is refused first (``browsers.py``).

The token is read once, here, and lives only in the middleware's closure: it
is no setting (``RunSettings`` is logged and dumped), never logged, never
written to the state directory and never part of an answer.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import ssl
import stat
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog
from aiohttp import hdrs, web
from aiohttp.typedefs import Middleware

from dispatcher.errors import ConfigError
from dispatcher.serve.browsers import Hosts, guard, hosts_for, is_loopback
from dispatcher.telemetry.server import Routes, json_response
from dispatcher.urls import hide_secret

log = structlog.get_logger("dispatcher.serve")

TOKEN_ENV = "DISPATCHER_API_TOKEN"
# Open to anyone who reaches the port: scrapes and liveness probes carry no token.
OPEN_PATHS = frozenset({"/metrics", "/healthz"})
# What a header can carry: visible ASCII, no space (RFC 6750's b64token and more).
_TOKEN_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Access:
    """How the listener is guarded: the token (None: open), TLS, the input root, the
    host names that name it (``browsers.py``)."""

    token: str | None
    tls: ssl.SSLContext | None
    input_root: Path
    hosts: Hosts

    def __repr__(self) -> str:
        # Never the token, whatever prints this.
        shown = "set" if self.token is not None else None
        return f"Access(token={shown}, tls={self.tls is not None}, input_root={self.input_root})"


def access_from_flags(
    *,
    listen: str,
    host: str,
    token_file: str | None,
    allow_unauthenticated: bool,
    tls_cert: str | None,
    tls_key: str | None,
    input_root: str | None,
    allowed_hosts: list[str],
    env: Mapping[str, str],
) -> Access:
    """Check the flags of ``serve`` that guard it; ``ConfigError`` (exit 2) naming the flag."""
    token = load_token(token_file, env)
    check_exposure(listen, host, token, allow_unauthenticated)
    hosts = hosts_for(host, allowed_hosts)
    return Access(token, tls_context(tls_cert, tls_key), _input_root(input_root), hosts)


# ---- the token ------------------------------------------------------------------------


def load_token(path: str | None, env: Mapping[str, str]) -> str | None:
    """The token of ``--api-token-file`` (it wins) or ``DISPATCHER_API_TOKEN``; None for neither."""
    if path is not None:
        return _checked(_read_token_file(Path(path)), f"--api-token-file {path}")
    value = env.get(TOKEN_ENV)
    if value is None:
        return None
    return _checked(value, TOKEN_ENV)


def _read_token_file(path: Path) -> str:
    try:
        raw = path.read_bytes()
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(f"--api-token-file {path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"--api-token-file {path}: cannot read it ({exc.strerror})") from None
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("api_token_file_readable_by_others", path=str(path), mode=oct(mode & 0o777))
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise ConfigError(f"--api-token-file {path}: not a text file") from None


def _checked(value: str, where: str) -> str:
    # One trailing newline is how files end: strip the white space around it.
    token = value.strip()
    hide_secret(token)
    if not token:
        raise ConfigError(f"{where}: the token is empty")
    if not set(token) <= _TOKEN_CHARS:
        raise ConfigError(f"{where}: the token must be visible ASCII without spaces")
    return token


# ---- the listener ---------------------------------------------------------------------


def check_exposure(listen: str, host: str, token: str | None, allow: bool) -> None:
    """Beyond loopback, the jobs API needs a token, or the operator's word that it may not."""
    if token is not None or is_loopback(host):
        return
    if not allow:
        raise ConfigError(
            f"--listen {listen}: beyond loopback the jobs API needs --api-token-file "
            f"(or {TOKEN_ENV}); --allow-unauthenticated serves it to anyone who can connect"
        )
    log.warning("serve_unauthenticated", listen=listen)


def tls_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The server's TLS context of ``--tls-cert`` and ``--tls-key`` (both or neither)."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise ConfigError(f"{flag} {path}: not a readable file")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        # An empty password: an encrypted key fails here instead of prompting.
        context.load_cert_chain(cert, key, password="")
    except ssl.SSLError:
        raise ConfigError(_which_tls_file(cert, key)) from None
    return context


def _which_tls_file(cert: str, key: str) -> str:
    try:
        ssl.create_default_context().load_verify_locations(cafile=cert)
    except ssl.SSLError:
        return f"--tls-cert {cert}: not a PEM certificate"
    return f"--tls-key {key}: not an unencrypted PEM private key of --tls-cert {cert}"


def _input_root(value: str | None) -> Path:
    try:
        root = Path(value if value is not None else os.getcwd()).resolve()
    except (OSError, RuntimeError) as exc:
        raise ConfigError(f"--input-root {value}: {_unresolved(exc)}") from None
    if not root.is_dir():
        raise ConfigError(f"--input-root {value}: not a directory")
    return root


def _unresolved(exc: OSError | RuntimeError) -> str:
    """Why a path did not resolve: Python 3.11 and 3.12 raise RuntimeError for a
    symlink loop, later ones OSError(ELOOP)."""
    if isinstance(exc, RuntimeError) or exc.errno == errno.ELOOP:
        return "a symlink loop"
    return f"cannot resolve it ({exc.strerror})"


# ---- the middleware -------------------------------------------------------------------


def protect(routes: Routes, token: str | None, hosts: Hosts) -> Routes:
    """``routes`` behind the refusal of what browsers send unasked (token or not), and
    with the token required on everything but ``OPEN_PATHS`` (when there is one)."""

    def add(app: web.Application) -> None:
        # The outermost: nothing else runs for a request without the token
        # (not even the 503 of a daemon still reading its registry), nor for
        # one a web page made.
        if token is not None:
            app.middlewares.insert(0, _middleware(token))
        app.middlewares.insert(0, guard(hosts))
        routes(app)

    return add


def _middleware(token: str) -> Middleware:
    # Digests of equal length: compare_digest then reveals not even the token's length.
    expected = hashlib.sha256(token.encode()).digest()

    @web.middleware
    async def require_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        problem = _refusal(request.headers.get(hdrs.AUTHORIZATION), expected)
        if problem is not None:
            return _unauthorized(*problem)
        return await handler(request)

    return require_token


def _refusal(header: str | None, expected: bytes) -> tuple[str, str] | None:
    """Why the request may not pass (the message, the RFC 6750 error code), or None."""
    if header is None:
        return (
            f"unauthorized: send Authorization: Bearer <token> (the daemon's "
            f"--api-token-file or {TOKEN_ENV})",
            "",
        )
    scheme, _, given = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return "unauthorized: the Authorization header is not a Bearer token", "invalid_request"
    digest = hashlib.sha256(given.strip().encode("utf-8", "replace")).digest()
    if not hmac.compare_digest(digest, expected):
        return "unauthorized: the bearer token is wrong", "invalid_token"
    return None


def _unauthorized(message: str, code: str) -> web.Response:
    response = json_response({"error": message}, status=401)
    challenge = 'Bearer realm="dispatcher"'
    response.headers[hdrs.WWW_AUTHENTICATE] = f'{challenge}, error="{code}"' if code else challenge
    return response
