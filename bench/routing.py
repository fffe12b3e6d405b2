"""Model calls routed by the rollout's identity: prefix-cache reuse, prefill work, time.

Each policy of the capture proxy (``--route round_robin|session|group``) runs the
same job in one sitting: ``dispatcher run`` sends ``--tasks`` x ``--repeats``
rollouts to a simulated multi-turn agent (``sim-agent --turns``: each of its
``--turns`` model calls sends the conversation so far, from a prompt of about
``--prompt-tokens`` that a task's repeats share), whose calls go through the
proxy to ``--replicas`` simulated model servers.

The model of a replica, and why these defaults:

- KV cache: ``--cache-tokens`` 8,000 tokens of prefix cache per replica (LRU over
  16-token blocks, a prompt's tail evicted before its head, as vLLM does). That is
  what an engine has left for cached prefixes beside its running batch: at
  concurrency 64 over 4 replicas, each runs ~16 sequences of ~2,000-2,500 tokens
  (~36k tokens of KV), so a replica with ~45k tokens of KV (a 7-8B model's cache
  on one GPU) keeps about four prompts besides. Eight tasks are live at once
  (64 / 8 repeats): their prompts alone (16k tokens) are twice what one replica
  keeps, so spreading every task over every replica (round robin) thrashes it.
- Prefill: ``--prefill-us`` 50 us per prompt token not cached (20k tokens/s, a
  7-8B model on one GPU), one prefill at a time per replica (compute-bound).
- Decode: ``--decode-ms`` 100 ms per call, calls in parallel (decode is batched;
  ~24 tokens at ~4 ms a step).

Prefill is then a real share of a call: a cold 2,000-token prompt costs 100 ms,
as much as its decode, and it queues behind the replica's other prefills.

Printed per policy, from the model servers' own counts (``/stats``): prefix-token
hit (cached prompt tokens over prompt tokens), prefill work (uncached prompt
tokens) and the job's wall time, each also as a ratio to round robin's; the most
calls one replica took over the mean; the share of calls that carried both
identity headers (X-Session-ID, X-Prefix-Group); the calls the proxy moved off
their pinned replica (past ``--route-margin``); the machine's load average. Goals
(issue 38): group's hit at least 0.85, its prefill at most 0.3x and its time at
most 0.75x round robin's.

Releases: per rollout, from its end as the dispatcher recorded it (its
``rollout_finished`` event) to the proxy forgetting its session (the proxy's
``session_released`` event): the share within 1 s (a rollout never released counts
as late), p50, p99 and the longest; beside it, the same up to the upstream hearing
of it (``--session-release-url``, served by this bench: one more hop, through this
process). ``--wide-replicas N`` adds a group run on N replicas for the balance of
calls; ``--slow-factor F`` a group run whose replica 0 is F times slower. For each
run, the calls in flight on the slow replica (or the busiest one) above the others'
mean, sampled from the proxy's ``GET /ng-metrics``: the busiest of a run without a
slow replica is what group placement itself leaves (a group's repeats together).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dispatcher.latency.quantile import quantile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dispatcher_server, run_child
from _routing_watch import (
    Releases,
    in_flight_sampler,
    release_delays,
    release_listener,
    released_at_proxy,
)

POLICIES = ("round_robin", "session", "group")


@dataclass
class Figures:
    policy: str
    replicas: int
    wall_s: float
    prompt_tokens: int
    cached_tokens: int
    calls: list[int]
    with_identity: int
    # Per rollout, from its end as the dispatcher recorded it (rollout_finished) to the
    # proxy forgetting its session (the proxy's session_released), and to the upstream
    # hearing of it (--session-release-url); inf: never.
    release_delays: list[float]
    told_delays: list[float]
    # Calls in flight per upstream, sampled through the run (the proxy's /ng-metrics).
    in_flight: list[list[float]]
    slow: bool = False
    # Calls sent away from their pinned upstream, past the margin (the proxy's count).
    passed_over: int = 0
    # The machine's load average (1 minute) as the run ended: a starved machine's
    # figures are the machine's, not the policy's.
    load: float = 0.0

    @property
    def hit(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)

    @property
    def prefill(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def rollouts(self) -> int:
        return len(self.release_delays)

    def leads(self) -> list[float]:
        """Per sample, the calls in flight on upstream 0 (the slow one) or on the busiest
        above the others' mean, ascending."""
        leads = []
        for sample in self.in_flight:
            if len(sample) > 1:
                top = 0 if self.slow else max(range(len(sample)), key=sample.__getitem__)
                others = sample[:top] + sample[top + 1 :]
                leads.append(sample[top] - sum(others) / len(others))
        return sorted(leads)

    @property
    def balance(self) -> float:
        return max(self.calls) / (sum(self.calls) / len(self.calls))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--tasks", type=int, default=64)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--cache-tokens", type=int, default=8_000, help="per replica")
    p.add_argument("--prefill-us", type=float, default=50.0, help="per uncached prompt token")
    p.add_argument("--decode-ms", type=float, default=100.0, help="per call, calls in parallel")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--wide-replicas", type=int, default=16, help="0: no wide run")
    p.add_argument(
        "--slow-factor",
        type=float,
        default=4.0,
        help="a group run with replica 0 this much slower (decode and prefill); 0: none",
    )
    p.add_argument("--route-margin", type=int, default=4, help="the proxy's --route-margin")
    p.add_argument("--start-order", help="dispatcher run --start-order (default: its own)")
    p.add_argument("--keep", type=Path, help="keep each run's files (logs, captures) here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: does it run")
    args = p.parse_args()
    if args.smoke:
        args.tasks, args.repeats, args.turns, args.prompt_tokens = 4, 2, 2, 200
        args.wide_replicas, args.slow_factor = 0, 0.0
    return args


def model_args(args: argparse.Namespace, slower: float = 1.0) -> tuple[str, ...]:
    return (
        "sim-model", "--prefix-cache-tokens", str(args.cache_tokens),
        "--prefill-us-per-token", str(args.prefill_us * slower), "--cached-tokens", "0",
        "--completion-tokens", "24", "--reasoning-tokens", "0",
        "--latency-ms", str(args.decode_ms * slower),
    )  # fmt: skip


@contextlib.contextmanager
def servers(
    args: argparse.Namespace, policy: str, replicas: int, out: Path, release_url: str, slow: bool
) -> Iterator[tuple[str, str, list[str]]]:
    """The model replicas (the first ``--slow-factor`` slower if ``slow``), the proxy in
    front of them (its captures and its log in ``out``) and the agent; the agent's URL,
    the proxy's and the replicas'."""
    with contextlib.ExitStack() as stack:
        models = [
            stack.enter_context(dispatcher_server(*model_args(args, slower)))
            for slower in [args.slow_factor if slow else 1.0] + [1.0] * (replicas - 1)
        ]
        upstreams = [flag for url in models for flag in ("--upstream", url)]
        proxy_args = (
            "capture-proxy", *upstreams, "--route", policy, "--capture-dir",
            str(out / "captures"), "--session-release-url", release_url,
            "--route-margin", str(args.route_margin),
        )  # fmt: skip
        proxy = stack.enter_context(dispatcher_server(*proxy_args, log=out / "proxy.log"))
        agent_args = (
            "sim-agent", "--model-url", proxy, "--model-calls", str(args.turns), "--turns",
            "--prompt-tokens", str(args.prompt_tokens), "--reward-p", "1",
        )  # fmt: skip
        agent = stack.enter_context(dispatcher_server(*agent_args))
        yield agent, proxy, models


def run_command(
    args: argparse.Namespace, tasks: Path, out: Path, agent: str, proxy: str
) -> list[str]:
    """``dispatcher run`` of the job: ``tasks`` to ``out``, its model calls through ``proxy``."""
    return [
        sys.executable, "-m", "dispatcher", "run", "--input", str(tasks),
        "--output", str(out / "rollouts.jsonl"), "--agent", f"sim={agent}",
        "--default-agent", "sim", "--num-repeats", str(args.repeats),
        "--concurrency", str(args.concurrency), "--capture-dir", str(out / "captures"),
        "--capture-proxy-url", proxy, "--fsync", "never", "--metrics-listen", "off",
        "--log-format", "json",
        *(("--start-order", args.start_order) if args.start_order else ()),
    ]  # fmt: skip


def one_run(
    args: argparse.Namespace, policy: str, replicas: int, work: Path, slow: bool = False
) -> Figures:
    out = work / f"{policy}-{replicas}{'-slow' if slow else ''}"
    out.mkdir()
    tasks = out / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"responses_create_params": {"input": f"task {i}"}}) + "\n"
            for i in range(args.tasks)
        )
    )
    with contextlib.ExitStack() as stack:
        release_url, releases = stack.enter_context(release_listener())
        agent, proxy, models = stack.enter_context(
            servers(args, policy, replicas, out, release_url, slow)
        )
        in_flight = stack.enter_context(in_flight_sampler(proxy))
        run = run_child(run_command(args, tasks, out, agent, proxy), out / "run.log")
        if run.returncode != 0:
            raise SystemExit(f"{policy}: dispatcher run exited {run.returncode}: see {out}/run.log")
        stats = [_stats(url) for url in models]
        passed_over = _passed_over(proxy)
        finished = run.events("rollout_finished")
        _wait_for_releases(releases, len(finished))
    # Read once the proxy stopped: its log is whole.
    delays = release_delays(released_at_proxy(out / "proxy.log"), finished)
    told = release_delays(releases.at, finished)
    return Figures(
        policy=policy,
        replicas=replicas,
        wall_s=run.wall_s,
        prompt_tokens=sum(s["prompt_tokens"] for s in stats),
        cached_tokens=sum(s["cached_tokens"] for s in stats),
        calls=[s["requests"] for s in stats],
        with_identity=sum(s["with_identity"] for s in stats),
        release_delays=delays,
        told_delays=told,
        in_flight=in_flight,
        slow=slow,
        passed_over=passed_over,
        load=os.getloadavg()[0],
    )


def _wait_for_releases(releases: Releases, count: int) -> None:
    """Waits (a second at most) for the upstream to hear of the last releases."""
    deadline = time.monotonic() + 1.0
    while len(releases.at) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def _passed_over(proxy: str) -> int:
    with urllib.request.urlopen(f"{proxy}/ng-metrics", timeout=30) as answer:
        text = answer.read().decode()
    name = "dispatcher_capture_upstream_calls_passed_over_total"
    return sum(
        int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines() if line.startswith(name)
    )


def _stats(url: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{url}/stats", timeout=30) as answer:
        stats: dict[str, int] = json.loads(answer.read())
        return stats


def report(args: argparse.Namespace, figures: list[Figures]) -> None:
    base = next((f for f in figures if f.policy == "round_robin"), figures[0])
    print(
        f"{'policy':<14} {'replicas':>8} {'hit':>6} {'hit/rr':>7} {'prefill tok':>12} "
        f"{'prefill/rr':>10} {'wall s':>7} {'wall/rr':>8} {'max/mean calls':>14} "
        f"{'headers':>8} {'moved':>6} {'load':>5}"
    )
    for f in figures:
        headers = f.with_identity / max(1, sum(f.calls))
        name = f"{f.policy}{' slow' if f.slow else ''}"
        print(
            f"{name:<14} {f.replicas:>8} {f.hit:>6.3f} {f.hit / max(base.hit, 1e-9):>7.2f} "
            f"{f.prefill:>12,} {f.prefill / max(base.prefill, 1):>10.2f} {f.wall_s:>7.2f} "
            f"{f.wall_s / base.wall_s:>8.2f} {f.balance:>14.2f} {headers:>8.1%} "
            f"{f.passed_over:>6} {f.load:>5.1f}"
        )
    print(
        "sessions released, from the rollout's end as the dispatcher recorded it "
        "(rollout_finished) to the proxy forgetting it (session_released), and to the "
        "upstream hearing of it (--session-release-url):"
    )
    for f in figures:
        name = f"{f.policy}{' slow' if f.slow else ''} on {f.replicas}"
        released, told = _release_figures(f.release_delays), _release_figures(f.told_delays)
        print(f"  {name:<20} {released}; told {told}")
    print(
        f"calls in flight above the others' mean (margin {args.route_margin}), on the slow "
        "replica (slow runs) or the busiest one, sampled from the proxy's /ng-metrics:"
    )
    for f in figures:
        leads = f.leads()
        mean = sum(leads) / max(1, len(leads))
        within = sum(lead <= args.route_margin for lead in leads) / max(1, len(leads))
        p50, p99 = (quantile(leads, q) or 0.0 for q in (0.5, 0.99))
        share = f" its share of calls {f.calls[0] / sum(f.calls):.1%}" if f.slow else ""
        print(
            f"  {f.policy}{' slow' if f.slow else ''} on {f.replicas:<8} mean {mean:.2f}, "
            f"p50 {p50:.1f}, p99 {p99:.1f}, max {max(leads, default=0.0):.1f}; "
            f"{within:.1%} of {len(leads)} samples within the margin;{share}"
        )


def _release_figures(delays: list[float]) -> str:
    ordered = sorted(delays)
    within = sum(d <= 1.0 for d in ordered) / max(1, len(ordered))
    p50, p99 = (quantile(ordered, q) or 0.0 for q in (0.5, 0.99))
    return (
        f"{within:.1%} <= 1 s of {len(ordered)}, p50 {p50:.3f} s, p99 {p99:.3f} s, "
        f"max {max(ordered, default=0.0):.3f} s"
    )


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        print(
            f"{args.tasks} tasks x {args.repeats} repeats x {args.turns} turns, prompts of "
            f"~{args.prompt_tokens} tokens; {args.replicas} replicas, each with "
            f"{args.cache_tokens:,} tokens of prefix cache (LRU, 16-token blocks), prefill "
            f"{args.prefill_us:g} us per uncached token (one at a time), decode "
            f"{args.decode_ms:g} ms per call (calls in parallel); concurrency {args.concurrency}"
        )
        figures = [one_run(args, p, args.replicas, work) for p in args.policies.split(",")]
        if args.wide_replicas:
            figures.append(one_run(args, "group", args.wide_replicas, work))
        if args.slow_factor:
            figures.append(one_run(args, "group", args.replicas, work, slow=True))
        report(args, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
