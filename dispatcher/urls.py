"""Agent URLs: checked once at start, and shown only with their credentials masked.

A replica URL may carry ``user:password@``; aiohttp turns that into an
``Authorization`` header. The password must never reach ``/status``, a row's
``_ng_dispatch.replica``, a log line or an error message, so everything that
displays a URL goes through ``redact_url`` (a replica, ``replica_names``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from urllib.parse import unquote

import orjson
from yarl import URL

MASK = "***"


def redact_url(url: str) -> str:
    """``url`` with its password (or a lone user token) replaced by ``***``.

    Done on the text, not on a parsed URL: a value that does not parse (a
    flag like ``=http://u:pw@h``, a port out of range, no scheme) must not
    come back with its password in the error that says so.
    """
    span = _secret_span(url)
    if span is None:
        return url
    before, _, after = span
    return f"{before}{MASK}{after}"


def _secret_span(url: str) -> tuple[str, str, str] | None:
    """``url`` as (what precedes its secret, its password or lone user token, what
    follows), or None when it carries no credentials; on the text (``redact_url``)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    # The last "@" ends the user info: a password may hold an unescaped "@",
    # "/", "?" or "#" (a base64 token). A base URL has no "@" after its host,
    # so nothing but credentials is masked in practice.
    userinfo, at, tail = rest.rpartition("@")
    if not at:
        return None
    user, colon, password = userinfo.partition(":")
    if colon and "/" not in user:
        return f"{scheme}{sep}{user}:", password, f"@{tail}"
    # A lone token (``http://TOKEN@host``) is as secret as a password.
    return f"{scheme}{sep}", userinfo, f"@{tail}"


def redact_urls(text: str) -> str:
    """``text`` (a flag's value, a comma-separated list of URLs) with every URL redacted."""
    return ",".join(redact_url(part) for part in text.split(","))


def replica_names(urls: Sequence[str]) -> list[str]:
    """How each replica of one agent is shown: redacted, and never two alike.

    URLs that differ only in their credentials (or are repeated) redact to one
    text; the second and later get ``#2``, ``#3``... (a fragment: no agent
    URL has one), so views, metric labels and rows keep them apart.
    """
    seen: Counter[str] = Counter()
    names = []
    for url in urls:
        shown = redact_url(url)
        seen[shown] += 1
        names.append(shown if seen[shown] == 1 else f"{shown}#{seen[shown]}")
    return names


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
    if parsed.user is not None and ":" in parsed.user:
        # RFC 3986 lets a user name carry %3A; Basic auth (RFC 7617) cannot send it:
        # the agent would split it at its first ":" and see another user.
        return "has a ':' (%3A) in its user name, which Basic auth cannot send (RFC 7617)"
    if parsed.raw_query_string or parsed.raw_fragment:
        return "has a query or fragment (the dispatcher appends /run to the base URL)"
    if parsed.path.rstrip("/").endswith("/run"):
        # The README says agents serve POST /run: an easy slip, and every
        # rollout would go to .../run/run and get a 404.
        return "ends in /run: give the base URL, the dispatcher appends /run"
    return None


# Secrets this process knows (the API token, agents' passwords): masked in every
# line it writes, whatever message carries them. Shorter ones are not searched
# for: masking every "ab" would garble the log and hide nothing worth hiding.
_SECRETS: set[str] = set()
MIN_SECRET_CHARS = 4


def hide_secret(secret: str) -> None:
    """Mask ``secret`` in every log line and error message from now on."""
    if len(secret) < MIN_SECRET_CHARS:
        return
    # As a JSON line shows it too (a quote or backslash escaped).
    for shown in (secret, orjson.dumps(secret).decode()[1:-1]):
        _SECRETS.add(shown)


def hide_url_secret(url: str) -> None:
    """Mask the password (or lone token) of ``url``, as written and as decoded."""
    span = _secret_span(url)
    if span is None:
        return
    secret = span[1]
    hide_secret(secret)
    hide_secret(unquote(secret))


def forget_secrets() -> None:
    """Mask no secret any more (for tests)."""
    _SECRETS.clear()


def scrub(text: str) -> str:
    """``text`` with every known secret replaced by ``***``."""
    for secret in _SECRETS:
        if secret in text:
            text = text.replace(secret, MASK)
    return text
