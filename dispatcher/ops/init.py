"""``dispatcher init DIR``: write the example configuration and deployment files into DIR.

The examples ship inside the package (``dispatcher/examples``, which the
source tree also shows as ``config/``), so an installed dispatcher reaches
them without a checkout: the run's TOML, Prometheus scrape config and alert
rules, the Grafana dashboard, and the Slurm, systemd and Kubernetes files.
Existing files are never overwritten unless ``--force`` is given.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from dispatcher.commands import command_help
from dispatcher.errors import ConfigError

# Job scripts keep their execute bit, which package data does not carry.
_EXECUTABLE_SUFFIXES = (".sbatch", ".sh")


def examples() -> Traversable:
    """The examples directory inside the installed package."""
    return resources.files("dispatcher") / "examples"


def example_files(root: Traversable | None = None, prefix: str = "") -> Iterator[tuple[str, bytes]]:
    """``(relative path, content)`` of every example file, in a stable order."""
    root = examples() if root is None else root
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name == "__pycache__" or entry.name.startswith("."):
            continue
        name = f"{prefix}{entry.name}"
        if entry.is_dir():
            yield from example_files(entry, name + "/")
        else:
            yield name, entry.read_bytes()


def write_examples(target: Path, *, force: bool = False) -> list[Path]:
    """Copy the examples under ``target``; refuse (nothing written) if one exists, unless forced."""
    files = list(example_files())
    if not force:
        taken = [target / name for name, _ in files if (target / name).exists()]
        if taken:
            raise ConfigError(f"{taken[0]}: exists; pass --force to overwrite the examples")
    written = []
    for name, data in files:
        path = target / name
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        except OSError as exc:
            raise ConfigError(f"{path}: cannot write: {exc.strerror}") from None
        if path.suffix in _EXECUTABLE_SUFFIXES:
            path.chmod(0o755)
        written.append(path)
    return written


def run_init(args: argparse.Namespace) -> int:
    written = write_examples(args.directory, force=args.force)
    for path in written:
        print(path)
    print(
        f"wrote {len(written)} files; start with {args.directory / 'example.toml'} "
        "(dispatcher run --config FILE)"
    )
    return 0


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "init",
        help=command_help("init"),
        description=(
            "Write the examples that ship with the package into DIR: example.toml (the run's "
            "settings), prometheus.yml and prometheus/alerts.yml, grafana-dashboard.json, and "
            "the Slurm, systemd and Kubernetes files. Existing files are left alone (exit 2) "
            "unless --force."
        ),
    )
    parser.add_argument("directory", type=Path, metavar="DIR", help="where to write them")
    parser.add_argument("--force", action="store_true", help="overwrite existing files")
    parser.set_defaults(handler=run_init)
