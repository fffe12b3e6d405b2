"""A simulated agent server speaking the agent protocol (``POST /run``).

Latency is fixed or lognormal (heavy-tailed: ``--latency-dist
lognormal:MEDIAN_S,SIGMA``), or the task row's own ``sim_latency_s`` in
place of the median (tasks of different lengths); each request can fail as HTTP 500, HTTP 503,
a hang, a malformed body or a kill-shaped answer, with the given
probabilities (drawn per request from a generator seeded by ``--seed``); the
first ``--rate-limit-first`` requests are refused with HTTP 429 and a
``Retry-After`` header. With ``--capacity C`` the agent has a knee: past C
rollouts in flight, latency grows with the cube of the overload (so
throughput falls) and past 1.25·C it answers 429; ``--capacity-then`` and
``--capacity-change-after-s`` change C mid-run.
Latency and reward are drawn from the rollout's identity, so they are the
same on every resume. A reward is 1.0 with probability ``--reward-p``, the
same for every task, or with ``--reward-p task`` a probability of each
task's own (uniform in [0, 1], drawn from the task index): some tasks are
always solved, some never, most in between, as a group filter sees them.
``GET /stats`` reports the requests seen and the most ever in flight at once.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from dispatcher.commands import command_help
from dispatcher.files.contracts import NO_PERSIST
from dispatcher.sim.model_client import agent_trajectory, call_model
from dispatcher.tasks.keys import ATTEMPT_INDEX, ROLLOUT_INDEX, TASK_INDEX, rollout_id_for
from dispatcher.tasks.schema import TRAJECTORY
from dispatcher.telemetry.http_app import serve_until_signal


@dataclass(frozen=True)
class SimAgentConfig:
    latency: str = "fixed"
    latency_s: float = 0.0
    latency_sigma: float = 0.5
    fail_500: float = 0.0
    fail_503: float = 0.0
    hang: float = 0.0
    malformed: float = 0.0
    kill_shaped: float = 0.0
    # A probability, or None: each task has a probability of its own.
    reward_p: float | None = 0.5
    seed: int = 0
    model_url: str | None = None
    model_calls: int = 0
    model_dialect: str = "chat"
    model_stream: bool = False
    agent_trajectory: bool = False
    rate_limit_first: int = 0
    retry_after_s: int = 1
    capacity: int = 0
    capacity_then: int = 0
    capacity_change_after_s: float = 0.0
    row_bytes: int = 0
    # Multi-turn: each model call carries the conversation so far (the task's prompt
    # of about ``prompt_tokens``, then every answer and a user turn after it).
    turns: bool = False
    prompt_tokens: int = 0
    # The agent's own ``usage`` in its response: this many output tokens (0: none).
    output_tokens: int = 0


@dataclass
class SimAgentStats:
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    # The most requests that arrived within any one second.
    max_per_s: int = 0
    _recent: deque[float] = field(default_factory=deque)

    def arrived(self, now: float) -> None:
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        recent = self._recent
        recent.append(now)
        while now - recent[0] >= 1.0:
            recent.popleft()
        self.max_per_s = max(self.max_per_s, len(recent))


_FAILURES = ("fail_500", "fail_503", "hang", "malformed", "kill_shaped")
STATS_KEY = web.AppKey("stats", SimAgentStats)
FAILURE_RNG_KEY = web.AppKey("failure_rng", random.Random)
CONFIG_KEY = web.AppKey("config", SimAgentConfig)
SESSION_KEY = web.AppKey("session", aiohttp.ClientSession)
STARTED_KEY = web.AppKey("started", float)
TASK_LATENCY = "sim_latency_s"
# Past this load (in flight over capacity) the knee model answers 429.
OVERLOAD_429 = 1.25


def _rng_for(config: SimAgentConfig, row: dict[str, Any]) -> random.Random:
    identity = (
        f"{config.seed}:{row.get(TASK_INDEX)}:{row.get(ROLLOUT_INDEX)}:{row.get(ATTEMPT_INDEX, 0)}"
    )
    return random.Random(hashlib.blake2b(identity.encode(), digest_size=8).digest())


def _pick_failure(config: SimAgentConfig, rng: random.Random) -> str | None:
    draw = rng.random()
    for name in _FAILURES:
        draw -= getattr(config, name)
        if draw < 0:
            return name
    return None


def _load_factor(app: web.Application, in_flight: int) -> float:
    """Rollouts in flight over the capacity now (0 without a knee)."""
    config = app[CONFIG_KEY]
    capacity = config.capacity
    if (
        config.capacity_then
        and time.monotonic() - app[STARTED_KEY] >= config.capacity_change_after_s
    ):
        capacity = config.capacity_then
    return in_flight / capacity if capacity > 0 else 0.0


def _latency(config: SimAgentConfig, rng: random.Random, row: dict[str, Any]) -> float:
    # A task row may name its own latency (``sim_latency_s``: the fixed value or the
    # lognormal median), so tasks differ as real ones do while their repeats scatter.
    own = row.get(TASK_LATENCY)
    latency_s = float(own) if isinstance(own, int | float) and own > 0 else config.latency_s
    if config.latency == "lognormal" and latency_s > 0:
        return rng.lognormvariate(math.log(latency_s), config.latency_sigma)
    return latency_s


def _reward_p(config: SimAgentConfig, row: dict[str, Any]) -> float:
    if config.reward_p is not None:
        return config.reward_p
    identity = f"{config.seed}:task:{row.get(TASK_INDEX)}".encode()
    return random.Random(hashlib.blake2b(identity, digest_size=8).digest()).random()


def _result(
    row: dict[str, Any], reward_p: float, rng: random.Random, calls: list[Any]
) -> dict[str, Any]:
    reward = 1.0 if rng.random() < reward_p else 0.0
    return {
        **row,
        "response": {"id": f"sim-{row.get(TASK_INDEX)}", "output_text": "42"},
        "reward": reward,
        "model_calls_made": len(calls),
    }


async def _handle_run(request: web.Request) -> web.StreamResponse:
    stats, config = request.app[STATS_KEY], request.app[CONFIG_KEY]
    stats.arrived(time.monotonic())
    try:
        row = await request.json(loads=orjson.loads)
        if TASK_INDEX not in row:
            # As NeMo Gym's FastAPI agents answer a body that is no run request
            # (the dispatcher's probe): nothing runs.
            return web.json_response({"detail": "not a run request"}, status=422)
        load = _load_factor(request.app, stats.in_flight)
        if stats.requests <= config.rate_limit_first or load > OVERLOAD_429:
            return web.Response(
                status=429, text="rate limited", headers={"Retry-After": str(config.retry_after_s)}
            )
        rng = _rng_for(config, row)
        # Failures are drawn per request, not per rollout: a rollout that was
        # interrupted once is not doomed to be interrupted on every resume.
        failure = _pick_failure(config, request.app[FAILURE_RNG_KEY])
        await asyncio.sleep(_latency(config, rng, row) * max(1.0, load) ** 3)
        return await _answer(request, config, row, rng, failure)
    finally:
        stats.in_flight -= 1


async def _answer(
    request: web.Request,
    config: SimAgentConfig,
    row: dict[str, Any],
    rng: random.Random,
    failure: str | None,
) -> web.StreamResponse:
    if failure == "fail_500":
        return web.Response(status=500, text="simulated agent error")
    if failure == "fail_503":
        return web.Response(status=503, text="simulated overload")
    if failure == "hang":
        await asyncio.Event().wait()
    if failure == "malformed":
        return web.Response(status=200, body=b"{not json", content_type="application/json")
    if failure == "kill_shaped":
        return _json({NO_PERSIST: True, "reason": "simulated preemption"})
    calls = await _call_model(request, config, row)
    result = _result(row, _reward_p(config, row), rng, calls)
    if config.output_tokens > 0:
        result["response"]["usage"] = {"input_tokens": 0, "output_tokens": config.output_tokens}
    if config.agent_trajectory and calls:
        result[TRAJECTORY] = agent_trajectory(
            task_id=row[TASK_INDEX],
            rollout_id=_rollout_id(row),
            responses=calls,
            model_ref="sim-model",
        )
    if config.row_bytes > 0:
        return _json_with_tokens(result, token_logprobs_json(config.row_bytes))
    return _json(result)


async def _call_model(
    request: web.Request, config: SimAgentConfig, row: dict[str, Any]
) -> list[Any]:
    if not config.model_url or config.model_calls <= 0:
        return []
    rollout_id = _rollout_id(row)
    session = request.app[SESSION_KEY]
    if config.turns:
        return await _converse(session, config, rollout_id, task_prompt(row, config))
    return [
        await call_model(
            session,
            config.model_url,
            rollout_id,
            dialect=config.model_dialect,
            stream=config.model_stream,
        )
        for _ in range(config.model_calls)
    ]


async def _converse(
    session: aiohttp.ClientSession, config: SimAgentConfig, rollout_id: str, prompt: str
) -> list[Any]:
    """``model_calls`` turns of one conversation: each call sends it all so far."""
    assert config.model_url is not None
    messages: list[dict[str, str]] = [{"role": "user", "content": prompt}]
    calls = []
    for _ in range(config.model_calls):
        answer = await call_model(
            session,
            config.model_url,
            rollout_id,
            dialect="chat",
            stream=config.model_stream,
            messages=messages,
        )
        calls.append(answer)
        content = str(answer["choices"][0]["message"].get("content") or "")
        messages = [*messages, {"role": "assistant", "content": content}]
        messages.append({"role": "user", "content": f"go on ({len(calls)})"})
    return calls


def task_prompt(row: dict[str, Any], config: SimAgentConfig) -> str:
    """The task's prompt: its input, padded to about ``prompt_tokens`` (4 bytes each) with
    text of its own, so the repeats of one task share it and other tasks do not."""
    text = orjson.dumps(row.get("responses_create_params", {}).get("input", "")).decode()
    pad = f" context of task {row.get(TASK_INDEX)}"
    want = config.prompt_tokens * 4
    return text + pad * max(0, (want - len(text)) // len(pad) + 1) if want else text


def _rollout_id(row: dict[str, Any]) -> str:
    return rollout_id_for(row, int(row.get(ATTEMPT_INDEX, 0)))


# The key of the realistic payload: per generated token, its id and logprob.
TOKENS_KEY = "output_token_logprobs"


@functools.lru_cache(maxsize=4)
def token_logprobs_json(row_bytes: int) -> bytes:
    """A JSON list of ``{token_id, logprob}`` objects of about ``row_bytes`` bytes.

    Made once per size (seeded by it) and reused: the agent's own cost must
    not be what a benchmark of big rows measures.
    """
    rng = random.Random(row_bytes)
    parts: list[bytes] = []
    size = 2
    while size < row_bytes:
        token = {"token_id": rng.randrange(151_936), "logprob": -rng.expovariate(2.0)}
        part = orjson.dumps(token)
        parts.append(part)
        size += len(part) + 1
    return b"[" + b",".join(parts) + b"]"


def _json_with_tokens(result: dict[str, Any], tokens: bytes) -> web.Response:
    # Spliced, not re-serialized: the list is already JSON.
    head = orjson.dumps(result)[:-1]
    sep = b"," if len(head) > 1 else b""
    body = b"".join((head, sep, b'"', TOKENS_KEY.encode(), b'":', tokens, b"}"))
    return web.Response(body=body, content_type="application/json")


def _json(data: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


async def _handle_stats(request: web.Request) -> web.Response:
    stats = request.app[STATS_KEY]
    return _json(
        {
            "requests": stats.requests,
            "in_flight": stats.in_flight,
            "max_in_flight": stats.max_in_flight,
            "max_per_s": stats.max_per_s,
        }
    )


def build_sim_agent_app(config: SimAgentConfig) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[STATS_KEY] = SimAgentStats()
    app[CONFIG_KEY] = config
    app[FAILURE_RNG_KEY] = random.Random(config.seed)
    app[STARTED_KEY] = time.monotonic()
    app.router.add_post("/run", _handle_run)
    app.router.add_get("/stats", _handle_stats)
    app.cleanup_ctx.append(_client_session)
    return app


async def _client_session(app: web.Application) -> Any:
    app[SESSION_KEY] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
    yield
    await app[SESSION_KEY].close()


def latency_dist(text: str) -> dict[str, Any]:
    """``fixed:S`` or ``lognormal:MEDIAN_S,SIGMA`` as config fields (an argparse type)."""
    kind, _, numbers = text.partition(":")
    try:
        values = [float(n) for n in numbers.split(",")] if numbers else []
    except ValueError:
        values = []
    if kind == "fixed" and len(values) == 1 and values[0] >= 0:
        return {"latency": "fixed", "latency_s": values[0]}
    if kind == "lognormal" and len(values) == 2 and values[0] > 0 and values[1] >= 0:
        return {"latency": "lognormal", "latency_s": values[0], "latency_sigma": values[1]}
    raise argparse.ArgumentTypeError(
        f"{text!r}: expected fixed:SECONDS or lognormal:MEDIAN_S,SIGMA (e.g. lognormal:0.25,1)"
    )


def reward_p(text: str) -> float | None:
    """A probability in [0, 1], or ``task`` (None: a probability per task)."""
    if text == "task":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: a probability in [0, 1], or 'task'")
    return value


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("sim-agent", help=command_help("sim-agent"))
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0 = any free port)")
    _add_timing_flags(p)
    _add_answer_flags(p)
    _add_model_flags(p)
    p.set_defaults(handler=_main, is_async=True)


def _add_timing_flags(p: argparse.ArgumentParser) -> None:
    """How long an answer takes, and how the agent behaves under load."""
    p.add_argument("--latency", choices=("fixed", "lognormal"), default="fixed")
    p.add_argument("--latency-s", type=float, default=0.0, help="fixed latency or lognormal median")
    p.add_argument("--latency-sigma", type=float, default=0.5)
    p.add_argument(
        "--latency-dist",
        type=latency_dist,
        metavar="fixed:S|lognormal:MEDIAN_S,SIGMA",
        help="the latency in one flag (heavy-tailed: lognormal with sigma 1 or more)",
    )
    p.add_argument(
        "--rate-limit-first", type=int, default=0, help="answer the first N requests with 429"
    )
    p.add_argument("--retry-after-s", type=int, default=1, help="Retry-After of those 429s")
    p.add_argument(
        "--capacity", type=int, default=0, help="rollouts in flight past which latency climbs"
    )
    p.add_argument("--capacity-then", type=int, default=0, help="the capacity after the change")
    p.add_argument("--capacity-change-after-s", type=float, default=0.0)


def _add_answer_flags(p: argparse.ArgumentParser) -> None:
    """What an answer holds: failures, rewards, its size, its usage."""
    for name in _FAILURES:
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, type=float, default=0.0, help=f"probability of {name}")
    p.add_argument(
        "--reward-p",
        type=reward_p,
        default=0.5,
        help="probability of reward 1.0, or 'task': a probability per task, uniform in [0, 1]",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--row-bytes",
        type=int,
        default=0,
        help=f"answer rows of about N bytes: the task echoed back plus {TOKENS_KEY}, "
        "a list of {token_id, logprob} objects",
    )
    p.add_argument(
        "--agent-trajectory", action="store_true", help="return the agent's own ng_trajectory"
    )
    p.add_argument(
        "--output-tokens",
        type=int,
        default=0,
        metavar="N",
        help="report N output tokens in the response's usage (0: no usage)",
    )


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """The model calls a rollout makes through the capture proxy."""
    p.add_argument("--model-url", help="capture proxy base URL the agent calls the model through")
    p.add_argument("--model-calls", type=int, default=0, help="model calls per rollout")
    p.add_argument("--model-dialect", choices=("chat", "responses", "messages"), default="chat")
    p.add_argument("--model-stream", action="store_true")
    p.add_argument(
        "--turns",
        action="store_true",
        help="the model calls are the turns of one conversation, each sending it all so far "
        "(chat dialect)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="with --turns: the task's prompt padded to about N tokens, shared by its repeats",
    )


async def _main(args: argparse.Namespace) -> int:
    from dispatcher.aio import tune_gc

    # Thousands of requests held open (latency) are thousands of live objects:
    # the default GC thresholds would pause the simulated agent for 100+ ms.
    tune_gc()
    fields = SimAgentConfig.__dataclass_fields__
    values = {k: v for k, v in vars(args).items() if k in fields}
    if args.latency_dist is not None:
        values.update(args.latency_dist)
    config = SimAgentConfig(**values)
    return await serve_until_signal(build_sim_agent_app(config), args.listen, "sim-agent")
