"""NeMo Gym 0.7.0's own collector, run beside ``dispatch_overhead.py``'s two clients.

Where the Gym venv of ``tests/gym/gym_env.py`` is ready, each round also runs
``gym eval run --no-serve`` (Gym's collector, its own process) against the
bench's agent, over the same task file, at the same concurrency, one rollout per
task. The collector finds its agents through a Gym head server; a stub here
answers the one request it makes, ``GET /global_config_dict_yaml``, with a
config that names the bench agent (``sim``, the name the tasks already carry)
and, in front of it, a ``legacy_agent`` environment server at the same address:
Gym 0.7.0 sends an agent's rows to ``POST /run`` of the environment server that
fronts it, so every request lands on the bench agent. Its aggregation (a
``POST /aggregate_metrics`` the bench agent does not serve) and its post-run
health check are switched off; both come after the last row.

Figures: the whole run (rows over wall time; user + system CPU of its process
tree from ``wait4``, start-up included), and its dispatch window, read from
outside because Gym reports none to the millisecond: the output file is polled
every ``POLL_S``, from the last poll that found it empty to the first that found
every row, with the CPU the process spent in between (``/proc/PID/stat``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import yaml
from _common import median

ROOT = Path(__file__).resolve().parents[1]
LABEL = "NeMo Gym 0.7.0 collector"
BARE = "bare aiohttp+uvloop client"
DAEMON = "dispatcher run"
# The agent name the bench's tasks carry: Gym routes them as they are.
AGENT = "sim"
CONFIG_PATH = "/global_config_dict_yaml"
# Window edges are known to within one poll: 10 ms on a window of seconds.
POLL_S = 0.01


def gym_config(agent_url: str, head: tuple[str, int]) -> dict[str, Any]:
    """Gym's global config: one agent at ``agent_url``, a legacy environment server before it."""
    parts = urlsplit(agent_url)
    address = {"host": parts.hostname, "port": parts.port}
    front = {**address, "agent_server": {"type": "responses_api_agents", "name": AGENT}}
    return {
        "head_server": {"host": head[0], "port": head[1]},
        AGENT: {"responses_api_agents": {"simple_agent": address}},
        f"{AGENT}_environment": {"environment_servers": {"legacy_agent": front}},
    }


class _HeadServer(ThreadingHTTPServer):
    """Answers the global config; remembers every path asked, to check nothing else was."""

    body = b""
    asked: list[str]

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server_address[:2]
        return str(host), int(port)


class _HeadHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        server = self.server
        assert isinstance(server, _HeadServer)
        server.asked.append(f"GET {self.path}")
        if self.path != CONFIG_PATH:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(server.body)))
        self.end_headers()
        self.wfile.write(server.body)

    def do_POST(self) -> None:
        assert isinstance(self.server, _HeadServer)
        self.server.asked.append(f"POST {self.path}")
        self.send_error(404)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the bench's output is its figures


@contextmanager
def head_stub(agent_url: str) -> Iterator[_HeadServer]:
    """A stand-in for Gym's head server, on a thread of this process (one request a run)."""
    server = _HeadServer(("127.0.0.1", 0), _HeadHandler)
    server.asked = []
    # Like Gym's head server (FastAPI answering a str): the YAML as one JSON string.
    text = yaml.safe_dump(gym_config(agent_url, server.address), sort_keys=False)
    server.body = orjson.dumps(text)
    thread = threading.Thread(target=server.serve_forever, name="gym-head-stub", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


class GymRunFailed(Exception):
    """Gym's collector exited non-zero or wrote fewer rows than there are tasks."""


@dataclass(frozen=True)
class Sample:
    at_s: float
    size: int
    cpu_s: float | None


@dataclass(frozen=True)
class Watched:
    returncode: int
    wall_s: float
    cpu_s: float
    rss_mb: float
    samples: list[Sample]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _proc_cpu_s(pid: int) -> float | None:
    """User + system CPU of a live process so far (Linux ``/proc``), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the command name, which may itself hold spaces and parentheses.
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_watched(args: list[str], cwd: Path, output: Path, log: Path) -> Watched:
    """Run ``args``, sampling ``output``'s size and the process's CPU until it exits."""
    samples: list[Sample] = []
    started = time.perf_counter()
    with log.open("wb") as sink:
        proc = subprocess.Popen(args, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            at_s = time.perf_counter() - started
            samples.append(Sample(at_s, _size(output), _proc_cpu_s(proc.pid)))
            time.sleep(POLL_S)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return Watched(
        returncode=proc.returncode,
        wall_s=time.perf_counter() - started,
        cpu_s=usage.ru_utime + usage.ru_stime,
        rss_mb=usage.ru_maxrss / 1024,
        samples=samples,
    )


def dispatch_window(samples: list[Sample], final_size: int) -> tuple[Sample, Sample] | None:
    """The last sample with no row yet and the first with every row (None: never seen both)."""
    first_full = next((i for i, s in enumerate(samples) if s.size >= final_size), None)
    if first_full is None or first_full == 0:
        return None
    empty = [s for s in samples[:first_full] if s.size == 0]
    return (empty[-1], samples[first_full]) if empty else None


def gym_args(
    gym: Path, tasks: Path, output: Path, concurrency: int, head: _HeadServer
) -> list[str]:
    host, port = head.address
    return [
        str(gym), "eval", "run", "--no-serve", "--agent", AGENT,
        "--input", str(tasks), "--output", str(output),
        "--num-repeats", "1", "--concurrency", str(concurrency),
        "--disable-aggregation", "--no-health-check",
        f"+head_server.host={host}", f"+head_server.port={port}",
    ]  # fmt: skip


@dataclass
class GymCollector:
    """Gym's collector, run each round against the bench's agent through ``head``."""

    gym: Path
    head: _HeadServer
    LABEL = LABEL

    def run_round(
        self, this: dict[str, dict[str, float]], work: Path, tasks: Path, concurrency: int, tag: str
    ) -> None:
        """Gym's figures into the round's, unless its collector failed (then a line says so:
        on a shared machine a run can die of something else, and the round's others stand)."""
        try:
            this[LABEL] = self.collect(work, tasks, concurrency, tag)
        except GymRunFailed as exc:
            print(f"  {LABEL}: left out of this round ({exc})")

    def collect(self, work: Path, tasks: Path, concurrency: int, tag: str) -> dict[str, float]:
        cwd = work / tag  # Hydra writes its outputs/ under the working directory
        cwd.mkdir()
        output = cwd / "rollouts.jsonl"
        args = gym_args(self.gym, tasks, output, concurrency, self.head)
        run = run_watched(args, cwd, output, work / f"{tag}.log")
        rows = sum(1 for _ in output.open("rb")) if output.exists() else 0
        expected = sum(1 for _ in tasks.open("rb"))
        if run.returncode != 0 or rows != expected:
            tail = (work / f"{tag}.log").read_bytes()[-500:]
            raise GymRunFailed(f"exit {run.returncode}, {rows} of {expected} rows; log: {tail!r}")
        self._check_asked()
        return _gym_figures(rows, run, dispatch_window(run.samples, _size(output)))

    def report_round(self, i: int, this: dict[str, dict[str, float]], rows: int) -> None:
        if LABEL in this:
            add_ratios(this, rows)
            report(f"round {i + 1}", this[LABEL], rows)

    def report_median(self, runs: dict[str, list[dict[str, float]]], rows: int) -> None:
        if LABEL in runs:
            report_median(runs[LABEL], rows)
        else:
            print(f"  {LABEL}: failed in every round")

    def _check_asked(self) -> None:
        unexpected = [ask for ask in self.head.asked if ask != f"GET {CONFIG_PATH}"]
        if unexpected:
            raise SystemExit(f"Gym's collector asked the head stub for more: {unexpected}")


def _gym_figures(rows: int, run: Watched, window: tuple[Sample, Sample] | None) -> dict[str, float]:
    figures = {
        "cpu_ms": run.cpu_s / rows * 1000,
        "wall_s": run.wall_s,
        "rss_mb": run.rss_mb,
        # Without a window seen (a run too short to poll), the whole run stands in.
        "rate": rows / run.wall_s,
        "window_cpu_ms": run.cpu_s / rows * 1000,
        "first_row_s": 0.0,
    }
    if window is not None:
        start, end = window
        figures["rate"] = rows / (end.at_s - start.at_s)
        figures["first_row_s"] = start.at_s
        if start.cpu_s is not None and end.cpu_s is not None:
            figures["window_cpu_ms"] = (end.cpu_s - start.cpu_s) / rows * 1000
    return figures


def find_gym() -> Path | str:
    """The ``gym`` command of the ready Gym venv, or the reason the collector is not run."""
    sys.path.insert(0, str(ROOT))
    from tests.gym import gym_env

    venv = gym_env.ready_venv()
    if venv is None:
        return (
            f"no ready NeMo Gym {gym_env.GYM_VERSION} venv (build it with"
            " `python3 tests/gym/gym_env.py`; it needs a Python 3.13)"
        )
    return venv / "bin" / "gym"


@contextmanager
def gym_collector(agent_url: str, skip: bool) -> Iterator[GymCollector | None]:
    """Gym's collector around ``agent_url``, or None after a line saying why it is not run."""
    found = "--no-gym given" if skip else find_gym()
    if isinstance(found, str):
        print(f"{LABEL}: not run ({found})")
        yield None
        return
    with head_stub(agent_url) as head:
        yield GymCollector(found, head)


def _whole_rate(fig: Mapping[str, float], rows: int) -> float:
    return rows / fig["wall_s"]


def add_ratios(this: dict[str, dict[str, float]], rows: int) -> None:
    """Gym's whole-run and window ratios to each client of the same round, into its figures."""
    gym = this[LABEL]
    for key, name in (("bare", BARE), ("daemon", DAEMON)):
        other = this[name]
        gym[f"whole_rate_vs_{key}"] = _whole_rate(gym, rows) / _whole_rate(other, rows)
        gym[f"whole_cpu_vs_{key}"] = gym["cpu_ms"] / other["cpu_ms"]
        gym[f"window_rate_vs_{key}"] = gym["rate"] / other["rate"]
        gym[f"window_cpu_vs_{key}"] = gym["window_cpu_ms"] / other["cpu_ms"]


def report(prefix: str, gym: Mapping[str, float], rows: int) -> None:
    """Gym's own lines: the whole run and its window, each with its ratios (Gym ÷ other)."""
    print(
        f"  {prefix}    Gym whole run  {_whole_rate(gym, rows):7.0f} rollouts/s"
        f"  CPU {gym['cpu_ms']:6.3f} ms/rollout  first row at {gym['first_row_s']:.1f} s"
        f"  peak RSS {gym['rss_mb']:.0f} MB"
        f"  rate ÷ bare {gym['whole_rate_vs_bare']:.2f}, ÷ dispatcher"
        f" {gym['whole_rate_vs_daemon']:.2f}  CPU ÷ bare {gym['whole_cpu_vs_bare']:.2f},"
        f" ÷ dispatcher {gym['whole_cpu_vs_daemon']:.2f}"
    )
    print(
        f"  {prefix}    Gym window     {gym['rate']:7.0f} rollouts/s"
        f"  CPU {gym['window_cpu_ms']:6.3f} ms/rollout (theirs: whole run)"
        f"  rate ÷ bare {gym['window_rate_vs_bare']:.2f}, ÷ dispatcher"
        f" {gym['window_rate_vs_daemon']:.2f}  CPU ÷ bare {gym['window_cpu_vs_bare']:.2f},"
        f" ÷ dispatcher {gym['window_cpu_vs_daemon']:.2f}"
    )


def report_median(figs: list[dict[str, float]], rows: int) -> None:
    """Gym's lines over the rounds: the median of each figure and of each round's ratio."""
    report("median", {key: median([f[key] for f in figs]) for key in figs[0]}, rows)
