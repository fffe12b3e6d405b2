"""Everything between "settings are valid" and "the first rollout may start".

Takes the run lock, moves old files aside on ``--fresh``, materializes the task
file, checks this command is the same run as the one recorded in the manifest
(or starts a new one), repairs torn tails and reads back what is already done.
Blocking file work: the service runs it in a thread. A ``ConfigError`` here
leaves no new file behind.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import os
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import structlog

from dispatcher import __version__, jsonx
from dispatcher.errors import ConfigError
from dispatcher.files import gym_compat
from dispatcher.files.atomic import (
    RunLock,
    fsync_dir,
    fsync_file,
    make_dirs,
    move_aside,
    read_manifest,
    temp_path,
    write_manifest,
)
from dispatcher.files.contracts import RunManifest
from dispatcher.files.resume import (
    OutputPaths,
    RunState,
    TailRepair,
    load_run_state,
    repair_torn_tail,
)
from dispatcher.files.writer import LineIndex, open_for_append
from dispatcher.settings.config import RunSettings
from dispatcher.tasks.lines import file_digest
from dispatcher.tasks.materialize import (
    MaterializeResult,
    MaterializeSpec,
    input_digest,
    materialize,
)
from dispatcher.telemetry.discovery import MetricsEndpoint, sd_file_for, target_labels

log = structlog.get_logger(__name__)

# Settings that change what a rollout is; any other setting may change on resume.
TASK_SETTINGS = (
    "num_repeats",
    "limit",
    "default_agent",
    "responses_create_params",
    "skip_invalid_rows",
    "shard",
)


@dataclass
class PreparedRun:
    paths: OutputPaths
    lock: RunLock
    record: RunManifest  # the manifest as written at the start of this hop
    materialized: MaterializeResult
    state: RunState
    already_final: int
    resumed: bool
    # Prepared without fsync: makes the materialized rows and the manifest durable
    # (blocking), to be done before any row of the hop is.
    sync: Callable[[], None] | None = None


def task_settings(settings: RunSettings) -> dict[str, Any]:
    """The task-affecting settings as JSON values, as the manifest records them."""
    settings_json: dict[str, Any] = jsonx.loads(
        jsonx.dumps({key: getattr(settings, key) for key in TASK_SETTINGS})
    )
    return settings_json


def _digest(data: Any) -> str:
    return hashlib.sha256(jsonx.dumps(data, option=orjson.OPT_SORT_KEYS)).hexdigest()


def prepare_and_open(
    settings: RunSettings,
    shard_filter: Callable[[int], bool] | None,
    durable: bool,
    indexes: tuple[LineIndex | None, LineIndex | None],
    then: Callable[[PreparedRun], None],
) -> tuple[PreparedRun, tuple[int, int]]:
    """A hop's files in one thread hop (blocking): ``prepare_run``; the output's and
    failures' ``indexes`` loaded when still empty (once per process: a later hop's
    already holds every line); their files opened for appending (the descriptors
    returned); then ``then``. A failure releases what was taken.

    A loaded index is what streams show, and a stream shows only durable lines
    (contracts §12): unless ``settings.fsync`` is never, the file is fsynced before
    its index is loaded, since a kill may have left its last lines in the page cache only."""
    prepared = prepare_run(settings, shard_filter, durable=durable)
    fds: list[int] = []
    try:
        for index, path in zip(
            indexes, (prepared.paths.output, prepared.paths.failures), strict=True
        ):
            if index is not None and not len(index):
                if settings.fsync != "never":
                    _sync_if_written(path)
                index.load(path)
            fds.append(open_for_append(path))
        then(prepared)
    except BaseException:
        for fd in fds:
            os.close(fd)
        prepared.lock.release()
        raise
    return prepared, (fds[0], fds[1])


def _sync_if_written(path: Path) -> None:
    """``path`` durable when it holds anything (blocking)."""
    with contextlib.suppress(FileNotFoundError):
        if path.stat().st_size:
            fsync_file(path)


def prepare_run(
    settings: RunSettings,
    shard_filter: Callable[[int], bool] | None,
    *,
    durable: bool = True,
) -> PreparedRun:
    """Lock, materialize, check identity, repair and load state (blocking).

    ``durable=False`` (a served job, whose rows the service keeps durable) writes
    the materialized rows and the manifest without fsync, and the result's ``sync``
    makes them durable: its caller runs it beside its first rollouts, before the
    first row is durable. A crash before it leaves the earlier files or none, and
    no row: the next hop materializes the same rows again."""
    paths = OutputPaths.for_output(settings.output)
    check_run_paths(settings.input, paths)
    folder = paths.output.parent
    created = not folder.exists()
    _ensure_output_dir(folder)
    lock = RunLock(paths.lock)
    try:
        lock.acquire()
        return _prepare_locked(settings, paths, lock, shard_filter, durable)
    except BaseException:
        # Nothing was dispatched: leave the file system as it was found.
        lock.release(remove=lock.created)  # a no-op when the lock was never taken
        if created:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if still empty
        raise


def check_run_paths(input_path: Path, paths: OutputPaths) -> None:
    """Refuse inputs and outputs that would hang the run or destroy the task file.

    The task file is read more than once (materialized, then digested on every
    resume), so it must be a regular file: a FIFO would block the first open
    and a device like ``/dev/zero`` never ends. ``/dev/null`` reads as empty.
    Run files must be regular files too (``/dev/full`` would take the lock
    beside it in ``/dev``), and none may be the task file, by name or by inode
    (a hard link or symlink): writing it, or ``--fresh`` moving it aside,
    would destroy the input.
    """
    input_stat = _input_stat(input_path)
    # One stat a file, following links: a run file that is the task file by name
    # (a symlink, a path through one) or by inode (a hard link) exists, as the
    # task file does, and is its inode. (Resolving each name took a stat per
    # component of both paths: 120 system calls a served job's start.)
    found: dict[Path, os.stat_result] = {}
    for path in paths.all():
        with contextlib.suppress(OSError):
            found[path] = os.stat(path)
    for path, path_stat in found.items():
        if os.path.samestat(input_stat, path_stat):
            raise ConfigError(
                f"{input_path}: the task file is the same file as {path} (a file of "
                f"--output {paths.output}); give the run an --input outside its own files"
            )
    for path, path_stat in found.items():
        if not stat.S_ISREG(path_stat.st_mode):
            raise ConfigError(f"{path}: not a regular file; --output must name a file")


def _input_stat(path: Path) -> os.stat_result:
    try:
        found = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: input file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read input: {exc.strerror}") from None
    if stat.S_ISREG(found.st_mode) or os.path.samestat(found, os.stat(os.devnull)):
        return found
    if stat.S_ISDIR(found.st_mode):
        raise ConfigError(f"{path}: cannot read input: it is a directory")
    raise ConfigError(
        f"{path}: not a regular file ({_kind(found.st_mode)}); the task file is read "
        "more than once, so --input must name a file"
    )


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a special file"


def _ensure_output_dir(folder: Path) -> None:
    try:
        make_dirs(folder)
    except OSError as exc:
        raise ConfigError(f"{folder}: cannot create the output directory: {exc.strerror}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{folder}: output directory is not writable")


def _prepare_locked(
    settings: RunSettings,
    paths: OutputPaths,
    lock: RunLock,
    shard_filter: Callable[[int], bool] | None,
    durable: bool,
) -> PreparedRun:
    if settings.fresh:
        folder = move_aside(paths)
        if folder is not None:
            log.info("fresh_start_moved_old_files", folder=str(folder))
    previous = read_manifest(paths.manifest)
    gym_run = _gym_output(paths) if previous is None else None
    if previous is None and gym_run is None:
        _refuse_orphan_outputs(paths)
    with gym_compat.adoption(paths.materialized, paths.manifest, gym_run):
        result = _materialize_checked(settings, paths, previous, shard_filter, durable)
    manifest = _manifest(settings, result, previous)
    write_manifest(paths.manifest, manifest, durable=durable)
    for path in (paths.output, paths.failures):
        repair = repair_torn_tail(path)
        if repair is not TailRepair.NONE:
            log.warning("torn_tail_repaired", path=str(path), repair=repair.value)
    state = load_run_state(paths, settings.attempt_cap)
    return PreparedRun(
        paths=paths,
        lock=lock,
        record=manifest,
        materialized=result,
        state=state,
        already_final=_count_final(state),
        resumed=previous is not None or gym_run is not None,
        sync=None if durable else functools.partial(_sync, paths),
    )


def _sync(paths: OutputPaths) -> None:
    """The hop's materialized rows and manifest, and their names, durable (blocking)."""
    for path in (paths.materialized, paths.manifest):
        fsync_file(path)
    fsync_dir(paths.manifest.parent)


def _gym_output(paths: OutputPaths) -> gym_compat.Signature | None:
    """A directory NeMo Gym's collector wrote: rows, no manifest, its materialized inputs."""
    has_rows = any(p.exists() and p.stat().st_size > 0 for p in (paths.output, paths.failures))
    return gym_compat.gym_signature(paths.materialized) if has_rows else None


def _refuse_orphan_outputs(paths: OutputPaths) -> None:
    for path in (paths.output, paths.failures):
        if path.exists() and path.stat().st_size > 0:
            raise ConfigError(
                f"{path}: output rows exist but {paths.manifest.name} does not, so this "
                "cannot be checked to be the same run; rerun with --fresh to move them aside"
            )


def _materialize_checked(
    settings: RunSettings,
    paths: OutputPaths,
    previous: RunManifest | None,
    shard_filter: Callable[[int], bool] | None,
    durable: bool = True,
) -> MaterializeResult:
    spec = settings.materialize_spec(shard_filter)
    _remove_stale_temporaries(paths)
    if previous is not None:
        recorded = _reusable_materialization(spec, settings, paths, previous)
        if recorded is not None:
            return recorded
    tmp = temp_path(paths.materialized)
    try:
        result = materialize(spec, tmp, durable=durable)
        if result.input_rows == 0 and not settings.allow_empty:
            read = " with --limit 0" if settings.limit == 0 else ""
            raise ConfigError(
                f"no tasks in {settings.input}{read} (--allow-empty accepts an empty task file)"
            )
        if previous is not None:
            _check_same_run(settings, previous, result)
        os.replace(tmp, paths.materialized)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return result


def _remove_stale_temporaries(paths: OutputPaths) -> None:
    # Left by runs killed while materializing; under the lock nobody else writes here.
    pattern = f".{glob.escape(paths.materialized.name)}.*.tmp"
    for stale in paths.materialized.parent.glob(pattern):
        stale.unlink(missing_ok=True)


def _reusable_materialization(
    spec: MaterializeSpec, settings: RunSettings, paths: OutputPaths, previous: RunManifest
) -> MaterializeResult | None:
    """The recorded materialization when rebuilding it would give the same file, else None.

    Materializing is deterministic: the same task file under the same task
    settings gives the same rows. So a resume whose task file, settings and
    materialized file all still match the manifest reads each file once
    instead of rewriting every rollout. Any mismatch returns None: the caller
    materializes again and ``_check_same_run`` says what changed.
    """
    recorded = _recorded_materialization(previous)
    if recorded is None:
        return None  # a manifest from an older version: materialize again
    if previous.task_settings != task_settings(settings):
        return None
    if not set(recorded.rollouts_by_agent) <= set(settings.agents):
        return None
    if input_digest(spec) != recorded.input_digest:
        return None
    if file_digest(paths.materialized) != recorded.materialized_digest:
        return None
    return recorded


def _recorded_materialization(previous: RunManifest) -> MaterializeResult | None:
    """What the manifest says materializing gave, or None when it does not say all of it."""
    if (
        previous.input_rows is None
        or previous.tasks is None
        or previous.rollouts is None
        or previous.rollouts_by_agent is None
        or previous.input_digest is None
        or previous.materialized_digest is None
    ):
        return None
    return MaterializeResult(
        input_rows=previous.input_rows,
        tasks=previous.tasks,
        rollouts=previous.rollouts,
        rollouts_by_agent=dict(previous.rollouts_by_agent),
        input_digest=previous.input_digest,
        materialized_digest=previous.materialized_digest,
    )


def _check_same_run(
    settings: RunSettings, previous: RunManifest, result: MaterializeResult
) -> None:
    hint = "rerun with --fresh to start over (the old files are moved aside, not deleted)"
    # Settings first: a changed ``limit`` also changes the digest of the lines read.
    before = previous.task_settings or {}
    now = task_settings(settings)
    changed = [f"{k}: {before.get(k)!r} -> {now[k]!r}" for k in now if before.get(k) != now[k]]
    if changed:
        raise ConfigError(f"task-affecting settings changed ({'; '.join(changed)}); {hint}")
    if previous.input_digest != result.input_digest:
        raise ConfigError(
            f"{settings.input}: the task file changed since this run started "
            f"(its digest differs from {settings.output.stem}_manifest.json); {hint}"
        )
    if previous.materialized_digest != result.materialized_digest:
        raise ConfigError(f"the materialized rows differ from this run's earlier ones; {hint}")


def _manifest(
    settings: RunSettings, result: MaterializeResult, previous: RunManifest | None
) -> RunManifest:
    """This hop's manifest: the earlier one (unknown keys and ``last_run`` kept) updated."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    earlier = previous or RunManifest()
    settings_json = task_settings(settings)
    return earlier.model_copy(
        update={
            "run_id": earlier.run_id or uuid.uuid4().hex,
            "created_at": earlier.created_at or now,
            "hops": earlier.hops + 1,
            "hop_started_at": now,
            "dispatcher_version": __version__,
            "input": str(settings.input),
            "input_rows": result.input_rows,
            "input_digest": result.input_digest,
            "materialized_digest": result.materialized_digest,
            "task_settings": settings_json,
            "task_settings_digest": _digest(settings_json),
            "max_attempts": settings.attempt_cap,
            "rollout_timeout_s": settings.rollout_timeout_s,
            "tasks": result.tasks,
            "rollouts": result.rollouts,
            "rollouts_by_agent": result.rollouts_by_agent,
        }
    )


def _count_final(state: RunState) -> int:
    successes, terminal = state.successes, state.terminal
    count = len(successes)
    count += sum(1 for key in terminal if key not in successes)
    count += state.exhausted
    return count


def publish_metrics_endpoint(
    prepared: PreparedRun, endpoint: MetricsEndpoint, settings: RunSettings
) -> None:
    """Record the endpoint in the manifest and the Prometheus target file (blocking)."""
    prepared.record = prepared.record.with_metrics_url(endpoint.url)
    write_manifest(prepared.paths.manifest, prepared.record)
    output = prepared.paths.output
    labels = target_labels(prepared.record.to_json(), output, settings.shard)
    endpoint.publish(sd_file_for(output, settings.metrics_sd_dir), labels)
