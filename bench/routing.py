"""Model calls routed by the rollout's identity: prefix-cache reuse, prefill work, time.

Each policy of the capture proxy (``--route round_robin|session|group``) runs the
same job in one sitting: ``dispatcher run`` sends ``--tasks`` x ``--repeats``
rollouts to a simulated multi-turn agent (``sim-agent --turns``: each of its
``--turns`` model calls sends the conversation so far, from a prompt of about
``--prompt-tokens`` that a task's repeats share), whose calls go through the
proxy to ``--replicas`` simulated model servers. Each keeps a prefix cache of
``--cache-tokens`` (LRU) and spends ``--prefill-us`` of prefill per prompt token
it did not hold, one prefill at a time, as an engine does.

Printed per policy, from the model servers' own counts (``/stats``): prefix-token
hit (cached prompt tokens over prompt tokens), prefill work (uncached prompt
tokens) and the job's wall time, each also as a ratio to round robin's; the most
calls one replica took over the mean; the share of calls that carried both
identity headers (X-Session-ID, X-Prefix-Group). Goals (issue 38): group's hit
at least 0.85, its prefill at most 0.3x and its time at most 0.75x round robin's.
``--wide-replicas N`` adds a group run on N replicas for the balance of calls.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dispatcher_server, run_child

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

    @property
    def hit(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)

    @property
    def prefill(self) -> int:
        return self.prompt_tokens - self.cached_tokens

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
    p.add_argument("--cache-tokens", type=int, default=20_000, help="per replica")
    p.add_argument("--prefill-us", type=float, default=50.0, help="per uncached prompt token")
    p.add_argument("--decode-ms", type=float, default=100.0, help="per call, calls in parallel")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--wide-replicas", type=int, default=16, help="0: no wide run")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: does it run")
    args = p.parse_args()
    if args.smoke:
        args.tasks, args.repeats, args.turns, args.prompt_tokens = 4, 2, 2, 200
        args.wide_replicas = 0
    return args


@contextlib.contextmanager
def servers(
    args: argparse.Namespace, policy: str, replicas: int, out: Path
) -> Iterator[tuple[str, str, list[str]]]:
    """The model replicas, the proxy in front of them and the agent; the agent's URL, the
    proxy's and the replicas'."""
    model_args = (
        "sim-model", "--prefix-cache-tokens", str(args.cache_tokens),
        "--prefill-us-per-token", str(args.prefill_us), "--cached-tokens", "0",
        "--completion-tokens", "24", "--reasoning-tokens", "0",
        "--latency-ms", str(args.decode_ms),
    )  # fmt: skip
    with contextlib.ExitStack() as stack:
        models = [stack.enter_context(dispatcher_server(*model_args)) for _ in range(replicas)]
        upstreams = [flag for url in models for flag in ("--upstream", url)]
        proxy = stack.enter_context(
            dispatcher_server(
                "capture-proxy", *upstreams, "--route", policy, "--capture-dir", str(out)
            )
        )
        agent_args = (
            "sim-agent", "--model-url", proxy, "--model-calls", str(args.turns), "--turns",
            "--prompt-tokens", str(args.prompt_tokens), "--reward-p", "1",
        )  # fmt: skip
        agent = stack.enter_context(dispatcher_server(*agent_args))
        yield agent, proxy, models


def one_run(args: argparse.Namespace, policy: str, replicas: int, work: Path) -> Figures:
    out = work / f"{policy}-{replicas}"
    out.mkdir()
    tasks = out / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"responses_create_params": {"input": f"task {i}"}}) + "\n"
            for i in range(args.tasks)
        )
    )
    with servers(args, policy, replicas, out / "captures") as (agent, proxy, models):
        command = [
            sys.executable, "-m", "dispatcher", "run", "--input", str(tasks),
            "--output", str(out / "rollouts.jsonl"), "--agent", f"sim={agent}",
            "--default-agent", "sim", "--num-repeats", str(args.repeats),
            "--concurrency", str(args.concurrency), "--capture-dir", str(out / "captures"),
            "--capture-proxy-url", proxy, "--fsync", "never", "--metrics-listen", "off",
            "--log-format", "json",
        ]  # fmt: skip
        run = run_child(command, out / "run.log")
        if run.returncode != 0:
            raise SystemExit(f"{policy}: dispatcher run exited {run.returncode}: see {out}/run.log")
        stats = [_stats(url) for url in models]
    return Figures(
        policy=policy,
        replicas=replicas,
        wall_s=run.wall_s,
        prompt_tokens=sum(s["prompt_tokens"] for s in stats),
        cached_tokens=sum(s["cached_tokens"] for s in stats),
        calls=[s["requests"] for s in stats],
        with_identity=sum(s["with_identity"] for s in stats),
    )


def _stats(url: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{url}/stats", timeout=30) as answer:
        stats: dict[str, int] = json.loads(answer.read())
        return stats


def report(figures: list[Figures]) -> None:
    base = next((f for f in figures if f.policy == "round_robin"), figures[0])
    print(
        f"{'policy':<12} {'replicas':>8} {'hit':>6} {'hit/rr':>7} {'prefill tok':>12} "
        f"{'prefill/rr':>10} {'wall s':>7} {'wall/rr':>8} {'max/mean calls':>14} {'headers':>8}"
    )
    for f in figures:
        headers = f.with_identity / max(1, sum(f.calls))
        print(
            f"{f.policy:<12} {f.replicas:>8} {f.hit:>6.3f} {f.hit / max(base.hit, 1e-9):>7.2f} "
            f"{f.prefill:>12,} {f.prefill / max(base.prefill, 1):>10.2f} {f.wall_s:>7.2f} "
            f"{f.wall_s / base.wall_s:>8.2f} {f.balance:>14.2f} {headers:>8.1%}"
        )


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        work = Path(tmp)
        print(
            f"{args.tasks} tasks x {args.repeats} repeats x {args.turns} turns, prompts of "
            f"~{args.prompt_tokens} tokens, {args.replicas} replicas with {args.cache_tokens:,} "
            f"cached tokens each, prefill {args.prefill_us:g} us/token, concurrency "
            f"{args.concurrency}"
        )
        figures = [one_run(args, p, args.replicas, work) for p in args.policies.split(",")]
        if args.wide_replicas:
            figures.append(one_run(args, "group", args.wide_replicas, work))
        report(figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
