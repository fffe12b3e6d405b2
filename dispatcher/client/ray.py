"""``dispatcher serve`` as a detached, named Ray actor, found by trainers by its name.

A trainer that runs on Ray (NeMo RL, veRL, OpenRLHF) has no process of its
own for a daemon that must outlive its steps. ``start_serve_actor`` makes one
in the Ray cluster: a detached actor (it outlives the driver that made it)
under a name, which Ray restarts when it dies (``max_restarts``). The actor
runs ``dispatcher serve`` as its child process; its state directory is on
storage every node sees, so a restarted actor, on whichever node, runs a
daemon that resumes every unfinished job exactly (the daemon's crash-only
contract: a row is done iff its line is durable; see contracts §12).

The child dies with the actor (``PR_SET_PDEATHSIG``: for the daemon a killed
actor is a kill -9), and a restarted actor first ends a daemon a previous
incarnation left on the same node (its pid is kept in the state directory),
so the state directory's lock is free for the new one.

Trainers find the daemon with ``find_serve(name)`` (its URL; a restart may
change the port, so ask again after a connection error). Ray is imported at
the first call: nothing else of the package needs it.

    from dispatcher.client.ray import find_serve, start_serve_actor

    url = start_serve_actor(
        "rollouts", "/shared/run-7/serve",
        args=["--api-token-file", "/shared/run-7/token", "--gym-head-server", head],
    )
    # any actor of the same Ray cluster, later:
    with Client(find_serve("rollouts"), token=token) as client: ...
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

NAMESPACE = "dispatcher"
# The daemon's pid, beside its state (a restarted actor ends a leftover one).
PID_FILE = "serve-actor.pid"
READY_TIMEOUT_S = 120.0
_LISTENING = "dispatcher serve listening on "
_PR_SET_PDEATHSIG = 1


def start_serve_actor(
    name: str,
    state_dir: str | os.PathLike[str],
    *,
    args: Sequence[str] = (),
    listen: str | None = None,
    namespace: str = NAMESPACE,
    max_restarts: int = -1,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> str:
    """Start (or find, when one of that name lives) the daemon's actor; its URL.

    ``args`` are more flags of ``dispatcher serve`` (agents, token file, bounds).
    ``listen`` defaults to this node's address, port 0 (any free one): beyond
    loopback, so ``args`` must name ``--api-token-file`` (contracts §14).
    ``max_restarts=-1``: Ray restarts it however often it dies.
    """
    ray = _ray()
    where = listen or f"{ray.util.get_node_ip_address()}:0"
    actor = (
        ray.remote(ServeProcess)
        .options(
            name=name,
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=max_restarts,
            # Its methods only read: after a restart they may run again.
            max_task_retries=-1,
            # The daemon's work is I/O: it takes no CPU slot a trainer would wait for.
            num_cpus=0,
        )
        .remote(str(state_dir), list(args), where, ready_timeout_s)
    )
    return str(ray.get(actor.url.remote()))


def find_serve(name: str, *, namespace: str = NAMESPACE, timeout_s: float | None = 300.0) -> str:
    """The URL of the daemon the actor ``name`` runs (waiting while Ray restarts it)."""
    ray = _ray()
    actor = ray.get_actor(name, namespace=namespace)
    return str(ray.get(actor.url.remote(), timeout=timeout_s))


def stop_serve_actor(name: str, *, namespace: str = NAMESPACE, grace_s: float = 30.0) -> int:
    """Stop the daemon (SIGTERM, its jobs settle within ``grace_s``) and its actor for
    good; the daemon's exit code (75 while jobs are unfinished: they resume at the
    next start on the same state directory)."""
    ray = _ray()
    actor = ray.get_actor(name, namespace=namespace)
    code = int(ray.get(actor.stop.remote(grace_s)))
    ray.kill(actor, no_restart=True)
    return code


class ServeProcess:
    """``dispatcher serve`` as a child of this process (the actor's body)."""

    def __init__(
        self, state_dir: str, args: Sequence[str], listen: str, ready_timeout_s: float
    ) -> None:
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        end_leftover(self.state_dir)
        command = [sys.executable, "-m", "dispatcher", "serve"]
        command += ["--state-dir", str(self.state_dir), "--listen", listen, *args]
        self._proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent
        )
        (self.state_dir / PID_FILE).write_text(f"{self._proc.pid}\n")
        self._url = _wait_ready(self._proc, ready_timeout_s)

    def url(self) -> str:
        return self._url

    def pid(self) -> int:
        """The daemon's process id."""
        return self._proc.pid

    def stop(self, grace_s: float = 30.0) -> int:
        """SIGTERM, then its exit code (SIGKILL past ``grace_s`` and 10 s more)."""
        self._proc.send_signal(signal.SIGTERM)
        try:
            return self._proc.wait(grace_s + 10.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return self._proc.wait()


def end_leftover(state_dir: Path) -> None:
    """End the daemon a previous actor left on this node (its pid file names it), and
    wait until it is gone: it holds the state directory's lock."""
    try:
        pid = int((state_dir / PID_FILE).read_text())
    except (OSError, ValueError):
        return
    if not _is_serve_of(pid, state_dir):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30.0
    while _is_serve_of(pid, state_dir) and time.monotonic() < deadline:
        time.sleep(0.05)


def _is_serve_of(pid: int, state_dir: Path) -> bool:
    """Whether ``pid`` is a live ``dispatcher serve`` of ``state_dir`` (not a reused pid)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    words = raw.decode(errors="replace").split("\0")
    return state != "Z" and "serve" in words and str(state_dir) in words


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the actor's process dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _wait_ready(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The URL the daemon says it listens on; its stdout is then copied to ours."""
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(proc, lines), daemon=True, name="serve-out").start()
    deadline = time.monotonic() + timeout_s
    while (left_s := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left_s)
        except queue.Empty:
            break
        if line is None:
            code = proc.wait()
            raise RuntimeError(
                f"dispatcher serve exited {code} before it listened (its log: stderr)"
            )
        if line.startswith(_LISTENING):
            return line.removeprefix(_LISTENING).strip()
    proc.kill()
    raise RuntimeError(f"dispatcher serve did not listen within {timeout_s:g} s")


def _pump(proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put(line)
        sys.stdout.write(line)
    lines.put(None)


def _ray() -> Any:
    try:
        return importlib.import_module("ray")
    except ImportError:
        raise RuntimeError(
            "dispatcher.client.ray needs the `ray` package (pip install 'ray>=2.9')"
        ) from None
