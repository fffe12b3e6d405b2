"""The shipped examples: `dispatcher init`, the Kubernetes example, the Prometheus rules;
the README's flag table and its links into docs/contracts.md."""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from dispatcher.cli import parse_args
from dispatcher.ops.init import example_files
from dispatcher.settings.flags import add_run_arguments
from tests.conftest import SimAgentFactory
from tests.helpers import indented_blocks, read_jsonl, run_cli, spawn_cli, wait_until
from tests.prometheus_helpers import require_binary

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "dispatcher" / "examples"
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONTRACTS = ROOT / "docs" / "contracts.md"
JOB = EXAMPLES / "kubernetes" / "job.yaml"
OLDEST_KUBERNETES = (1, 27)


async def test_init_writes_every_example(tmp_path: Path) -> None:
    target = tmp_path / "deploy"
    result = await run_cli("init", str(target))
    assert result.returncode == 0, result.stderr
    written = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    shipped = sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*") if p.is_file())
    assert written == shipped == sorted(name for name, _ in example_files())
    for name in (
        "example.toml", "prometheus.yml", "prometheus/alerts.yml", "grafana-dashboard.json",
        "slurm/dispatch.sbatch", "systemd/rollout-dispatcher.service", "kubernetes/job.yaml",
    ):  # fmt: skip
        assert (target / name).read_bytes() == (EXAMPLES / name).read_bytes(), name
    assert (target / "slurm" / "dispatch.sbatch").stat().st_mode & 0o111
    assert f"wrote {len(written)} files" in result.stdout


async def test_init_never_overwrites_unless_forced(tmp_path: Path) -> None:
    (tmp_path / "example.toml").write_text("mine")
    refused = await run_cli("init", str(tmp_path))
    assert refused.returncode == 2
    assert "example.toml: exists; pass --force" in refused.stderr
    assert (tmp_path / "example.toml").read_text() == "mine"
    assert not (tmp_path / "prometheus.yml").exists()  # nothing written at all
    assert (await run_cli("init", "--force", str(tmp_path))).returncode == 0
    assert (tmp_path / "example.toml").read_text() != "mine"


def test_example_toml_loads() -> None:
    settings = tomllib.loads((EXAMPLES / "example.toml").read_text())
    assert settings["metrics_listen"] == "auto"


# -- Kubernetes --------------------------------------------------------------------------


def documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(JOB.read_text()) if d]


def kind(name: str) -> dict[str, Any]:
    [doc] = [d for d in documents() if d["kind"] == name]
    return doc


def kubernetes_versions() -> list[str]:
    utils = pytest.importorskip(
        "kubernetes_validate.utils", reason="kubernetes-validate is not installed (dev extra)"
    )
    versions = sorted(set(utils.all_versions()), key=lambda v: tuple(map(int, v.split("."))))
    return [v for v in versions if tuple(map(int, v.split(".")[:2])) >= OLDEST_KUBERNETES]


def test_kubernetes_example_validates_from_1_27_to_the_newest() -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (dev extra)"
    )
    versions = kubernetes_versions()
    assert versions[0].startswith("1.27.") and len(versions) >= 10
    kinds = [d["kind"] for d in documents()]
    assert kinds == ["ConfigMap", "PersistentVolumeClaim", "Deployment", "Service", "Job"]
    for version in versions:
        for doc in documents():
            # Raises ValidationError naming the field; strict: no unknown fields.
            kubernetes_validate.validate(doc, version, strict=True)


def test_kubernetes_containers_parse_as_dispatcher_commands() -> None:
    job = kind("Job")["spec"]["template"]["spec"]["containers"][0]
    agent = kind("Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert parse_args(job["args"]).command == "run"
    assert parse_args(agent["args"]).command == "sim-agent"
    service = kind("Service")
    config = tomllib.loads(kind("ConfigMap")["data"]["config.toml"])
    port = service["spec"]["ports"][0]["port"]
    assert config["agents"]["sim"] == f"http://{service['metadata']['name']}:{port}"
    assert f"0.0.0.0:{port}" in agent["args"]
    spec = kind("Job")["spec"]
    env = {e["name"]: e["value"] for e in job["env"]}
    assert env["DISPATCHER_SHARD_COUNT"] == str(spec["completions"])


async def test_kubernetes_config_runs_against_the_sim_agent(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    # The ConfigMap used to name no input and no agents: the first pod exited 2.
    url, _ = await sim_agent()
    data = kind("ConfigMap")["data"]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(data["tasks.jsonl"])
    text = data["config.toml"]
    for old, new in (
        ("/etc/rollout-dispatcher/tasks.jsonl", str(tasks)),
        ("/data/", f"{tmp_path}/data/"),
        ("0.0.0.0:9464", "127.0.0.1:0"),
        ("http://rollout-sim-agent:8000", url),
    ):
        assert old in text
        text = text.replace(old, new)
    config = tmp_path / "config.toml"
    config.write_text(text)
    job = kind("Job")["spec"]["template"]["spec"]["containers"][0]
    args = [a.replace("/etc/rollout-dispatcher/config.toml", str(config)) for a in job["args"]]
    env = {"JOB_COMPLETION_INDEX": "1", "DISPATCHER_SHARD_COUNT": "4"}

    result = await run_cli(*args, "--log-format", "json", env=env)

    assert result.returncode == 0, result.stderr[-2000:]
    rows = read_jsonl(tmp_path / "data" / "rollouts.shard-1-of-4.jsonl")
    assert len(rows) == 2 * 4  # tasks 1 and 5, four repeats each
    assert {r["_ng_task_index"] for r in rows} == {1, 5}


# -- Prometheus ----------------------------------------------------------------------------


def test_alert_rules_pass_promtool_check() -> None:
    promtool = require_binary("promtool")
    rules = EXAMPLES / "prometheus" / "alerts.yml"
    done = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 rules found" in done.stdout
    names = [r["alert"] for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"]]
    assert names == [
        "DispatcherRunStalled",
        "DispatcherAllReplicasDown",
        "DispatcherP95NearTimeout",
        "DispatcherBudgetOverrun",
    ]


def test_alert_rules_unit_tests_pass_in_promtool() -> None:
    promtool = require_binary("promtool")
    done = subprocess.run(
        [promtool, "test", "rules", "alerts_test.yml"],
        cwd=EXAMPLES / "prometheus",
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_alert_rule_unit_tests_cover_every_rule() -> None:
    tests = yaml.safe_load((EXAMPLES / "prometheus" / "alerts_test.yml").read_text())["tests"]
    tested = {t["alertname"] for case in tests for t in case["alert_rule_test"]}
    fired = {t["alertname"] for case in tests for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert (
        tested
        == fired
        == {
            "DispatcherRunStalled",
            "DispatcherAllReplicasDown",
            "DispatcherP95NearTimeout",
            "DispatcherBudgetOverrun",
        }
    )


def test_prometheus_example_discovers_runs_from_their_target_files() -> None:
    config = yaml.safe_load((EXAMPLES / "prometheus.yml").read_text())
    [job] = config["scrape_configs"]
    [sd] = job["file_sd_configs"]
    assert sd["files"] == ["targets/*_prometheus.json"]
    assert config["rule_files"] == ["prometheus/alerts.yml"]


def test_slurm_example_leaves_the_metrics_port_to_auto() -> None:
    # A fixed port taken by another shard on the node is exit 2, which ends the chain.
    text = (EXAMPLES / "slurm" / "dispatch.sbatch").read_text()
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not any("--metrics-listen" in line for line in code)


# -- README and docs/contracts.md -----------------------------------------------------------


def run_flags() -> set[str]:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")} - {"--help"}


def test_readme_flag_table_lists_every_run_flag_once() -> None:
    # Seven flags of `run` used to be missing from the table.
    section = (DOCS / "running.md").read_text().split("\n## Running it\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    first_cells = [
        line.split(" | ", 1)[0] for line in section.splitlines() if line.startswith("| `--")
    ]
    listed = [flag for cell in first_cells for flag in re.findall(r"`(--[a-z0-9-]+)", cell)]
    assert sorted(set(listed)) == sorted(run_flags())
    assert len(listed) == len(set(listed)), listed


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    anchors = set()
    for title in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def test_contracts_are_numbered_1_to_15_in_order() -> None:
    numbers = re.findall(r"^## §(\d+) ", CONTRACTS.read_text(), flags=re.MULTILINE)
    assert numbers == [str(n) for n in range(1, 16)]


def test_readme_cites_the_contracts_by_links_that_resolve() -> None:
    readme = README.read_text()
    # The README used to cite "(A11)", sections of a document not in the repository.
    contracts = CONTRACTS.read_text()
    for text in (readme, contracts):
        assert not re.search(r"\(A\d{1,2}\)|DESIGN A\d", text)
    anchors = heading_anchors(contracts)
    cited = re.findall(r"\(docs/contracts\.md#([^)]+)\)", readme)
    assert cited and set(cited) <= anchors, set(cited) - anchors
    inner = re.findall(r"\]\(#([^)]+)\)", contracts)
    assert inner and set(inner) <= anchors, set(inner) - anchors


def resolves(page: Path, target: str) -> bool:
    """A relative link of ``page``: its file exists and so does its heading."""
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
        return False
    return not anchor or dest.suffix != ".md" or anchor in heading_anchors(dest.read_text())


def test_every_link_between_the_readme_and_docs_resolves() -> None:
    broken = [
        f"{page.name}: {target}"
        for page in [README, *sorted(DOCS.glob("*.md"))]
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text())
        if not re.match(r"^[a-z]+:", target) and not resolves(page, target)
    ]
    assert not broken, broken


def test_the_code_cites_the_contracts_it_ships_not_a_document_it_does_not() -> None:
    cited: list[str] = []
    for path in sorted((ROOT / "dispatcher").rglob("*.py")) + sorted(
        (ROOT / "bench").rglob("*.py")
    ):
        text = path.read_text()
        assert not re.search(r"DESIGN|[(,] ?A\d{1,2}\b", text), path
        cited += re.findall(r"contracts §(\d+)", text)
    assert cited and {int(n) for n in cited} <= set(range(1, 16))


# -- README: service mode and step control, run as written --------------------------------


def service_examples() -> list[str]:
    """The trainer's code blocks of docs/service.md (step control
    included): Python and curl; not the `dispatcher serve` command line (its agents are
    hosts of a cluster) nor the nginx configuration."""
    codes = indented_blocks((DOCS / "service.md").read_text())
    return [code for code in codes if code.startswith("import ") or "\ncurl " in code]


def test_the_service_examples_are_found() -> None:
    examples = service_examples()
    assert [example.split("\n", 1)[0] for example in examples] == [
        "import asyncio",
        "URL=${DISPATCHER_URL:-http://localhost:8080}",
        "import asyncio",
    ]


async def run_example(command: list[str], env: dict[str, str], cwd: Path) -> str:
    """Run an example to its end (the sim agent serves on this loop meanwhile); its stdout."""
    proc = await asyncio.create_subprocess_exec(
        *command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    return stdout.decode()


async def test_readme_service_and_step_control_examples_run_as_written(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    # Each task solved with a probability of its own: some groups teach nothing.
    url, _ = await sim_agent(latency_s=0.01, reward_p=None)
    tasks = [
        {"agent_ref": {"name": "math_agent"}, "responses_create_params": {"input": f"q{i}"}}
        for i in range(6)
    ]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    # Each example is a training run of its own, on a daemon of its own: a
    # policy version only goes forward within one.
    outputs = [
        await _on_own_daemon(example, tmp_path, url, f"state-{i}")
        for i, example in enumerate(service_examples())
    ]
    trainer, shell, step_control = outputs
    assert trainer.count("task ") == 3 * 16
    assert re.findall(r'\{"task_index":\d+,"n":(\d+)\}', shell) == ["8"] * 6
    steps = [line for line in step_control.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in steps] == ["step 0", "step 1", "step 2"]
    assert all(": 8 groups" in line for line in steps), steps
    folders = (tmp_path / "state-2" / "jobs").iterdir()
    jobs = {folder.name: json.loads((folder / "job.json").read_text()) for folder in folders}
    assert {jobs[f"rl-step-{n}"]["state"] for n in range(3)} == {"satisfied"}


async def _on_own_daemon(example: str, cwd: Path, agent_url: str, state: str) -> str:
    """Run one example against a ``dispatcher serve`` started for it; its output."""
    token = {"DISPATCHER_API_TOKEN": "readme-examples-token"}
    daemon = await spawn_cli(
        "serve", "--listen", "127.0.0.1:0", "--state-dir", state, "--agent",
        f"math_agent={agent_url}", "--fsync", "never", "--log-format", "json", cwd=cwd, env=token,
    )  # fmt: skip
    try:
        await wait_until(lambda: bool(daemon.stdout) or daemon.exited, timeout_s=30)
        url = daemon.stdout[0].decode().split()[-1]
        env = {**os.environ, **token, "DISPATCHER_URL": url}
        shell = ["bash", "-euo", "pipefail", "-c"]
        command = [sys.executable, "-c"] if example.startswith("import") else shell
        return await run_example([*command, example], env, cwd)
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert (await daemon.wait()).returncode == 0


# -- the service: a token from a Secret, a systemd credential --------------------------------

SERVE = EXAMPLES / "kubernetes" / "serve.yaml"
SERVE_UNIT = EXAMPLES / "systemd" / "rollout-dispatcher-serve.service"


def serve_documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(SERVE.read_text()) if d]


def test_kubernetes_serve_example_validates_from_1_27_to_the_newest() -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (dev extra)"
    )
    kinds = [d["kind"] for d in serve_documents()]
    assert kinds == ["PersistentVolumeClaim", "Deployment", "Service"]
    for version in kubernetes_versions():
        for doc in serve_documents():
            kubernetes_validate.validate(doc, version, strict=True)


def test_kubernetes_serve_takes_its_token_from_a_secret_and_probes_open_routes() -> None:
    [deployment] = [d for d in serve_documents() if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    args = parse_args(container["args"])
    assert args.command == "serve" and args.listen.startswith("0.0.0.0:")
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    secret = volumes["api-token"]["secret"]["secretName"]
    assert args.api_token_file.startswith(mounts["api-token"] + "/")
    assert secret in SERVE.read_text().split("kubectl create secret generic ")[1]
    assert args.input_root.startswith(mounts["data"])
    for probe in (container["readinessProbe"], container["livenessProbe"]):
        assert probe["httpGet"]["path"] == "/healthz"
    assert deployment["spec"]["strategy"]["type"] == "Recreate"


def test_systemd_serve_unit_loads_its_token_as_a_credential() -> None:
    text = SERVE_UNIT.read_text()
    command = text.split("\nExecStart=", 1)[1].split("\n\n", 1)[0].replace("\\\n", " ").split()
    args = parse_args(command[1:])
    assert args.command == "serve" and args.listen == "0.0.0.0:8080"
    [credential] = [line for line in text.splitlines() if line.startswith("LoadCredential=")]
    name, _, source = credential.removeprefix("LoadCredential=").partition(":")
    assert args.api_token_file == "${CREDENTIALS_DIRECTORY}/" + name
    assert source.startswith("/etc/")
    assert "RestartPreventExitStatus=2" in text and "KillSignal=SIGTERM" in text
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        return
    done = subprocess.run(
        [analyze, "verify", str(SERVE_UNIT)], capture_output=True, text=True, check=False
    )
    # The one thing it may say: the install path does not exist on this machine.
    said = [line for line in done.stderr.splitlines() if "is not executable" not in line]
    assert said == [], done.stderr


def test_every_flag_serve_adds_to_run_is_documented_in_the_service_page() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "dispatcher", "serve", "--help"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    serve_flags = set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]+)", shown)) - {"--help"}
    page = (DOCS / "service.md").read_text()
    own = serve_flags - run_flags()
    missing = [f for f in sorted(own) if not re.search(rf"`[^`]*{f}\b[^`]*`", page)]
    assert own and not missing, missing


def test_the_layout_page_names_every_module() -> None:
    page = (DOCS / "layout.md").read_text()
    skip = ("__init__.py", "__main__.py")
    modules = [p for p in (ROOT / "dispatcher").rglob("*.py") if p.name not in skip]
    unnamed = [str(p.relative_to(ROOT)) for p in modules if not re.search(rf"\b{p.stem}\b", page)]
    assert not unnamed, unnamed


def test_the_tests_mirror_the_package() -> None:
    """A test folder per package (``tests/serve`` for ``dispatcher/serve``), a top-level
    test module per top-level module; ``tests/gym`` is the real NeMo Gym suite."""
    packages = {p.name for p in (ROOT / "dispatcher").iterdir() if (p / "__init__.py").exists()}
    folders = {p.name for p in (ROOT / "tests").iterdir() if (p / "__init__.py").exists()}
    assert folders - packages == {"gym"}, folders - packages
    modules = {p.stem for p in (ROOT / "dispatcher").glob("*.py")}
    project = {"readme_commands", "packaging", "make_targets"}  # the checkout's own promises
    top = {p.stem.removeprefix("test_") for p in (ROOT / "tests").glob("test_*.py")}
    strays = {t for t in top - project if t.split("_")[0] not in modules}
    assert not strays, f"top-level tests that name no top-level module: {sorted(strays)}"


def test_no_module_is_over_500_lines() -> None:
    """A module a reader takes in whole: past 500 lines, a part of it is a module of its own."""
    sources = [*(ROOT / "dispatcher").rglob("*.py"), *(ROOT / "bench").glob("*.py")]
    long = {
        str(p.relative_to(ROOT)): n
        for p in sources
        if (n := len(p.read_bytes().splitlines())) > 500
    }
    assert not long, long


def test_no_function_is_over_50_lines() -> None:
    """A function does one thing: past 50 lines, def to end, it is two."""
    sources = [*(ROOT / "dispatcher").rglob("*.py"), *(ROOT / "bench").glob("*.py")]
    long = [
        f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({size} lines)"
        for p in sources
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (size := (node.end_lineno or node.lineno) - node.lineno + 1) > 50
    ]
    assert not long, long


def test_the_readmes_benchmark_commands_name_scripts_and_flags_that_exist() -> None:
    """The figures' commands are cited, not run here (`make bench-smoke` runs each
    script in CI): each names a script in bench/ and only flags that script defines."""
    commands = re.findall(r"`\.venv/bin/python (bench/\w+\.py)([^`]*)`", README.read_text())
    assert len(commands) >= 3
    for script, args in commands:
        text = (ROOT / script).read_text()
        flags = [word for word in args.split() if word.startswith("--")]
        assert all(f'"{flag}"' in text for flag in flags), (script, flags)
