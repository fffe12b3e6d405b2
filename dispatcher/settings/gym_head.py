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

The fetch is blocking: it runs once at start-up, before any task exists.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

import structlog

from dispatcher.errors import ConfigError
from dispatcher.urls import agent_url_problem, hide_url_secret, redact_url

log = structlog.get_logger(__name__)

CONFIG_PATH = "/global_config_dict_yaml"
AGENT_TYPE = "responses_api_agents"
ENVIRONMENT_TYPE = "environment_servers"
FETCH_TIMEOUT_S = 10.0


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


def fetch_global_config(url: str, timeout_s: float = FETCH_TIMEOUT_S) -> dict[str, Any]:
    """The head server's global config, parsed; ``ConfigError`` naming the server otherwise."""
    shown = redact_url(url)
    try:
        with urllib.request.urlopen(url + CONFIG_PATH, timeout=timeout_s) as answer:
            raw = answer.read()
    except urllib.error.HTTPError as exc:
        raise ConfigError(
            f"Gym head server {shown}: GET {CONFIG_PATH} answered {exc.code}; "
            "is this a NeMo Gym head server?"
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ConfigError(
            f"Gym head server {shown} does not answer ({reason}); start the stack with "
            "`gym env start` or check --gym-head-server"
        ) from None
    return parse_global_config(raw, shown)


def parse_global_config(raw: bytes, shown: str) -> dict[str, Any]:
    """The config from the answer's bytes: a JSON string of YAML (FastAPI encodes the str)."""
    import yaml

    try:
        text = json.loads(raw)
        config = yaml.safe_load(text) if isinstance(text, str) else None
    except (ValueError, yaml.YAMLError):
        config = None
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


def with_head_agents(
    head_server: str, explicit: Mapping[str, list[str]] | None
) -> dict[str, list[str]]:
    """The head server's agents, with ``--agent`` winning for every name it gives."""
    url = head_url(head_server)
    agents = gym_agents(fetch_global_config(url))
    if not agents and not explicit:
        raise ConfigError(f"Gym head server {redact_url(url)}: its config has no agent")
    return {**agents, **(explicit or {})}


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
