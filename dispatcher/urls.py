"""Agent URLs: checked once at start, and shown only with their credentials masked.

A replica URL may carry ``user:password@``; aiohttp turns that into an
``Authorization`` header. The password must never reach ``/status``, a row's
``_ng_dispatch.replica``, a log line or an error message, so everything that
displays a URL goes through ``redact_url``.
"""

from __future__ import annotations

from yarl import URL

MASK = "***"


def redact_url(url: str) -> str:
    """``url`` with its password (or a lone user token) replaced by ``***``."""
    try:
        parsed = URL(url)
    except (TypeError, ValueError):
        return _redact_text(url)
    if parsed.password is None and parsed.user is None:
        return url
    if parsed.password is None:
        # A lone token (``http://TOKEN@host``) is as secret as a password.
        return str(parsed.with_user(MASK))
    return str(parsed.with_password(MASK))


def _redact_text(url: str) -> str:
    # Unparseable: cut everything between the scheme and the last "@" of the authority.
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    if not sep or "@" not in authority:
        return url
    return f"{scheme}://{MASK}@{authority.rpartition('@')[2]}{slash}{path}"


def agent_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be an agent's base URL, or None when it can."""
    if any(c.isspace() for c in url):
        return "contains white space"
    try:
        parsed = URL(url)
        port = parsed.port
    except (TypeError, ValueError) as exc:
        return f"is not a valid URL ({exc})"
    if parsed.scheme not in ("http", "https"):
        return "is not an http(s) URL"
    if not parsed.raw_host:
        return "has no host"
    if port is None or not 0 < port < 65536:
        return "has a port outside 1-65535"
    if parsed.raw_query_string or parsed.raw_fragment:
        return "has a query or fragment (the dispatcher appends /run to the base URL)"
    if parsed.path.rstrip("/").endswith("/run"):
        # The README says agents serve POST /run: an easy slip, and every
        # rollout would go to .../run/run and get a 404.
        return "ends in /run: give the base URL, the dispatcher appends /run"
    return None
