"""A Python 3.13 virtualenv with NeMo Gym 0.7.0, cached outside the checkout.

``tests/gym`` runs a real Gym stack from it; ``make test`` builds it ahead of the
tests (``python3 tests/gym/gym_env.py --prepare``) so the tests only use it: a build
takes minutes, longer than a test may. Standard
library only: it must run before anything else is installed.

Gym 0.7.0 declares ``Requires-Python >=3.13.14``; it runs on any 3.13, so the
wheel is fetched for 3.13.14 and installed with ``--ignore-requires-python``.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

GYM_VERSION = "0.7.0"
PYTHON_ENV = "ROLLOUT_DISPATCHER_PYTHON313"
CACHE_ENV = "ROLLOUT_DISPATCHER_GYM_CACHE"
# Set (to anything but empty or 0): tests/gym skip, and nothing is built.
SKIP_ENV = "ROLLOUT_DISPATCHER_SKIP_GYM"


def cache_dir() -> Path:
    override = os.environ.get(CACHE_ENV)
    return Path(override) if override else Path.home() / ".cache" / "rollout-dispatcher-gym"


def venv_dir() -> Path:
    return cache_dir() / f"venv-{GYM_VERSION}"


def _stamp() -> Path:
    return venv_dir() / ".complete"


def find_python313() -> Path | None:
    """A Python 3.13 interpreter: $ROLLOUT_DISPATCHER_PYTHON313, python3.13 on PATH, or pyenv's."""
    candidates: list[Path] = []
    if os.environ.get(PYTHON_ENV):
        candidates.append(Path(os.environ[PYTHON_ENV]))
    on_path = shutil.which("python3.13")
    if on_path:
        candidates.append(Path(on_path))
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates += sorted(pyenv_root.glob("versions/3.13*/bin/python3.13"), reverse=True)
    return next((path for path in candidates if _is_python313(path)), None)


def _is_python313(path: Path) -> bool:
    # A pyenv shim on PATH exists whether or not it can run 3.13: ask the interpreter.
    if not path.is_file():
        return False
    check = "import sys; sys.exit(sys.version_info[:2] != (3, 13))"
    try:
        return (
            subprocess.run([str(path), "-c", check], capture_output=True, timeout=30).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def skipped() -> bool:
    """The user asked for the NeMo Gym tests to be skipped (``SKIP_ENV``)."""
    return os.environ.get(SKIP_ENV, "") not in ("", "0")


def plan() -> str:
    """What the test run will do about the NeMo Gym venv, said before it does it."""
    if skipped():
        return f"NeMo Gym tests: skipped (${SKIP_ENV} is set)"
    if ready_venv() is not None:
        return f"NeMo Gym tests: the NeMo Gym {GYM_VERSION} venv in {venv_dir()} is ready"
    python = find_python313()
    if python is None:
        return (
            "NeMo Gym tests: skipped, no Python 3.13 found (set "
            f"{PYTHON_ENV}, put python3.13 on PATH, or install it with pyenv)"
        )
    return (
        f"NeMo Gym tests: building a NeMo Gym {GYM_VERSION} venv with {python} in "
        f"{venv_dir()} first (about 1.5 GB, a few minutes, once); "
        f"`make test {SKIP_ENV}=1` skips these tests instead"
    )


def ready_venv() -> Path | None:
    """The venv's directory when it is complete, else None."""
    return venv_dir() if _stamp().exists() else None


def install(python: Path) -> Path:
    """Build the venv (about 80 s on 2 cores); a finished one is reused as it is.

    One build at a time: parallel test workers and other checkouts share the
    cache, and a second build would delete the first one's half-built venv.
    """
    if ready_venv() is not None:
        return venv_dir()
    cache_dir().mkdir(parents=True, exist_ok=True)
    with (cache_dir() / ".build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if ready_venv() is not None:  # built by whoever held the lock
            return venv_dir()
        return _build(python)


def _build(python: Path) -> Path:
    venv = venv_dir()
    if venv.exists():
        shutil.rmtree(venv)  # a half-built venv from an interrupted install
    wheels = cache_dir() / "wheels"
    _run(python, "-m", "venv", str(venv))
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
    _run(*pip, "download", "--no-deps", f"nemo-gym=={GYM_VERSION}", "--python-version",
         "3.13.14", "--only-binary=:all:", "-d", str(wheels))  # fmt: skip
    wheel = next(wheels.glob(f"nemo_gym-{GYM_VERSION}-*.whl"))
    _run(*pip, "install", "--ignore-requires-python", str(wheel))
    _stamp().write_text(GYM_VERSION + "\n")
    return venv


def _run(*args: str | Path) -> None:
    subprocess.run([str(arg) for arg in args], check=True)


def prepare() -> int:
    """``make test``'s step before pytest: say the plan, then build the venv if it
    is to be built, so no test waits minutes for it under a per-test timeout. No
    Python 3.13, or asked to skip: nothing to build, and tests/gym skip."""
    sys.stdout.write(plan() + "\n")
    sys.stdout.flush()
    python = find_python313()
    if skipped() or ready_venv() is not None or python is None:
        return 0
    try:
        install(python)
    except (OSError, subprocess.CalledProcessError) as error:
        sys.stderr.write(
            f"the NeMo Gym {GYM_VERSION} venv could not be built ({error}); "
            f"`make test {SKIP_ENV}=1` skips the NeMo Gym tests\n"
        )
        return 1
    return 0


def main() -> int:
    if sys.argv[1:] == ["--plan"]:
        sys.stdout.write(plan() + "\n")
        return 0
    if sys.argv[1:] == ["--prepare"]:
        return prepare()
    python = find_python313()
    if python is None:
        sys.stderr.write(
            f"no Python 3.13 found (set {PYTHON_ENV}, put python3.13 on PATH, or install it "
            "with pyenv); the NeMo Gym tests will be skipped\n"
        )
        return 1
    venv = install(python)
    sys.stdout.write(f"NeMo Gym {GYM_VERSION} venv ready at {venv}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
