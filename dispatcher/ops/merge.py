"""``dispatcher merge --output MERGED.jsonl SHARD_OUTPUT...``: join shard output sets.

Each shard wrote a full output set (contracts §4) for its own tasks. The merged
set is the concatenation of the shards' ``X.jsonl``, ``X_failures.jsonl`` and
``X_materialized_inputs.jsonl``, row bytes unchanged, after these checks:

- conflicts (exit 2, nothing written): a rollout materialized twice (by one
  shard, or by two), a row for a rollout its shard did not materialize, a
  second success row for a rollout, a rollout in the wrong shard (for inputs
  named ``X.shard-K-of-N.jsonl``), one shard given twice or shards of
  different splits;
- missing (exit 75, the merged set is still written with everything
  present): a rollout without a final outcome (success, terminal failure, or
  ``--max-attempts`` failed attempts; the resume contract of
  ``dispatcher.files.resume``), a shard that has not materialized its inputs, or a
  shard number absent from the inputs. Rerun those shards' commands, which
  resume them, then merge again: merging is repeatable and replaces the
  merged files.

A sidecar given as an input (``X_failures.jsonl``, as a glob like
``x.shard-*.jsonl`` also catches) names the same set as its ``X.jsonl``: it
stands for that set, once.

Complete: exit 0. No manifest is written for the merged set: it is the
record of several runs, not one, and so cannot be resumed as a run itself.
Every file is written to a temporary name, fsynced and renamed into place,
``X.jsonl`` last; the merged set's run lock is held meanwhile.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from dispatcher.commands import command_help
from dispatcher.errors import ConfigError, ExitCode
from dispatcher.files.atomic import temp_path
from dispatcher.files.resume import (
    FAILURE_FACTS,
    IDENTITY_FACTS,
    OutputPaths,
    RunState,
    iter_lines,
)
from dispatcher.ops.runfiles import lock_status, read_manifest
from dispatcher.ops.status import DEFAULT_MAX_ATTEMPTS, max_attempts_for
from dispatcher.ops.table import format_table
from dispatcher.settings.args import positive_int
from dispatcher.settings.shard import Shard, shard_of_output
from dispatcher.tasks.keys import key_label, row_key, task_of

SAMPLE = 20


@dataclass
class ShardResult:
    """What one shard contributed."""

    output: str
    shard: Shard | None
    started: bool = True
    expected: int = 0
    successes: int = 0
    final: int = 0
    missing: int = 0
    missing_sample: list[str] = field(default_factory=list)
    unreadable: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "shard": str(self.shard) if self.shard else None,
            "started": self.started,
            "expected": self.expected,
            "successes": self.successes,
            "final": self.final,
            "missing": self.missing,
            "missing_sample": self.missing_sample,
            "unreadable_lines": self.unreadable,
        }


@dataclass
class Conflicts:
    count: int = 0
    sample: list[str] = field(default_factory=list)

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.sample) < SAMPLE:
            self.sample.append(message)


@dataclass
class MergeResult:
    output: str
    shards: list[ShardResult] = field(default_factory=list)
    missing_shards: list[str] = field(default_factory=list)
    conflicts: Conflicts = field(default_factory=Conflicts)
    written: bool = False

    @property
    def missing(self) -> int:
        return sum(s.missing for s in self.shards)

    @property
    def exit_code(self) -> ExitCode:
        if self.conflicts.count:
            return ExitCode.BAD_INPUT
        if self.missing or self.missing_shards or not all(s.started for s in self.shards):
            return ExitCode.RESUMABLE
        return ExitCode.DONE

    def to_json(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "exit_code": int(self.exit_code),
            "written": self.written,
            "expected": sum(s.expected for s in self.shards),
            "successes": sum(s.successes for s in self.shards),
            "final": sum(s.final for s in self.shards),
            "missing": self.missing,
            "missing_shards": self.missing_shards,
            "shards_not_started": [s.output for s in self.shards if not s.started],
            "conflicts": self.conflicts.count,
            "conflict_sample": self.conflicts.sample,
            "shards": [s.to_json() for s in self.shards],
        }


class AtomicSet:
    """The merged files, written under temporary names and renamed into place on commit."""

    def __init__(self, paths: OutputPaths) -> None:
        self._targets = (paths.materialized, paths.failures, paths.output)
        self._tmps = tuple(temp_path(p) for p in self._targets)
        self._files: list[IO[bytes]] = []
        for tmp in self._tmps:
            self._files.append(tmp.open("wb"))
        self.materialized, self.failures, self.output = self._files

    def commit(self) -> None:
        for f in self._files:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        # X.jsonl last: a reader that sees the new successes sees their inputs too.
        for tmp, target in zip(self._tmps, self._targets, strict=True):
            os.replace(tmp, target)
        _fsync_dir(self._targets[0].parent)

    def abort(self) -> None:
        for f in self._files:
            f.close()
        for tmp in self._tmps:
            tmp.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _line(raw: bytes) -> bytes:
    # A whole last row without its newline is kept, as resume's repair keeps it.
    return raw if raw.endswith(b"\n") else raw + b"\n"


def merge_shards(
    sources: list[Path], merged: Path, *, max_attempts: int | None = None
) -> MergeResult:
    """Merge shard output sets into ``merged``; see the module docstring for the rules."""
    sources = output_sets(sources)
    merged_paths = OutputPaths.for_output(merged)
    _check_inputs(sources, merged_paths)
    merged.parent.mkdir(parents=True, exist_ok=True)
    result = MergeResult(output=str(merged))
    _check_split(sources, result)
    lock_fd = _lock(merged_paths.lock)
    try:
        out = AtomicSet(merged_paths)
        try:
            seen: set[int] = set()
            for source in sources:
                result.shards.append(_merge_one(source, out, seen, result.conflicts, max_attempts))
        except BaseException:
            out.abort()
            raise
        if result.conflicts.count:
            out.abort()
        else:
            out.commit()
            result.written = True
    finally:
        os.close(lock_fd)
    return result


# The files of contracts §4 other than X.jsonl, by how their names end.
_SIDECAR_ENDINGS = ("_failures.jsonl", "_materialized_inputs.jsonl", "_manifest.json", "_run.lock")


def output_sets(sources: list[Path]) -> list[Path]:
    """The inputs as output sets (``X.jsonl``): a sidecar stands for its set, which counts once.

    A set named twice directly stays twice, so that mistake is still reported.
    """
    direct = {s.resolve() for s in sources if sidecar_set(s) is None}
    sets: list[Path] = []
    for source in sources:
        output = sidecar_set(source)
        if output is None:
            sets.append(source)
        elif output.resolve() not in direct:
            direct.add(output.resolve())
            sets.append(output)
    return sets


def sidecar_set(path: Path) -> Path | None:
    """The ``X.jsonl`` whose sidecar ``path`` is, or None when ``path`` is an output itself."""
    if OutputPaths.for_output(path).materialized.exists():
        return None  # an output whose own name happens to end like a sidecar
    for ending in _SIDECAR_ENDINGS:
        if path.name.endswith(ending):
            return path.with_name(path.name.removesuffix(ending) + ".jsonl")
    return None


def _check_inputs(sources: list[Path], merged: OutputPaths) -> None:
    if not sources:
        raise ConfigError("merge: name at least one shard output")
    targets = {p.resolve() for p in merged.all()}
    for source in sources:
        paths = OutputPaths.for_output(source)
        if targets & {p.resolve() for p in paths.all()}:
            raise ConfigError(f"merge: --output {merged.output} is also an input ({source})")
        held = lock_status(paths.lock)
        if held.held:
            raise ConfigError(
                f"merge: a dispatcher (pid {held.pid}) is still writing {source}; "
                "merge after it has exited"
            )
    if merged.manifest.exists():
        raise ConfigError(
            f"merge: {merged.manifest} exists, so {merged.output} is a run's output; "
            "merge into another --output"
        )


def _check_split(sources: list[Path], result: MergeResult) -> None:
    """Shard-named inputs must be one split, each shard once; report absent shard numbers."""
    seen_paths: set[Path] = set()
    shards: Counter[Shard] = Counter()
    for source in sources:
        resolved = source.resolve()
        if resolved in seen_paths:
            result.conflicts.add(f"{source}: given twice")
        seen_paths.add(resolved)
        shard = shard_of_output(source)
        if shard is not None:
            shards[shard] += 1
    counts = {s.count for s in shards}
    if len(counts) > 1:
        result.conflicts.add(f"shards of different splits: {sorted(str(s) for s in shards)}")
        return
    for shard, n in shards.items():
        if n > 1:
            result.conflicts.add(f"shard {shard} given {n} times")
    if counts:
        (count,) = counts
        given = {s.index for s in shards}
        result.missing_shards = [f"{k}/{count}" for k in range(count) if k not in given]


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"merge: {path} is held by a running dispatcher") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _merge_one(
    source: Path, out: AtomicSet, seen: set[int], conflicts: Conflicts, max_attempts: int | None
) -> ShardResult:
    paths = OutputPaths.for_output(source)
    result = ShardResult(output=str(source), shard=shard_of_output(source))
    if not paths.materialized.is_file():
        result.started = False
        return result
    keys = _copy_materialized(paths, out, seen, conflicts, result)
    state = RunState(max_attempts=max_attempts_for(max_attempts, read_manifest(paths.manifest)))
    _copy_successes(paths, out, keys, state, conflicts, result)
    _copy_failures(paths, out, keys, state, conflicts, result)
    missing = [key for key in keys if not state.is_final(key)]
    result.final = len(keys) - len(missing)
    result.missing = len(missing)
    result.missing_sample = [key_label(k) for k in heapq.nsmallest(SAMPLE, missing)]
    seen |= keys
    return result


def _copy_materialized(
    paths: OutputPaths, out: AtomicSet, seen: set[int], conflicts: Conflicts, result: ShardResult
) -> set[int]:
    keys: set[int] = set()
    for _, raw, row in iter_lines(paths.materialized, IDENTITY_FACTS):
        key = row_key(row)
        if key is None:
            result.unreadable += 1
            continue
        where = f"{paths.materialized}: rollout {key_label(key)}"
        if key in keys or key in seen:
            conflicts.add(f"{where} is materialized more than once")
            continue
        if result.shard is not None and not result.shard.contains(task_of(key)):
            conflicts.add(f"{where} does not belong to shard {result.shard}")
        keys.add(key)
        out.materialized.write(_line(raw))
    result.expected = len(keys)
    return keys


def _copy_successes(
    paths: OutputPaths,
    out: AtomicSet,
    keys: set[int],
    state: RunState,
    conflicts: Conflicts,
    result: ShardResult,
) -> None:
    for _, raw, row in iter_lines(paths.output, IDENTITY_FACTS):
        key = row_key(row)
        if key is None:
            result.unreadable += 1
            continue
        where = f"{paths.output}: rollout {key_label(key)}"
        if key not in keys:
            conflicts.add(f"{where} was not materialized by this shard")
        elif key in state.successes:
            conflicts.add(f"{where} has more than one success row")
        else:
            state.successes.add(key)
            out.output.write(_line(raw))
    result.successes = len(state.successes)


def _copy_failures(
    paths: OutputPaths,
    out: AtomicSet,
    keys: set[int],
    state: RunState,
    conflicts: Conflicts,
    result: ShardResult,
) -> None:
    for _, raw, row in iter_lines(paths.failures, FAILURE_FACTS):
        key = row_key(row)
        if row is None or key is None:
            result.unreadable += 1
            continue
        if key not in keys:
            conflicts.add(
                f"{paths.failures}: rollout {key_label(key)} was not materialized by this shard"
            )
            continue
        state.add_failure(key, row)
        out.failures.write(_line(raw))


# -- output -------------------------------------------------------------------------------


def render_merge(result: MergeResult) -> str:
    summary = result.to_json()
    lines = [
        f"merged {len(result.shards)} shard outputs into {result.output}"
        + ("" if result.written else " (nothing written)"),
        f"expected {summary['expected']}, succeeded {summary['successes']}, "
        f"final {summary['final']}, missing {summary['missing']}",
        "",
        format_table(
            ("shard output", "expected", "succeeded", "final", "missing", "unreadable"),
            [
                (s.output, s.expected, s.successes, s.final, s.missing, s.unreadable)
                if s.started
                else (s.output, "not started", "", "", "", "")
                for s in result.shards
            ],
            indent=0,
        ),
    ]
    lines.extend(_render_problems(result))
    return "\n".join(lines) + "\n"


def _render_problems(result: MergeResult) -> list[str]:
    lines = []
    if result.missing_shards:
        lines.append(f"\nshards not given: {', '.join(result.missing_shards)}")
    sample = [k for s in result.shards for k in s.missing_sample][:SAMPLE]
    if sample:
        lines.append(f"\nmissing rollouts ({result.missing}), first: {', '.join(sample)}")
    if result.exit_code is ExitCode.RESUMABLE:
        lines.append("rerun the incomplete shards' commands (they resume), then merge again")
    if result.conflicts.count:
        lines.append(f"\nconflicts ({result.conflicts.count}), nothing written:")
        lines.extend(f"  {message}" for message in result.conflicts.sample)
    return lines


# -- CLI ----------------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "merge",
        help=command_help("merge"),
        description=(
            "Concatenate the output sets of shards (X.jsonl, X_failures.jsonl, "
            "X_materialized_inputs.jsonl of each) into one set. Exit 0 when every expected "
            "rollout has a final outcome; 75 when some are missing (what is there is still "
            "written); 2 on conflicting or duplicate rows (nothing is written)."
        ),
    )
    parser.add_argument(
        "--output", type=Path, required=True, metavar="MERGED.jsonl", help="the merged set"
    )
    parser.add_argument(
        "shards", type=Path, nargs="+", metavar="SHARD_OUTPUT", help="each shard's --output"
    )
    parser.add_argument(
        "--max-attempts",
        type=positive_int,
        default=None,
        help=(
            "attempt cap of the shards' runs (default: each shard manifest's, "
            f"else {DEFAULT_MAX_ATTEMPTS})"
        ),
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run_merge)


def run_merge(args: argparse.Namespace) -> int:
    result = merge_shards(list(args.shards), args.output, max_attempts=args.max_attempts)
    if args.json:
        print(orjson.dumps(result.to_json(), option=orjson.OPT_INDENT_2).decode())
    else:
        print(render_merge(result), end="")
    return int(result.exit_code)
