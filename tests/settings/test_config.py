"""Settings: TOML file < DISPATCHER_* environment < CLI flags, and errors that say where."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dispatcher.cli import build_parser
from dispatcher.errors import ConfigError
from dispatcher.serve import command as serve_command
from dispatcher.settings.config import RunSettings, layered, load_settings, parse_agent_flags
from dispatcher.settings.flags import run_flag_values
from dispatcher.settings.serve import SERVE_KEYS
from tests.conftest import SimAgentFactory
from tests.helpers import run_args, run_cli, write_tasks

BASE = {"input": "tasks.jsonl", "output": "out/x.jsonl", "agents": {"sim": ["http://h:1"]}}


def cli(**values: Any) -> dict[str, Any]:
    return {**BASE, **values}


def flags(*argv: str) -> dict[str, Any]:
    """The settings dict the real argument parser makes from ``dispatcher run ARGV``."""
    return run_flag_values(build_parser().parse_args(["run", *argv]))


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "dispatcher.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    settings = load_settings(cli(), env={})
    assert settings.concurrency == 64
    assert settings.max_attempts == 3
    assert settings.num_repeats == 1
    assert settings.dispatch_budget_s is None
    assert settings.drain_margin_s is None
    assert settings.fsync == "batch"


def test_toml_then_env_then_cli(tmp_path: Path) -> None:
    config = toml(
        tmp_path,
        'concurrency = 8\nmax_attempts = 5\nrollout_timeout_s = 30.0\nfsync = "never"\n',
    )
    env = {"DISPATCHER_CONCURRENCY": "16", "DISPATCHER_MAX_ATTEMPTS": "7"}
    settings = load_settings(cli(config=str(config), concurrency="32"), env=env)
    assert settings.concurrency == 32  # CLI beats env and file
    assert settings.max_attempts == 7  # env beats file
    assert settings.rollout_timeout_s == 30.0  # file beats default
    assert settings.fsync == "never"


def test_env_names_the_config_file(tmp_path: Path) -> None:
    config = toml(tmp_path, "concurrency = 3\n")
    settings = load_settings(cli(), env={"DISPATCHER_CONFIG": str(config)})
    assert settings.concurrency == 3


def test_toml_holds_every_kind_of_value(tmp_path: Path) -> None:
    config = toml(
        tmp_path,
        'input = "t.jsonl"\noutput = "o.jsonl"\ndefault_agent = "a"\n'
        'concurrency = "unbounded"\nnum_repeats = { a = 4, _default = 1 }\n'
        "[agents]\n"
        'a = "http://h:1/"\n'
        'b = ["http://h:2", "http://h:3"]\n'
        "[responses_create_params]\n"
        "temperature = 1.0\n",
    )
    settings = load_settings({"config": str(config)}, env={})
    assert settings.input == Path("t.jsonl")
    assert settings.agents == {"a": ["http://h:1"], "b": ["http://h:2", "http://h:3"]}
    assert settings.concurrency is None
    assert settings.num_repeats == {"a": 4, "_default": 1}
    assert settings.responses_create_params == {"temperature": 1.0}


def test_env_json_values() -> None:
    env = {
        "DISPATCHER_AGENTS": '{"e": ["http://h:9"]}',
        "DISPATCHER_NUM_REPEATS": '{"e": 2, "_default": 1}',
        "DISPATCHER_SKIP_INVALID_ROWS": "true",
        "DISPATCHER_CONCURRENCY": "unbounded",
    }
    settings = load_settings({"input": "t", "output": "o"}, env=env)
    assert settings.agents == {"e": ["http://h:9"]}
    assert settings.num_repeats == {"e": 2, "_default": 1}
    assert settings.skip_invalid_rows is True
    assert settings.concurrency is None


def test_cli_flags_through_the_parser() -> None:
    values = flags(
        "--input",
        "t.jsonl",
        "--output",
        "o.jsonl",
        "--agent",
        "a=http://h:1,http://h:2",
        "--agent",
        "b=http://h:3",
        "--num-repeats",
        '{"a": 3, "_default": 1}',
        "--concurrency",
        "5",
        "--dispatch-budget-s",
        "60",
        "--drain-margin-s",
        "0",
        "--responses-create-params",
        '{"temperature": 0.5}',
        "--skip-invalid-rows",
    )
    settings = load_settings(values, env={})
    assert settings.agents == {"a": ["http://h:1", "http://h:2"], "b": ["http://h:3"]}
    assert settings.num_repeats == {"a": 3, "_default": 1}
    assert settings.concurrency == 5
    assert settings.dispatch_budget_s == 60.0
    assert settings.drain_margin_s == 0.0
    assert settings.responses_create_params == {"temperature": 0.5}
    assert settings.skip_invalid_rows is True


def test_absent_cli_flags_do_not_hide_env_or_file(tmp_path: Path) -> None:
    config = toml(tmp_path, 'max_attempts = 9\nfsync = "always"\n')
    values = flags("--input", "t", "--output", "o", "--agent", "a=http://h:1")
    values["config"] = str(config)
    settings = load_settings(values, env={"DISPATCHER_FSYNC": "never"})
    assert settings.max_attempts == 9
    assert settings.fsync == "never"


# ---- errors name the key and where its value came from -----------------------


@pytest.mark.parametrize(
    ("source", "expected_where"),
    [
        ("toml", "dispatcher.toml"),
        ("env", "DISPATCHER_CONCURRENCY"),
        ("cli", "--concurrency"),
    ],
)
def test_a_bad_value_names_key_and_source(tmp_path: Path, source: str, expected_where: str) -> None:
    config = toml(tmp_path, "concurrency = 0\n")
    values, env = cli(), {}
    if source == "toml":
        values["config"] = str(config)
    elif source == "env":
        env["DISPATCHER_CONCURRENCY"] = "0"
    else:
        values["concurrency"] = "0"
    with pytest.raises(ConfigError) as info:
        load_settings(values, env=env)
    message = str(info.value)
    assert "'concurrency'" in message
    assert expected_where in message


@pytest.mark.parametrize(
    ("values", "env", "fragments"),
    [
        ({"concurrency": "many"}, {}, ["'concurrency'", "--concurrency"]),
        ({}, {"DISPATCHER_ROLLOUT_TIMEOUT_S": "-1"}, ["'rollout_timeout_s'", "DISPATCHER_"]),
        ({"dispatch_budget_s": "-5"}, {}, ["'dispatch_budget_s'", "--dispatch-budget-s"]),
        ({"drain_margin_s": "-1"}, {}, ["'drain_margin_s'", "--drain-margin-s"]),
        ({"max_attempts": "0"}, {}, ["'max_attempts'", "--max-attempts"]),
        ({"num_repeats": "0"}, {}, ["'num_repeats'", "--num-repeats"]),
        ({"num_repeats": {"a": 0}}, {}, ["'num_repeats'", "--num-repeats"]),
        ({"fsync": "sometimes"}, {}, ["'fsync'", "--fsync"]),
        ({"agents": {"a": ["ftp://h"]}}, {}, ["'agents'", "(from --agent)", "not an http(s) URL"]),
    ],
)
def test_bad_values(values: dict[str, Any], env: dict[str, str], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(cli(**values), env=env)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_budget_without_a_concurrency_bound_names_both_settings() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(cli(concurrency="unbounded", dispatch_budget_s="10"), env={})
    message = str(info.value)
    assert "dispatch_budget_s" in message
    assert "--dispatch-budget-s" in message
    assert "concurrency" in message


def test_unknown_default_agent() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(cli(default_agent="nope"), env={})
    assert "'nope'" in str(info.value)
    assert "--default-agent" in str(info.value)


def test_an_unknown_toml_key_names_the_file(tmp_path: Path) -> None:
    config = toml(tmp_path, "concurency = 4\n")
    with pytest.raises(ConfigError) as info:
        load_settings(cli(config=str(config)), env={})
    assert "'concurency'" in str(info.value)
    assert str(config) in str(info.value)


def test_an_unknown_env_setting_is_an_error() -> None:
    with pytest.raises(ConfigError, match="DISPATCHER_CONCURENCY: unknown setting"):
        load_settings(cli(), env={"DISPATCHER_CONCURENCY": "4"})


def test_an_env_json_value_that_does_not_parse() -> None:
    with pytest.raises(ConfigError, match="DISPATCHER_AGENTS: expected a JSON value"):
        load_settings(cli(), env={"DISPATCHER_AGENTS": "{nope"})


def test_a_missing_required_key_says_how_to_give_it() -> None:
    with pytest.raises(ConfigError, match=r"'output': required \(flag --output"):
        load_settings({"input": "t"}, env={})


def test_a_missing_or_broken_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_settings(cli(config=str(tmp_path / "none.toml")), env={})
    broken = toml(tmp_path, "concurrency = \n")
    with pytest.raises(ConfigError, match=r"dispatcher.toml: not valid TOML"):
        load_settings(cli(config=str(broken)), env={})


@pytest.mark.parametrize("value", ["noequals", "=http://h", "name="])
def test_bad_agent_flags(value: str) -> None:
    with pytest.raises(ConfigError, match="expected NAME=URL"):
        parse_agent_flags([value])


def test_agent_flags_repeat_and_accumulate() -> None:
    assert parse_agent_flags(["a=http://h:1", "a=http://h:2,http://h:3/"]) == {
        "a": ["http://h:1", "http://h:2", "http://h:3/"]
    }
    assert parse_agent_flags(None) is None


def test_a_json_flag_that_does_not_parse() -> None:
    with pytest.raises(ConfigError, match="--num-repeats: not valid JSON"):
        flags("--input", "t", "--output", "o", "--num-repeats", "{a: 1}")


def test_settings_are_frozen() -> None:
    settings = load_settings(cli(), env={})
    assert isinstance(settings, RunSettings)
    with pytest.raises(ValueError):
        settings.concurrency = 3


async def test_the_cli_reports_a_bad_env_value_and_exits_2(tmp_path: Path) -> None:
    config = toml(tmp_path, "concurrency = 4\n")
    result = await run_cli(
        "run",
        "--config",
        str(config),
        "--input",
        str(tmp_path / "t.jsonl"),
        "--output",
        str(tmp_path / "out" / "x.jsonl"),
        "--agent",
        "sim=http://127.0.0.1:1",
        env={"DISPATCHER_MAX_ATTEMPTS": "zero"},
    )
    assert result.returncode == 2
    expected = "error: config key 'max_attempts' (from DISPATCHER_MAX_ATTEMPTS)"
    assert result.stderr.startswith(expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["DISPATCHER_URL", "DISPATCHER_API_TOKEN", "DISPATCHER_STATE"])
async def test_a_clients_variable_in_the_environment_does_not_stop_a_run(
    tmp_path: Path, sim_agent: SimAgentFactory, name: str
) -> None:
    # The docs' trainer snippets export DISPATCHER_URL: a shell that runs both
    # the trainer and `dispatcher run` has it, and it is not a setting.
    agent_url, _ = await sim_agent()
    tasks = write_tasks(tmp_path / "t.jsonl", 2)
    args = run_args(tasks, tmp_path / "x.jsonl", agent_url)
    result = await run_cli(*args, env={name: "http://127.0.0.1:8080"})
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_services_own_keys_come_from_flags_then_env_then_the_file(tmp_path: Path) -> None:
    config = toml(tmp_path, 'state_dir = "from-file"\nlisten = "file:1"\nmax_streams = 3\n')
    given = {"config": str(config), "listen": "flag:1", "state_dir": None, "max_streams": None}
    env = {"DISPATCHER_STATE_DIR": "from-env"}
    found = layered(SERVE_KEYS, given, env)
    assert found["listen"] == ("flag:1", "--listen")
    assert found["state_dir"] == ("from-env", "DISPATCHER_STATE_DIR")
    assert found["max_streams"] == (3, str(config))
    assert "tls_cert" not in found
    # `run` leaves them alone, in the file and in the environment: one file serves both.
    assert isinstance(load_settings(cli(config=str(config)), env=env), RunSettings)


@pytest.mark.parametrize(("raw", "expected"), [("yes", True), ("0", False), (True, True)])
def test_a_services_switch_from_the_env_or_the_file(raw: Any, expected: bool) -> None:
    assert serve_command._as_flag("allow_unauthenticated", raw, "X") is expected


def test_a_services_switch_that_is_not_one_names_its_source() -> None:
    with pytest.raises(ConfigError, match=r"--allow-unauthenticated \(from DISPATCHER_ALLOW"):
        serve_command._as_flag("allow_unauthenticated", "maybe", "DISPATCHER_ALLOW_UNAUTHENTICATED")
