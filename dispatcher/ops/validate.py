"""``dispatcher validate [run flags]``: check a run's command line without running it.

Takes exactly the flags of ``dispatcher run`` and checks what ``run`` would
check before dispatching: the settings (file, environment, flags), the task
file (every line, against the configured agents), the agents' replicas (one
``POST /run`` probe each, ``delivery/probe.py``: an answer means reachable,
a 404/405 means no ``/run`` is served there) and the earlier run's files
(the same run? how much is left?). It prints what would run and writes
nothing: no output directory, no lock, no manifest, no materialized rows.

Exit 0 when ``run`` would start, 2 when it would stop with a configuration
error, an agent replica does not answer, or it serves no ``/run``.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from dispatcher.commands import command_help
from dispatcher.delivery.http1_pool import Http1Pool
from dispatcher.delivery.probe import ProbeResult, probe_run
from dispatcher.delivery.target import Target
from dispatcher.errors import ConfigError, ExitCode
from dispatcher.files.contracts import RunManifest
from dispatcher.files.resume import OutputPaths, RunState, load_run_state
from dispatcher.ops.runfiles import lock_status, read_manifest
from dispatcher.ops.table import format_table
from dispatcher.run.prepare import task_settings
from dispatcher.settings.config import RunSettings
from dispatcher.tasks.materialize import MaterializeResult, materialize
from dispatcher.urls import redact_url, replica_names

ShardFilter = Callable[[int], bool] | None

# Long enough for a replica across a busy network, short enough for a preflight.
PROBE_TIMEOUT_S = 5.0


@dataclass
class Report:
    """What validation found: lines to print, and the problems that make it fail."""

    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.BAD_INPUT if self.problems else ExitCode.DONE

    def render(self) -> str:
        text = "\n".join(self.lines) + "\n"
        for problem in self.problems:
            text += f"problem: {problem}\n"
        verdict = "would not start" if self.problems else "ok: `dispatcher run` would start"
        return text + f"{verdict} (nothing was written)\n"


def count_rollouts(settings: RunSettings, shard_filter: ShardFilter) -> MaterializeResult:
    """What materializing would give, digests included, without writing anything (blocking)."""
    # Materialized into nothing: the same encoding, so the digest is the one a run records.
    return materialize(settings.materialize_spec(shard_filter), None)


def describe_tasks(
    settings: RunSettings, result: MaterializeResult, shard: str | None
) -> list[str]:
    where = f" (shard {shard})" if shard else ""
    lines = [
        f"tasks: {settings.input}: {result.input_rows:,} rows, {result.tasks:,} tasks, "
        f"{result.rollouts:,} rollouts{where}"
    ]
    rows = [[agent, f"{n:,}"] for agent, n in sorted(result.rollouts_by_agent.items())]
    if rows:
        lines += format_table(["agent", "rollouts"], rows).splitlines()
    return lines


def resume_state(settings: RunSettings, result: MaterializeResult, report: Report) -> None:
    """What the earlier run's files mean for this one: fresh, resumed, refused."""
    paths = OutputPaths.for_output(settings.output)
    held = lock_status(paths.lock)
    if held.held:
        report.problems.append(f"{paths.lock}: a dispatcher (pid {held.pid}) is running on it")
    previous = read_manifest(paths.manifest)
    if settings.fresh and previous is not None:
        report.lines.append("resume: --fresh: the earlier run's files would be moved aside")
        previous = None
    elif previous is None:
        _no_manifest(paths, report)
        previous = None
    if previous is None:
        report.lines.append(f"would run: {result.rollouts:,} rollouts")
        return
    changed = _changes(settings, previous, result)
    if changed:
        report.problems.append(f"{settings.output}: {changed}; rerun with --fresh to start over")
        return
    state = load_run_state(paths, settings.attempt_cap)
    final = _count_final(state)
    report.lines.append(
        f"resume: hop {previous.hops + 1} of run {previous.run_id}: "
        f"{final:,} of {result.rollouts:,} rollouts final"
    )
    report.lines.append(f"would run: {max(0, result.rollouts - final):,} rollouts")


def _no_manifest(paths: OutputPaths, report: Report) -> None:
    for path in (paths.output, paths.failures):
        if path.exists() and path.stat().st_size > 0:
            report.problems.append(
                f"{path}: output rows exist without {paths.manifest.name}; "
                "rerun with --fresh to move them aside"
            )
            return
    report.lines.append("resume: none (a new run)")


def _changes(settings: RunSettings, previous: RunManifest, result: MaterializeResult) -> str:
    """Why ``run`` would refuse to resume (the checks of ``prepare``), or ""."""
    before = previous.task_settings or {}
    now = task_settings(settings)
    changed = [f"{k}: {before.get(k)!r} -> {now[k]!r}" for k in now if before.get(k) != now[k]]
    if changed:
        return f"task-affecting settings changed ({'; '.join(changed)})"
    if previous.input_digest != result.input_digest:
        return f"the task file {settings.input} changed since this run started"
    if previous.materialized_digest != result.materialized_digest:
        return "the materialized rows differ from this run's earlier ones"
    return ""


def _count_final(state: RunState) -> int:
    count = len(state.successes)
    count += sum(1 for key in state.terminal if key not in state.successes)
    return count + state.exhausted


async def probe_agents(agents: dict[str, list[str]], report: Report) -> None:
    """One ``POST /run`` probe per replica: an answer is reachable; none, or a 404/405
    (no ``/run`` there), is a problem. Replicas are shown as every view shows them:
    credentials masked, each one apart."""
    urls = [
        (name, url, shown)
        for name, replicas in sorted(agents.items())
        for url, shown in zip(replicas, replica_names(replicas), strict=True)
    ]
    pool = Http1Pool(connect_timeout_s=None)
    try:
        answers = await asyncio.gather(
            *(probe_run(pool, Target.of(f"{url}/run"), PROBE_TIMEOUT_S) for _, url, _ in urls)
        )
    finally:
        await pool.close()
    for (name, _, shown), answer in zip(urls, answers, strict=True):
        # Some errors quote the URL they were given, credentials and all.
        detail = redact_url(str(answer.detail))
        if answer.result is ProbeResult.NO_RUN:
            report.problems.append(
                f"agent {name}: {shown}: no /run there (POST /run answered {detail}); "
                "give the base URL, the dispatcher appends /run"
            )
        elif answer.result in (ProbeResult.NO_ANSWER, ProbeResult.LOCAL_FAULT):
            report.problems.append(f"agent {name}: {shown} does not answer ({detail})")
        else:
            report.lines.append(f"agent {name}: {shown} reachable ({detail} to POST /run)")


async def validate(args: argparse.Namespace) -> int:
    """The ``validate`` command: print what ``run`` would do; exit 0 or 2."""
    from dispatcher.settings.flags import budget_seconds, run_settings

    settings, shard = run_settings(args)
    report = Report()
    budget = budget_seconds(settings)
    report.lines.append(
        f"config: ok: output {settings.output}, concurrency {settings.concurrency or 'unbounded'}, "
        f"budget {'none' if budget is None else f'{budget:.0f}s'}, "
        f"metrics {settings.metrics_listen}"
    )
    filter_ = shard.contains if shard is not None else None
    try:
        result = await asyncio.to_thread(count_rollouts, settings, filter_)
    except ConfigError as exc:
        report.problems.append(str(exc))
    else:
        report.lines += describe_tasks(settings, result, settings.shard)
        await asyncio.to_thread(resume_state, settings, result, report)
    await probe_agents(settings.agents, report)
    print(report.render(), end="")
    return int(report.exit_code)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from dispatcher.settings.flags import add_run_arguments

    parser = subparsers.add_parser(
        "validate",
        help=command_help("validate"),
        description=(
            "Takes the flags of `dispatcher run`. Checks the settings, reads the whole task "
            "file, asks each agent replica once, and reads the earlier run's files; prints "
            "the rollouts per agent and what a resume would run. Writes nothing. Exit 0 when "
            "`run` would start, 2 when it would not."
        ),
    )
    add_run_arguments(parser)
    parser.set_defaults(handler=validate, is_async=True)
