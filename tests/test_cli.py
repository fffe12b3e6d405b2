"""The command line at first contact: exact flags, suggestions on typos, help that says enough."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from dispatcher.cli import build_parser, chosen_command, closest, main, parse_args, suggestion
from dispatcher.commands import COMMANDS
from tests.conftest import SimAgentFactory
from tests.helpers import run_cli, write_tasks


def test_abbreviated_flag_is_refused_with_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    # `--conc` used to be taken as `--concurrency`.
    with pytest.raises(SystemExit) as exit_:
        parse_args(["run", "--input", "t", "--output", "o", "--conc", "4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "dispatcher run: error: unrecognized arguments: --conc 4" in err
    assert "(did you mean --concurrency?)" in err


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["run", "--outptu", "x"], "did you mean --output?"),
        (["run", "--concurency=8"], "did you mean --concurrency?"),
        (["rnu"], "did you mean run?"),
        (["merge", "--output", "m", "a", "--jsn"], "did you mean --json?"),
        (["status", "x.jsonl", "--jsno"], "did you mean --json?"),
        (["jobs", "list", "--jsno"], "did you mean --json?"),
        (["jobs", "lsit"], "did you mean list?"),
    ],
)
def test_typos_get_a_did_you_mean(
    argv: list[str], hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert hint in capsys.readouterr().err


def test_no_suggestion_when_nothing_is_close(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["run", "--zzzzzz"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err


def test_no_parser_takes_abbreviations() -> None:
    parser = build_parser()
    assert not parser.allow_abbrev
    sub = next(a for a in parser._actions if a.dest == "command")
    assert sub.choices and all(not p.allow_abbrev for p in sub.choices.values())  # type: ignore[union-attr]


def test_closest_prefers_the_one_flag_a_prefix_names() -> None:
    assert closest("--max", ["--max-attempts", "--limit"]) == "--max-attempts"
    assert closest("--capture", ["--capture-dir", "--capture-poll-s"]) in (
        "--capture-dir",
        "--capture-poll-s",
    )
    assert closest("--nothing-like-it", ["--output"]) is None


def test_run_help_lists_exit_codes_and_environment(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for text in ("exit codes:", "75", "DISPATCHER_CONCURRENCY", "DISPATCHER_CONFIG"):
        assert text in out
    assert "DISPATCHER_SHARD_COUNT" in out and "DISPATCHER_METRICS_LISTEN" in out


async def test_typo_through_the_real_cli(tmp_path: Path, sim_agent: SimAgentFactory) -> None:
    url, _ = await sim_agent()
    tasks = write_tasks(tmp_path / "t.jsonl", 2)
    result = await run_cli(
        "run", "--input", str(tasks), "--output", str(tmp_path / "o.jsonl"),
        "--agent", f"sim={url}", "--concurency", "4",
    )  # fmt: skip
    assert result.returncode == 2
    assert "did you mean --concurrency?" in result.stderr
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize(
    "message",
    [
        "argument COMMAND: invalid choice: 'rnu' (choose from 'run', 'merge')",
        "argument COMMAND: invalid choice: 'rnu' (choose from run, merge)",
    ],
)
def test_suggestion_reads_choices_quoted_or_not(message: str) -> None:
    assert suggestion(message, []) == " (did you mean run?)"


def test_every_command_registers_under_its_name_and_help_line() -> None:
    # The top-level parser lists commands from the table without importing them:
    # each module must register the same name, and `--help` show the same line.
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert isinstance(sub, argparse._SubParsersAction)
    assert list(sub.choices) == [c.name for c in COMMANDS]
    shown = {action.dest: action.help for action in sub._choices_actions}
    assert shown == {c.name: c.help for c in COMMANDS}
    assert all(callable(parser.get_default("handler")) for parser in sub.choices.values())


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["run", "--input", "t"], "run"),
        (["--version"], None),
        (["--help", "status"], "status"),
        (["rnu", "--x"], "rnu"),
        ([], None),
    ],
)
def test_chosen_command_is_the_first_word_that_is_not_an_option(
    argv: list[str], command: str | None
) -> None:
    assert chosen_command(argv) == command


def test_a_command_imports_only_its_own_module() -> None:
    # Importing every command's module to build the parser was most of the
    # start-up of each short `dispatcher` process; `status` of a run needs
    # neither the HTTP stack nor the metrics library (nor the service's modules).
    modules = [c.module for c in COMMANDS]
    unneeded = [*modules, "aiohttp", "prometheus_client", "dispatcher.ops.serve_status"]
    probe = (
        "import sys\n"
        "from dispatcher.cli import parse_args\n"
        "parse_args(['status', 'x.jsonl'])\n"
        f"print(sorted(m for m in {unneeded!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip() == "['dispatcher.ops.status_command']"


def test_jobs_imports_the_client_and_not_the_service() -> None:
    # `dispatcher jobs` talks to a daemon: it needs the client, never the
    # service's modules or the metrics library a daemon loads.
    modules = [c.module for c in COMMANDS]
    probe = (
        "import sys\n"
        "from dispatcher.cli import parse_args\n"
        "parse_args(['jobs', 'list'])\n"
        f"print(sorted(m for m in {modules!r} if m in sys.modules))\n"
        "print(sorted(m for m in sys.modules if m.startswith(('dispatcher.serve', "
        "'dispatcher.run', 'prometheus_client'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.splitlines() == ["['dispatcher.ops.jobs']", "[]"]


async def test_an_unexpected_error_shows_no_agent_password(tmp_path: Path) -> None:
    # An output folder in a symlink loop fails where nothing expects it: the
    # traceback's frames (argv, the settings) held the agent URL, password and all.
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    tasks = write_tasks(tmp_path / "tasks.jsonl", 1)

    result = await run_cli(
        "run", "--input", str(tasks), "--output", str(tmp_path / "a" / "out.jsonl"),
        "--agent", "sim=http://user:pa55-w0rd-x@127.0.0.1:9", "--log-format", "json",
        "--metrics-listen", "off",
    )  # fmt: skip

    assert result.returncode in (1, 2), result.stderr[-2000:]
    assert "error:" in result.stderr
    assert "pa55-w0rd-x" not in result.stdout + result.stderr


async def test_a_task_line_over_the_bound_is_one_line_naming_file_and_line(
    tmp_path: Path,
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"q": 0}\n{"text": "' + "x" * 5000 + '"}\n')

    result = await run_cli(
        "run", "--input", str(tasks), "--output", str(tmp_path / "out.jsonl"),
        "--agent", "sim=http://127.0.0.1:9", "--default-agent", "sim",
        "--max-task-line-bytes", "4096", "--metrics-listen", "off",
    )  # fmt: skip

    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr == (
        f"error: {tasks}:2: a task line is longer than --max-task-line-bytes (4096 bytes)\n"
    )
    assert not (tmp_path / "out.jsonl").exists()
