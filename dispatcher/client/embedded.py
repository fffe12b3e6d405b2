"""A daemon of the drop-in's own (contracts §15): ``dispatcher serve`` as a child process.

``RolloutCollectionHelper()`` without a URL and without ``DISPATCHER_URL``
starts one on loopback, on a free port, its agents those of the Gym head
server that ``run_examples`` was given, its state in ``DISPATCHER_STATE`` or a
temporary directory (removed when the daemon stops). It runs as
``python -m dispatcher.client.embedded``: ``dispatcher serve ARGS`` plus a
watch on its stdin, a pipe only the parent holds, so the daemon stops
(SIGTERM, as at a terminal) when the parent dies whatever kills it. The
parent stops it on ``close()`` and at exit.

Its start is in two steps because most of it is Python importing the daemon
(seconds on a busy machine, where the rest takes tenths): ``spawn`` starts
the child at the helper's construction, where it imports everything
``serve`` runs on and waits; ``configure`` sends it its ``serve`` flags (one
JSON line on its stdin) once ``run_examples`` names the head server, and
waits until it listens.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from dispatcher import jsonx
from dispatcher.client.wire import ClientError

# How long the child may take to say it listens (it reads the head server's
# config first, within ``--gym-head-timeout-s``).
START_TIMEOUT_S = 120.0
# How long a SIGTERM'd daemon has to stop before it is killed.
STOP_TIMEOUT_S = 30.0
_LISTENING = "dispatcher serve listening on "
# What the child prints once it has imported the daemon and waits for its flags.
_IMPORTED = "dispatcher embedded imported\n"
# What ``serve`` and its first job import, imported while the child waits for
# its flags (``cli.main`` imports the command's own module lazily).
_WARM_MODULES = (
    "dispatcher.cli",
    "dispatcher.serve.command",
    "dispatcher.serve.api",
    "dispatcher.serve.jobs",
    "dispatcher.run.daemon",
    "dispatcher.run.job",
    "dispatcher.settings.flags",
    "dispatcher.settings.serve",
    "uvloop",
)


class EmbeddedDaemon:
    """A running child ``dispatcher serve``; ``url`` once it listens."""

    def __init__(self, process: subprocess.Popen[bytes], state_dir: str, owned: bool) -> None:
        self.process = process
        self.state_dir = state_dir
        self._owned = owned  # a temporary directory of ours, removed at the end
        self._listening = threading.Event()
        self._imported = threading.Event()
        self._url: str | None = None
        self._lock = threading.Lock()
        self.head_server: str | None = None  # once configured
        atexit.register(self.stop)
        self._reader = threading.Thread(
            target=self._read_stdout, name="dispatcher-embedded", daemon=True
        )
        self._reader.start()

    @classmethod
    def spawn(cls) -> EmbeddedDaemon:
        """Start the child, which imports the daemon and waits for ``configure`` (not blocking)."""
        given = os.environ.get("DISPATCHER_STATE")
        state_dir = given or tempfile.mkdtemp(prefix="dispatcher-state-")
        process = subprocess.Popen(
            [sys.executable, "-m", "dispatcher.client.embedded"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        return cls(process, state_dir, owned=given is None)

    @classmethod
    def start(cls, head_server_url: str, *flags: str) -> EmbeddedDaemon:
        """``spawn`` then ``configure``: blocking until it listens."""
        daemon = cls.spawn()
        daemon.configure(head_server_url, *flags)
        return daemon

    @property
    def configured(self) -> bool:
        return self.head_server is not None

    def configure(self, head_server_url: str, *flags: str) -> str:
        """Send the child its flags and wait until it listens (blocking; once); its URL.
        ``ClientError`` when it exits first, and then it is stopped."""
        args = ["--listen", "127.0.0.1:0", "--state-dir", self.state_dir,
                "--gym-head-server", head_server_url, *self._durability(), *flags]  # fmt: skip
        self.head_server = head_server_url
        try:
            assert self.process.stdin is not None
            self.process.stdin.write(jsonx.dumps(args) + b"\n")
            self.process.stdin.flush()
            return self.wait_listening(START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        assert self._url is not None
        return self._url

    def _durability(self) -> tuple[str, ...]:
        """``--fsync never`` for state in a temporary directory of ours (unless
        ``DISPATCHER_FSYNC`` says otherwise): it is removed when the daemon stops and
        nothing resumes from it after a power cut, so an fsync would protect nothing;
        a row is still handed over only once written, which a kill does not lose."""
        if self._owned and "DISPATCHER_FSYNC" not in os.environ:
            return ("--fsync", "never")
        return ()

    def wait_imported(self, timeout_s: float) -> bool:
        """Until the child has imported the daemon (most of its start), or exited;
        False if ``timeout_s`` passed first. A trainer whose set-up outlasts the
        imports never waits for them; one with nothing else to do may wait here."""
        return self._imported.wait(timeout_s) and self.process.poll() is None

    def wait_listening(self, timeout_s: float) -> str:
        if not self._listening.wait(timeout_s):
            message = f"the embedded dispatcher serve did not listen in {timeout_s:g} s"
            raise ClientError(None, message)
        if self._url is None:
            code = self.process.wait()
            raise ClientError(
                None, f"the embedded dispatcher serve exited {code} before it listened "
                "(its error is on stderr above)"
            )  # fmt: skip
        return self._url

    def _read_stdout(self) -> None:
        """The listening line, then whatever else it prints, to our stdout."""
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            line = raw.decode("utf-8", "replace")
            if line == _IMPORTED and not self._imported.is_set():
                self._imported.set()
            elif self._url is None and line.startswith(_LISTENING):
                self._url = line[len(_LISTENING) :].strip()
                self._listening.set()
            else:
                sys.stdout.write(line)
        self._imported.set()  # exited: whoever waits learns it
        self._listening.set()

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``; its exit code. Idempotent."""
        with self._lock:
            atexit.unregister(self.stop)
            process = self.process
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            self._reader.join()  # it read to the end: the pipe can close
            for pipe in (process.stdin, process.stdout):
                if pipe is not None and not pipe.closed:
                    pipe.close()
            if self._owned:
                shutil.rmtree(self.state_dir, ignore_errors=True)
            return process.returncode


def head_server_url(config: Any) -> str:
    """The URL of a Gym head server as ``run_examples`` is given it: a ``BaseServerConfig``
    (anything with ``host`` and ``port``), a mapping with them, or a URL; None is Gym's
    own default, the ``head_server`` of its global config (needs ``nemo_gym``)."""
    if config is None:
        try:
            from nemo_gym.server_utils import ServerClient
        except ImportError:
            raise ValueError(
                "head_server_config: none given, DISPATCHER_URL is unset and nemo_gym is not "
                "importable for Gym's default; give run_examples the head server's config, "
                "or DISPATCHER_URL a running dispatcher serve"
            ) from None
        config = ServerClient.load_head_server_config()
    if isinstance(config, str):
        return config
    if isinstance(config, Mapping):
        host, port = config.get("host"), config.get("port")
    else:
        host, port = getattr(config, "host", None), getattr(config, "port", None)
    if not host or not isinstance(port, int):
        raise ValueError(f"head_server_config: no host and integer port in {config!r}")
    return f"http://{host}:{port}"


def _read_flags() -> list[str] | None:
    """The one JSON line of flags the parent sends on stdin; None if it ends first."""
    # The raw descriptor, a byte at a time: nothing after the line is consumed
    # (the parent-watch reads on), and a buffered read holds a lock the
    # interpreter's exit needs.
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(0, 1)
        if not byte:
            return None
        line += byte
    flags = jsonx.loads(bytes(line))
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise SystemExit(f"dispatcher.client.embedded: stdin: not a JSON list of flags: {flags!r}")
    return flags


def _watch_parent() -> None:
    """SIGTERM this process once stdin ends: the parent that held its pipe is gone;
    SIGKILL if it has not stopped ``STOP_TIMEOUT_S`` later."""
    while os.read(0, 1 << 16):
        pass
    os.kill(os.getpid(), signal.SIGTERM)
    kill = threading.Timer(STOP_TIMEOUT_S, os.kill, (os.getpid(), signal.SIGKILL))
    kill.daemon = True
    kill.start()


def main(argv: Sequence[str] | None = None) -> int:
    """``dispatcher serve ARGS`` that stops when its parent does; without ARGS, the
    daemon imported first, then its flags read from stdin (``configure``)."""
    for module in _WARM_MODULES:
        importlib.import_module(module)
    # What the daemon's start does first (``aio.tune_gc``), done while it waits: a
    # full pass over everything just imported, kept out of later passes.
    gc.collect()
    gc.freeze()
    from dispatcher.cli import main as cli_main

    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        sys.stdout.write(_IMPORTED)
        sys.stdout.flush()
        flags = _read_flags()
        if flags is None:
            return 0  # the parent went away before it needed a daemon
        args = flags
    threading.Thread(target=_watch_parent, name="parent-watch", daemon=True).start()
    return cli_main(["serve", *args])


if __name__ == "__main__":
    raise SystemExit(main())
