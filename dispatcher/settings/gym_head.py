"""Agents from a running NeMo Gym head server (contracts §15, ``--gym-head-server``).

A Gym stack started with ``gym env start`` has a head server whose
``GET /global_config_dict_yaml`` answers the whole merged config: a JSON string
holding OmegaConf's YAML. Each top-level instance is
``{name: {server_type: {implementation: {host, port, ...}}}}``.

An agent name resolves the way Gym's collector resolves it (``run_examples``):
the name must be an instance with ``responses_api_agents``; its rows go to
``POST /run`` of the one environment server whose ``agent_server.name`` is
that agent (Gym 0.7.0 puts a ``legacy_agent`` relay in front of every
agent), or, in a config with no environment server for it (Gym before
environment servers), to the agent itself. Like Gym's ``ServerClient``, the
URL is ``http://{host}:{port}`` of the first implementation under the
instance: one replica per agent. An agent fronted by several environment
servers cannot be routed by name (Gym refuses it too); it is left out, with
the reason logged, so a run whose rows name it stops on "not configured".

The fetch is blocking: it runs once at start-up, before any task exists. It has
a total deadline, follows no redirect (the config must come from the server
named) and reads at most a bounded number of bytes.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from yarl import URL

from dispatcher.errors import ConfigError
from dispatcher.urls import agent_url_problem, hide_url_secret, redact_url

log = structlog.get_logger(__name__)

CONFIG_PATH = "/global_config_dict_yaml"
AGENT_TYPE = "responses_api_agents"
ENVIRONMENT_TYPE = "environment_servers"
# The whole answer's deadline (``--gym-head-timeout-s``) and size (``--gym-head-max-bytes``):
# a Gym config is kilobytes, and parsing its YAML costs several times its size.
FETCH_TIMEOUT_S = 10.0
MAX_CONFIG_BYTES = 16 * 1024 * 1024


def head_url(value: str) -> str:
    """The head server's base URL: ``http(s)://HOST:PORT``, or ``HOST:PORT`` for http."""
    url = value.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    hide_url_secret(url)
    problem = agent_url_problem(url)
    if problem is not None:
        raise ConfigError(f"--gym-head-server {redact_url(value)!r}: {problem}")
    return url


class HeadUnreachable(ConfigError):
    """No connection to the head server, or it broke before an answer: not up (yet)."""


@dataclass(frozen=True)
class HeadBounds:
    """What fetching the head's config may take: a total deadline and a size."""

    timeout_s: float = FETCH_TIMEOUT_S
    max_bytes: int = MAX_CONFIG_BYTES


def fetch_global_config(url: str, bounds: HeadBounds = HeadBounds()) -> dict[str, Any]:
    """The head server's global config, parsed; ``ConfigError`` naming the server otherwise."""
    fetch = _Fetch(url, bounds)
    # In a thread so that the deadline is the whole answer's: a server that
    # drips a byte now and then keeps every read under a socket timeout.
    worker = threading.Thread(target=fetch.run, name="gym-head-fetch", daemon=True)
    worker.start()
    worker.join(bounds.timeout_s)
    if worker.is_alive():
        fetch.abort()
        worker.join()
        raise ConfigError(
            f"Gym head server {fetch.shown}: no whole answer within {bounds.timeout_s:g} s "
            "(--gym-head-timeout-s)"
        )
    if fetch.error is not None:
        raise fetch.error
    assert fetch.body is not None
    return parse_global_config(fetch.body, fetch.shown)


class _Fetch:
    """One ``GET`` of the config: no redirect followed, the body read up to its bound."""

    def __init__(self, url: str, bounds: HeadBounds) -> None:
        self.url = URL(url)
        self.shown = redact_url(url)
        self.bounds = bounds
        self.body: bytes | None = None
        self.error: ConfigError | None = None
        self._conn: http.client.HTTPConnection | None = None

    def run(self) -> None:
        try:
            self.body = self._get()
        except ConfigError as exc:
            self.error = exc
        except (OSError, http.client.HTTPException) as exc:
            self.error = HeadUnreachable(
                f"Gym head server {self.shown} does not answer ({_reason(exc)}); start the "
                "stack with `gym env start` or check --gym-head-server"
            )

    def abort(self) -> None:
        """End a read in progress (the deadline passed): the thread sees an error."""
        sock = self._conn.sock if self._conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _get(self) -> bytes:
        https = self.url.scheme == "https"
        kind = http.client.HTTPSConnection if https else http.client.HTTPConnection
        host, timeout_s = self.url.raw_host or "", self.bounds.timeout_s
        self._conn = conn = kind(host, self.url.port, timeout=timeout_s)
        try:
            conn.request("GET", self.url.path.rstrip("/") + CONFIG_PATH, headers=self._headers())
            answer = conn.getresponse()
            self._check_status(answer)
            return self._read(answer)
        finally:
            conn.close()

    def _headers(self) -> dict[str, str]:
        if self.url.user is None:
            return {}
        pair = f"{self.url.user}:{self.url.password or ''}".encode()
        return {"Authorization": "Basic " + base64.b64encode(pair).decode()}

    def _check_status(self, answer: http.client.HTTPResponse) -> None:
        if 300 <= answer.status < 400:
            where = redact_url(answer.getheader("Location") or "nowhere")
            raise ConfigError(
                f"Gym head server {self.shown}: GET {CONFIG_PATH} answered {answer.status}, a "
                f"redirect to {where} (not followed: give --gym-head-server the head server "
                "itself)"
            )
        if answer.status != 200:
            raise ConfigError(
                f"Gym head server {self.shown}: GET {CONFIG_PATH} answered {answer.status}; "
                "is this a NeMo Gym head server?"
            )

    def _read(self, answer: http.client.HTTPResponse) -> bytes:
        """The body, refused once it passes the bound (never read whole first)."""
        limit = self.bounds.max_bytes
        body = bytearray()
        while chunk := answer.read1(1 << 16):
            body += chunk
            if len(body) > limit:
                raise ConfigError(
                    f"Gym head server {self.shown}: {CONFIG_PATH} is larger than "
                    f"--gym-head-max-bytes ({limit} bytes)"
                )
        return bytes(body)


def _reason(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return " ".join(str(exc).split()) or type(exc).__name__


def parse_global_config(raw: bytes, shown: str) -> dict[str, Any]:
    """The config from the answer's bytes: a JSON string of YAML (FastAPI encodes the str)."""
    import yaml

    try:
        text = json.loads(raw)
        config = yaml.safe_load(text) if isinstance(text, str) else None
    except (ValueError, yaml.YAMLError):
        config = None
    except RecursionError:
        raise ConfigError(f"Gym head server {shown}: {CONFIG_PATH} is nested too deeply") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"Gym head server {shown}: {CONFIG_PATH} is not a YAML mapping in a JSON string"
        )
    return config


def gym_agents(config: Mapping[str, Any]) -> dict[str, list[str]]:
    """Every agent of the config that resolves, by name, with its one URL."""
    fronts = _environment_servers_by_agent(config)
    agents: dict[str, list[str]] = {}
    for name, instance in config.items():
        if not _is_instance_of(instance, AGENT_TYPE):
            continue
        servers = fronts.get(str(name), [])
        if len(servers) > 1:
            log.warning(
                "gym_head_agent_skipped",
                agent=name,
                reason=f"fronted by several environment servers: {sorted(servers)}",
            )
            continue
        target = config[servers[0]] if servers else instance
        url = _instance_url(target)
        if url is None:
            log.warning("gym_head_agent_skipped", agent=name, reason="no host and port")
            continue
        agents[str(name)] = [url]
    return agents


def gym_environments(config: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """Each agent fronted by exactly one environment server: that server's name and its
    implementation, which Gym's collector stamps on the agent's rows as
    ``_ng_environment_server`` and ``_ng_result_type`` (contracts §15)."""
    environments: dict[str, tuple[str, str]] = {}
    for agent, servers in _environment_servers_by_agent(config).items():
        if len(servers) == 1:
            implementations = config[servers[0]][ENVIRONMENT_TYPE]
            environments[agent] = (servers[0], str(next(iter(implementations))))
    return environments


@dataclass(frozen=True)
class HeadConfig:
    """What a run takes from a Gym head server: agents' URLs, their environment servers."""

    agents: dict[str, list[str]]
    environments: dict[str, tuple[str, str]]


def with_head_agents(
    head_server: str, explicit: Mapping[str, list[str]] | None, bounds: HeadBounds = HeadBounds()
) -> HeadConfig:
    """The head server's agents, with ``--agent`` winning for every name it gives, and
    the environment servers of the head server's agents that ``--agent`` does not name."""
    url = head_url(head_server)
    config = fetch_global_config(url, bounds)
    agents = gym_agents(config)
    if not agents and not explicit:
        raise ConfigError(f"Gym head server {redact_url(url)}: its config has no agent")
    environments = {
        name: found
        for name, found in gym_environments(config).items()
        if name in agents and name not in (explicit or {})
    }
    return HeadConfig({**agents, **(explicit or {})}, environments)


def _is_instance_of(instance: Any, server_type: str) -> bool:
    return isinstance(instance, dict) and isinstance(instance.get(server_type), dict)


def _environment_servers_by_agent(config: Mapping[str, Any]) -> dict[str, list[str]]:
    """Agent name -> the environment servers whose ``agent_server`` names it (as Gym maps them)."""
    fronts: dict[str, list[str]] = {}
    for name, instance in config.items():
        if not _is_instance_of(instance, ENVIRONMENT_TYPE):
            continue
        for server in instance[ENVIRONMENT_TYPE].values():
            ref = server.get("agent_server") if isinstance(server, dict) else None
            agent = ref.get("name") if isinstance(ref, dict) else None
            if agent is not None:
                fronts.setdefault(str(agent), []).append(str(name))
    return fronts


def _instance_url(instance: Any) -> str | None:
    """``http://host:port`` of the instance's first implementation (Gym's first server config)."""
    if not isinstance(instance, dict) or not instance:
        return None
    group = next(iter(instance.values()))
    server = next(iter(group.values()), None) if isinstance(group, dict) and group else None
    if not isinstance(server, dict):
        return None
    host, port = server.get("host"), server.get("port")
    if not isinstance(host, str) or not host or not isinstance(port, int):
        return None
    return f"http://{host}:{port}"
