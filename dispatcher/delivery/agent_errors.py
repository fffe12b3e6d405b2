"""The agents' misconfigurations the client (``client.py``) stops a run for (exit 2):
an agent with no ``/run`` at any replica, an agent never reached; each with its
one-line message."""

from __future__ import annotations

from dispatcher.errors import ConfigError


class AgentMisconfigured(ConfigError):
    """Every replica of an agent answers 404/405 to ``POST /run``: its URLs are wrong."""


class AgentsNeverReached(ConfigError):
    """No replica of an agent accepted a connection since the start (``--wait-for-agents-s``)."""


def no_run_message(agent: str, urls: list[str]) -> str:
    """The one line that names an agent whose every replica serves no ``/run``."""
    return (
        f"agent {agent!r}: no /run at {', '.join(urls)} (POST /run answered 404/405); "
        "check its --agent URL: give the base URL, the dispatcher appends /run"
    )


def never_reached_message(agents: dict[str, list[str]], waited_s: float) -> str:
    """The one line that names the agents none of whose replicas was ever reachable."""
    named = "; ".join(f"agent {name!r} at {', '.join(urls)}" for name, urls in agents.items())
    return (
        f"{named}: no replica accepted a connection in the {waited_s:g} s since the start "
        "(--wait-for-agents-s): check the URL and that the agent is up"
    )
