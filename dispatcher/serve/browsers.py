"""Requests a browser could send without asking are refused (contracts §14), token or not.

A web page can make its visitor's browser send a cross-origin POST with a
``text/plain`` or form body and no preflight; a DNS-rebinding page (its own
name pointed at 127.0.0.1) then even reads the answers, under its own
``Host``. Any browser that reaches the port (on the same host, or through an
``ssh -L`` tunnel) would do. So every request but a GET of ``/metrics`` or
``/healthz`` (scrapers and probes name their target as they found it):

- must carry a ``Host`` that names the listener: a loopback name for a
  loopback listener, an address for a wildcard one, the listen host itself,
  or a name given with ``--allowed-host`` (a Service's or an ingress's name).
  The port is not compared: tunnels and port forwards change it, and a
  rebinding page cannot choose the name its own requests carry (421);
- must not carry an ``Origin`` other than the host:port it was sent to (403):
  browsers send it on every cross-origin request and on same-origin POSTs,
  our clients never;
- a POST must say ``Content-Type: application/json`` (415): the one body type
  a browser will not send cross-origin before a preflight we never answer.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import hdrs, web
from aiohttp.typedefs import Middleware

from dispatcher.errors import ConfigError
from dispatcher.telemetry.server import json_response

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Open to GETs whatever their Host: a scrape or a probe, no rows in them.
PROBE_PATHS = frozenset({"/metrics", "/healthz"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
# Methods whose body a browser sends cross-origin without a preflight.
_BODY_METHODS = frozenset({hdrs.METH_POST, hdrs.METH_PUT, hdrs.METH_PATCH})
JSON = "application/json"


@dataclass(frozen=True)
class Hosts:
    """The host names that name the listener (lower case, no port)."""

    names: frozenset[str]
    # "*.example.org" given: any name ending ".example.org".
    suffixes: tuple[str, ...] = ()
    # A wildcard listener answers on each of its addresses: any address literal.
    any_address: bool = False
    # "--allowed-host *": behind a proxy that checks Host itself.
    any_name: bool = False

    def allows(self, name: str) -> bool:
        if self.any_name or name in self.names or name.endswith(self.suffixes):
            return True
        return self.any_address and _is_address(name)


def hosts_for(listen_host: str, allowed: Iterable[str]) -> Hosts:
    """The names of a listener on ``listen_host`` plus ``--allowed-host``; ``ConfigError``
    (exit 2) for one that is not a host name."""
    names = {listen_host.lower()}
    wildcard = listen_host in WILDCARD_HOSTS
    if wildcard or is_loopback(listen_host):
        names |= LOOPBACK_NAMES
    suffixes: list[str] = []
    any_name = False
    for value in allowed:
        name = _checked_name(value)
        if name == "*":
            any_name = True
        elif name.startswith("*."):
            suffixes.append(name[1:])
        else:
            names.add(name)
    return Hosts(frozenset(names), tuple(suffixes), wildcard, any_name)


def _checked_name(value: str) -> str:
    name = value.strip().lower().rstrip(".").removeprefix("[").removesuffix("]")
    bare = name.removeprefix("*.")
    # A port (host:8080) would never match: Host values are compared without theirs.
    port = ":" in bare and not _is_address(bare)
    if name != "*" and (not bare or port or any(c in bare for c in "/@ *?#[]")):
        raise ConfigError(
            f"--allowed-host {value!r}: a host name or address without scheme or port "
            "(or '*.DOMAIN', or '*')"
        )
    return name


def guard(hosts: Hosts) -> Middleware:
    """The middleware refusing what a browser sends unasked (see the module docstring)."""

    @web.middleware
    async def refuse_browsers(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method in (hdrs.METH_GET, hdrs.METH_HEAD) and request.path in PROBE_PATHS:
            return await handler(request)
        problem = refusal(request, hosts)
        if problem is not None:
            status, message = problem
            response = json_response({"error": message}, status=status)
            # The body of a refused request is not read: nothing more on this connection.
            response.force_close()
            return response
        return await handler(request)

    return refuse_browsers


def refusal(request: web.Request, hosts: Hosts) -> tuple[int, str] | None:
    """Why a request may not pass (status, one line), or None."""
    host = request.headers.get(hdrs.HOST)
    if host is None:
        return 400, "Host: missing; send the host:port you connected to"
    if not hosts.allows(host_name(host)):
        return 421, (
            f"Host: {host!r} does not name this listener; start the daemon with "
            "--allowed-host NAME to serve requests for that name"
        )
    origin = request.headers.get(hdrs.ORIGIN)
    if origin is not None and not _same_origin(origin, host):
        return (
            403,
            f"Origin: {origin!r} is not this listener's: requests from web pages are refused",
        )
    if request.method in _BODY_METHODS and request.content_type != JSON:
        given = request.headers.get(hdrs.CONTENT_TYPE, "none")
        return 415, f"Content-Type: {given!r}: the jobs API takes {JSON} bodies only"
    return None


def host_name(authority: str) -> str:
    """The name of a ``Host`` value (``name:port``, ``[v6]:port``), lower case, no port."""
    value = authority.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def _same_origin(origin: str, host: str) -> bool:
    """Whether ``origin`` is the page of the very host:port the request was sent to (its
    default port either way); any other page, a "null" one included, is foreign."""
    parts = urlsplit(origin.strip())
    default = {"http": ":80", "https": ":443"}.get(parts.scheme)
    if default is None or not parts.netloc:
        return False  # "null", a file: page, an extension
    return parts.netloc.lower().removesuffix(default) == host.strip().lower().removesuffix(default)


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback name or address (a name that may resolve to
    anything is not)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
