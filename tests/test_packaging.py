"""The package as a new user gets it: wheel and sdist built, installed outside the checkout.

Each distribution goes into a fresh virtualenv in a temporary directory (no
system site-packages) and runs from there: `dispatcher init`, then a short run
against `dispatcher sim-agent`. The wheel comes with its dependencies from the
package index; pip builds the sdist itself and installs it without them (the
wheel's install has shown they resolve), taking them from the environment
running the tests. The sdist must also carry a test suite that collects. These
are the slowest tests (two builds, one install with dependencies); pip's cache
keeps them to a minute.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import venv
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

ROOT = Path(__file__).resolve().parent.parent
# Not part of a source tree a user would build from.
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "*.egg-info", "build", "dist", "__pycache__", ".*_cache",
    "demo-output", "bench-output",
)  # fmt: skip
INSTALL_TIMEOUT_S = 600

pytestmark = pytest.mark.timeout(1200)


@dataclass
class Dists:
    wheel: Path
    sdist: Path
    build_log: str


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISPATCHER_", "VIRTUAL_ENV"))}
    # Byte-compiling is part of what a user's build does (setuptools warns when it cannot).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run(*args: str | Path, cwd: Path, timeout_s: float = INSTALL_TIMEOUT_S) -> str:
    done = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    pytest.importorskip("build", reason="the `build` package is not installed (dev extra)")
    base = tmp_path_factory.mktemp("dists")
    source = base / "source"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCE, symlinks=True)
    log = run(sys.executable, "-m", "build", "--outdir", base / "dist", source, cwd=base)
    [wheel] = (base / "dist").glob("*.whl")
    [sdist] = (base / "dist").glob("*.tar.gz")
    return Dists(wheel=wheel, sdist=sdist, build_log=log)


# Not byte-compiling thousands of dependency files (mypy's alone) halves an install;
# what is under test is that the distribution installs and runs, not pip's compile step.
QUIET_PIP = ("--quiet", "--no-compile", "--disable-pip-version-check")


def fresh_venv(path: Path) -> Path:
    """A new virtualenv without system site-packages; returns its bin directory."""
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    return path / "bin"


@pytest.fixture(scope="module")
def wheel_install(dists: Dists, tmp_path_factory: pytest.TempPathFactory) -> Path:
    bin_dir = fresh_venv(tmp_path_factory.mktemp("wheel-venv"))
    run(bin_dir / "pip", "install", *QUIET_PIP, dists.wheel, cwd=bin_dir.parent)
    return bin_dir


@pytest.fixture(scope="module")
def sdist_install(dists: Dists, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist built and installed by pip, without its dependencies: the wheel's
    test installs those from the index. They come from this test run's own
    environment, the dev extra included (the sdist's test suite needs it), through
    a path file that puts them after the venv's own site-packages."""
    bin_dir = fresh_venv(tmp_path_factory.mktemp("sdist-venv"))
    run(bin_dir / "pip", "install", *QUIET_PIP, "--no-deps", dists.sdist, cwd=bin_dir.parent)
    [own] = bin_dir.parent.glob("lib/python3*/site-packages")
    # Lines of a path file are appended to sys.path without processing the path
    # files inside them, so this checkout's editable install stays out.
    (own / "dependencies.pth").write_text(f"{_site_packages()}\n")
    return bin_dir


def _site_packages() -> str:
    """The site-packages of the environment running the tests."""
    return sysconfig.get_paths()["purelib"]


def test_build_has_no_warnings(dists: Dists) -> None:
    # setuptools used to warn four times that the project.license table is deprecated.
    lines = dists.build_log.lower().splitlines()
    assert not [line for line in lines if "warn" in line or "deprecat" in line], dists.build_log


def test_distributions_carry_license_examples_and_tests(dists: Dists) -> None:
    with tarfile.open(dists.sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        [member] = [m for m in tar.getmembers() if m.name.count("/") == 1 and "PKG-INFO" in m.name]
        pkg_info = tar.extractfile(member)
        assert pkg_info is not None
        metadata = pkg_info.read().decode()
    for name in (
        "LICENSE", "docs/contracts.md", "tests/conftest.py", "tests/helpers.py",
        "tests/prometheus_helpers.py",
        "dispatcher/examples/prometheus/alerts.yml", "dispatcher/examples/kubernetes/job.yaml",
    ):  # fmt: skip
        assert name in names, name
    assert "License-Expression: Apache-2.0" in metadata
    assert "Classifier: Programming Language :: Python :: 3.11" in metadata
    assert "Project-URL:" in metadata
    assert "Requires-Dist: aiofiles" not in metadata
    assert "Provides-Extra: dev" in metadata  # declared and never imported: dropped
    assert "Apache License" in (ROOT / "LICENSE").read_text()


def test_wheel_installed_outside_the_checkout_inits_and_runs(
    wheel_install: Path, tmp_path: Path
) -> None:
    installed_and_running(wheel_install, tmp_path)


def test_sdist_installed_outside_the_checkout_inits_and_runs(
    sdist_install: Path, tmp_path: Path
) -> None:
    installed_and_running(sdist_install, tmp_path)


def test_sdist_test_suite_collects(dists: Dists, sdist_install: Path, tmp_path: Path) -> None:
    # The sdist used to lack tests/conftest.py and the helpers: 11 collection errors.
    with tarfile.open(dists.sdist) as tar:
        # The "data" filter came in Python 3.11.4 (and 3.12); an older 3.11 has none.
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp_path, **safe)
    [unpacked] = tmp_path.iterdir()
    out = run(sdist_install / "python", "-m", "pytest", "--collect-only", "-q", cwd=unpacked)
    collected = re.search(r"(\d+) tests collected", out)
    assert collected and int(collected[1]) > 400, out[-2000:]
    assert "error" not in out.lower().splitlines()[-1]


def installed_and_running(bin_dir: Path, work: Path) -> None:
    """`dispatcher init`, then a short run against `dispatcher sim-agent`, from ``bin_dir``."""
    where = run(bin_dir / "python", "-c", "import dispatcher; print(dispatcher.__file__)", cwd=work)
    assert Path(where.strip()).is_relative_to(bin_dir.parent), where
    assert not Path(where.strip()).is_relative_to(ROOT)
    run(bin_dir / "dispatcher", "init", "deploy", cwd=work)
    assert (work / "deploy" / "prometheus" / "alerts.yml").is_file()
    tasks = work / "tasks.jsonl"
    rows = [{"responses_create_params": {"input": f"q{i}"}} for i in range(5)]
    tasks.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    with sim_agent(bin_dir, work) as url:
        out = run(
            bin_dir / "dispatcher", "run", "--input", tasks, "--output", "runs/x.jsonl",
            "--agent", f"sim={url}", "--default-agent", "sim", "--num-repeats", "2",
            "--log-format", "json", cwd=work, timeout_s=120,
        )  # fmt: skip
    assert '"event":"run_summary"' in out
    assert len((work / "runs" / "x.jsonl").read_bytes().splitlines()) == 10


class sim_agent:
    """`dispatcher sim-agent` from ``bin_dir`` on a free port, stopped on exit."""

    def __init__(self, bin_dir: Path, cwd: Path) -> None:
        self._args = [str(bin_dir / "dispatcher"), "sim-agent", "--listen", "127.0.0.1:0"]
        self._cwd = cwd

    def __enter__(self) -> str:
        self._proc = subprocess.Popen(
            self._args, cwd=self._cwd, env=clean_env(), stdout=subprocess.PIPE, text=True
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        match = re.search(r"listening on (http://\S+)", line)
        assert match, line
        return match[1]

    def __exit__(self, *exc: object) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=30)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def test_image_gets_the_examples() -> None:
    # The image installs the wheel built from these files; the examples ride along.
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY dispatcher ./dispatcher" in dockerfile
    assert "LICENSE" in dockerfile
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert "!dispatcher/" in ignored and "!LICENSE" in ignored
