"""The ``dispatcher`` commands: each one's name, the module that implements it and its
help line.

The top-level parser is built from this table alone, so ``dispatcher CMD``
imports CMD's module and no other: importing every command's module (the
service, the simulators, the capture proxy, the ops tools) to build the parser
was most of each process's start-up. Each module's ``add_parser`` takes its
help line from here, so ``dispatcher --help`` and ``dispatcher CMD`` agree.
"""

from __future__ import annotations

from typing import NamedTuple


class Command(NamedTuple):
    name: str
    module: str  # has ``add_parser(subparsers)``, which sets the parser's ``handler``
    help: str


# In the order `dispatcher --help` lists them.
COMMANDS: tuple[Command, ...] = (
    Command("run", "dispatcher.ops.run_command", "dispatch a task file to agent servers"),
    Command(
        "serve",
        "dispatcher.serve.command",
        "a daemon for a whole training run: jobs over HTTP, rows streamed back",
    ),
    Command("sim-agent", "dispatcher.sim.agent", "run a simulated agent server"),
    Command("sim-model", "dispatcher.sim.model", "run a simulated OpenAI-compatible model server"),
    Command(
        "capture-proxy",
        "dispatcher.capture.proxy_command",
        "record the model calls of each rollout on their way to the model",
    ),
    Command(
        "jobs",
        "dispatcher.ops.jobs",
        "a running `dispatcher serve`: list, show, submit, cancel, tail jobs; pause; policy",
    ),
    Command(
        "status",
        "dispatcher.ops.status_command",
        "where a run stands: expected, succeeded, failed, left to run",
    ),
    Command(
        "report",
        "dispatcher.ops.report",
        "timing, limit hits, start deciles, timeline, reward and pass@k of a run; --html: pictures",
    ),
    Command(
        "merge",
        "dispatcher.ops.merge",
        "combine shard output sets into one, checking every rollout is present once",
    ),
    Command(
        "validate",
        "dispatcher.ops.validate",
        "check a run's settings, task file and agents without running it",
    ),
    Command(
        "init",
        "dispatcher.ops.init",
        "write the example config, Prometheus/Grafana files and job scripts into DIR",
    ),
)

_HELP = {command.name: command.help for command in COMMANDS}


def command_help(name: str) -> str:
    """The help line of command ``name`` (one of ``COMMANDS``)."""
    return _HELP[name]
