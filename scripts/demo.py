"""``make demo``: the main job, for real, on the built-in simulated servers.

Starts a simulated model server, the capture proxy in front of it and two
simulated agent replicas, all on 127.0.0.1 as separate processes, then shows
both modes:

1. ``dispatcher run``: a first hop with a tight dispatch budget (some
   rollouts are drained, exit 75), then the same command again until it
   resumes and finishes the run (exit 0);
2. ``dispatcher serve``: a trainer (the blocking ``dispatcher.client``)
   submits training steps as jobs, consumes step N's complete groups while
   step N+1 runs, and advances the policy version after each step
   (``--max-off-policy-steps 1`` paces step N+2 until then);
3. step control against a heavy-tailed agent: a plain step waits for its
   slowest group, a step with ``target_groups`` and ``overprovision`` is
   satisfied at its N-th group and its tail lands for the next step; a step
   with the group filter refills one group per group it drops; the trainer
   pauses admission around its weight update.

Everything lands in ``demo-output/``.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

TASKS = 120
REPEATS = 4


def _dispatcher() -> str:
    """How a person runs ``dispatcher`` from here: the venv's script, else the PATH's."""
    script = Path(sys.executable).parent / "dispatcher"
    if not script.exists():
        return "dispatcher"
    try:
        return str(script.relative_to(Path.cwd()))
    except ValueError:
        return str(script)


def _say(args: list[str], log: Path | None = None) -> None:
    """Print the command about to run, as a person can copy it (log: where its stderr goes)."""
    redirect = f" 2> {shlex.quote(str(log))}" if log is not None else ""
    print(f"$ {shlex.join([_dispatcher(), *args])}{redirect}", flush=True)


def _start(args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``dispatcher ARGS`` and wait for its "listening on URL" line."""
    _say(args, log)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dispatcher", *args],
        stdout=subprocess.PIPE,
        stderr=log.open("wb"),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if "listening on " not in line:
        proc.kill()
        raise SystemExit(f"demo: {args[0]} did not start (see {log})")
    return proc, line.rsplit(" ", 1)[-1].strip()


def _write_tasks(path: Path) -> None:
    with path.open("wb") as f:
        for i in range(TASKS):
            row = {
                "agent_ref": {"name": "math_agent"},
                "responses_create_params": {"input": f"What is {i} + {i}?"},
                "expected_answer": str(2 * i),
            }
            f.write(orjson.dumps(row) + b"\n")


def _events(log: Path, name: str) -> list[dict[str, Any]]:
    events = []
    for line in log.read_bytes().splitlines():
        if line.startswith(b"{"):
            event = orjson.loads(line)
            if event.get("event") == name:
                events.append(event)
    return events


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def _hop(number: int, base: list[str], budget_s: float | None, out: Path) -> int:
    log = out / f"run-hop{number}.log"
    args = [*base, "--log-format", "json"]
    if budget_s is not None:
        args += ["--dispatch-budget-s", str(budget_s)]
    what = f"dispatch budget {budget_s:g} s" if budget_s is not None else "no budget"
    print(f"\n-- hop {number} ({what}):")
    _say(args, log)
    with log.open("wb") as stderr:
        code = subprocess.call([sys.executable, "-m", "dispatcher", *args], stderr=stderr)
    summary = _events(log, "run_summary")[-1]
    outcomes = summary["outcomes"]
    latency = summary["latency_s"]
    print(f"   exit {code}; outcomes {outcomes}")
    print(
        f"   latency p50 {_fmt_s(latency['p50'])}  p75 {_fmt_s(latency['p75'])}  "
        f"p95 {_fmt_s(latency['p95'])}; {summary['rollouts_per_hour']:.0f} rollouts/hour"
    )
    if summary.get("drained"):
        print(f"   {summary['drained_note']}")
    print(f"   remaining for a rerun: {summary['remaining']}   (log: {log})")
    for event in _events(log, "metrics_listening"):
        print(f"   live metrics were at {event['url']} (also /status, /healthz)")
    return code


@contextlib.contextmanager
def _servers(out: Path) -> Iterator[dict[str, str]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        model, model_url = _start(["sim-model", "--listen", "127.0.0.1:0"], out / "sim-model.log")
        procs.append(model)
        proxy_args = ["capture-proxy", "--listen", "127.0.0.1:0", "--upstream", model_url]
        proxy, proxy_url = _start(
            [*proxy_args, "--capture-dir", str(out / "captures")], out / "proxy.log"
        )
        procs.append(proxy)
        agents = []
        for i in range(2):
            agent_args = [
                "sim-agent", "--listen", "127.0.0.1:0", "--latency", "lognormal",
                "--latency-s", "0.25", "--latency-sigma", "0.6", "--fail-503", "0.03",
                "--fail-500", "0.02", "--model-url", proxy_url, "--model-calls", "2",
                "--seed", str(i),
            ]  # fmt: skip
            proc, url = _start(agent_args, out / f"sim-agent-{i}.log")
            procs.append(proc)
            agents.append(url)
        yield {"model": model_url, "proxy": proxy_url, "agents": ",".join(agents)}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="demo-output", help="folder for every demo file")
    parser.add_argument("--budget-s", type=float, default=4.0, help="first hop's budget")
    options = parser.parse_args()
    out = Path(options.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tasks = out / "tasks.jsonl"
    _write_tasks(tasks)
    print("== rollout-dispatcher demo ==")
    print(f"tasks: {TASKS} x {REPEATS} repeats = {TASKS * REPEATS} rollouts ({tasks})")
    with _servers(out) as urls:
        print(f"sim model {urls['model']}  <-  capture proxy {urls['proxy']}")
        print(f"agent 'math_agent' replicas: {urls['agents']}")
        base = [
            "run", "--input", str(tasks), "--output", str(out / "rollouts.jsonl"),
            "--agent", f"math_agent={urls['agents']}", "--num-repeats", str(REPEATS),
            "--concurrency", "24", "--rollout-timeout-s", "30",
            "--capture-dir", str(out / "captures"), "--metrics-listen", "127.0.0.1:0",
            "--progress-interval-s", "2",
        ]  # fmt: skip
        started = time.monotonic()
        code = _hop(1, base, options.budget_s, out)
        hop = 1
        while code == 75 and hop < 4:
            hop += 1
            code = _hop(hop, base, None, out)
        print(f"\n== done in {time.monotonic() - started:.1f}s, exit {code} ==")
        _show_files(out)
        _show(["status", str(out / "rollouts.jsonl")])
        if code == 0:
            code = _service_mode(out, urls)
    if code == 0:
        code = _step_control(out)
    return code


STEPS = 3
STEP_TASKS = 16


def _service_mode(out: Path, urls: dict[str, str]) -> int:
    """The same agents behind ``dispatcher serve``, driven by a trainer."""
    from dispatcher.client import Client

    print("\n== service mode: one daemon for the whole training run ==")
    args = [
        "serve", "--listen", "127.0.0.1:0", "--state-dir", str(out / "serve"),
        "--agent", f"math_agent={urls['agents']}", "--concurrency", "24",
        "--max-off-policy-steps", "1", "--log-format", "json",
    ]  # fmt: skip
    daemon, url = _start(args, out / "serve.log")
    print(f"dispatcher serve at {url} (jobs API, /metrics, /status); log {out / 'serve.log'}")
    try:
        with Client(url) as client:
            for step in range(min(2, STEPS)):
                _submit_step(client, step)
            for step in range(STEPS):
                started = time.monotonic()
                groups = rows = 0
                results = client.results(f"step-{step}", group=True)
                for group in results:  # complete groups as soon as they are durable
                    groups += 1
                    rows += len(group["rows"])
                took = time.monotonic() - started
                print(
                    f"  trainer: step {step}: {groups} groups, {rows} rows in {took:.1f}s "
                    f"(job {results.final_state}); policy version -> {step + 1}"
                )
                client.set_policy_version(step + 1)
                if step + 2 < STEPS:
                    _submit_step(client, step + 2)
    finally:
        daemon.terminate()
        code = daemon.wait(timeout=60)
    print(f"dispatcher serve exit {code} after SIGTERM; jobs under {out / 'serve' / 'jobs'}")
    _show(["status", str(out / "serve")])
    return code


TARGET = 32


def _step_control(out: Path) -> int:
    """A satisfied step: the same N groups without waiting for the slowest ones."""
    from dispatcher.client import Client

    print("\n== step control: stop at N groups, filter, pause for the weight update ==")
    agent_args = [
        "sim-agent", "--listen", "127.0.0.1:0", "--latency-dist", "lognormal:0.25,1",
        "--reward-p", "task", "--seed", "7",
    ]  # fmt: skip
    agent, agent_url = _start(agent_args, out / "sim-agent-tail.log")
    args = [
        "serve", "--listen", "127.0.0.1:0", "--state-dir", str(out / "serve-steps"),
        "--agent", f"math_agent={agent_url}", "--concurrency", "512", "--log-format", "json",
    ]  # fmt: skip
    daemon, url = _start(args, out / "serve-steps.log")
    print(f"heavy-tailed agent (lognormal, median 0.25 s, sigma 1) at {agent_url}")
    try:
        with Client(url) as client:
            plain_s = _timed_step(client, "plain", TARGET, {})
            steered = {"target_groups": TARGET, "overprovision": 1.25}
            target_s = _timed_step(client, "target", int(TARGET * 1.25), steered)
            print(f"  -> {TARGET} groups in {target_s / plain_s:.2f}x the plain step's time")
            client.pause(ttl_s=60, reason="weight update")
            idle = client.wait_idle(timeout_s=60)
            tail = client.results("target", group=True, after=client.status("target").satisfied_seq)
            late = list(tail)
            print(f"  trainer: admission paused for the weight update (idle: {idle.idle}); "
                  f"the target step's tail: {len(late)} groups, off-policy next step")  # fmt: skip
            client.set_policy_version(1)  # the new weights; ends the pause
            filtered = {**steered, "group_filter": "nonzero_reward_std"}
            _timed_step(client, "filtered", 4 * TARGET, filtered)
            status = client.status("filtered")
            print(f"  filter: {status.groups_kept} kept, {status.groups_filtered} filtered "
                  f"(all rewards equal), refilled one group at a time")  # fmt: skip
    finally:
        for proc in (daemon, agent):
            proc.terminate()
        code = daemon.wait(timeout=60)
        agent.wait(timeout=10)
    return code


def _timed_step(client: Any, job_id: str, tasks: int, fields: dict[str, Any]) -> float:
    """Submit a step and read its groups to the stream's end; the seconds it took."""
    rows = [
        {"agent_ref": {"name": "math_agent"},
         "responses_create_params": {"input": f"{job_id}: what is {i} * {i}?"}}
        for i in range(tasks)
    ]  # fmt: skip
    started = time.monotonic()
    client.submit(rows, job_id=job_id, num_repeats=REPEATS, **fields)
    results = client.results(job_id, group=True)
    groups = sum(1 for _ in results)
    took = time.monotonic() - started
    timeline = client.status(job_id).timeline or {}
    figures = ", ".join(f"{k.removesuffix('_s')} {v:.2f}s" for k, v in timeline.items() if v)
    print(f"  trainer: {job_id}: {tasks} tasks x {REPEATS}, {groups} groups in {took:.2f}s "
          f"(end: {results.final_state}){'; ' + figures if figures else ''}")  # fmt: skip
    return took


def _submit_step(client: Any, step: int) -> None:
    rows = [
        {
            "agent_ref": {"name": "math_agent"},
            "responses_create_params": {"input": f"Step {step}: what is {i} + {i}?"},
            "expected_answer": str(2 * i),
        }
        for i in range(STEP_TASKS)
    ]
    status = client.submit(rows, job_id=f"step-{step}", num_repeats=REPEATS, policy_version=step)
    print(f"  trainer: submitted step {step} ({STEP_TASKS} tasks x {REPEATS}): {status.state}")


def _show_files(out: Path) -> None:
    print("\nfiles:")
    for path in sorted(out.glob("rollouts*")):
        lines = sum(1 for _ in path.open("rb")) if path.suffix == ".jsonl" else None
        print(f"  {path}" + (f"  ({lines} lines)" if lines is not None else ""))
    row = orjson.loads((out / "rollouts.jsonl").read_bytes().split(b"\n", 1)[0])
    capture = row.get("ng_model_call_capture", {})
    print(f"  a row's capture metrics: {capture.get('metrics')}")


def _show(args: list[str]) -> None:
    print()
    _say(args)
    subprocess.call([sys.executable, "-m", "dispatcher", *args])


if __name__ == "__main__":
    raise SystemExit(main())
