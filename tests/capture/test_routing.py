"""The capture proxy routes a rollout's calls by its identity (capture/routing.py): the
rules on a router alone, and through real sockets with several upstreams."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from dispatcher.capture.proxy import UPSTREAM_KEY, build_proxy_app
from dispatcher.capture.routing import RoutePolicy, Router, group_of
from dispatcher.delivery.limits import ProxyLimits
from dispatcher.sim.dialects import SimModelConfig
from dispatcher.sim.model import build_sim_model_app
from dispatcher.tasks.keys import ATTEMPT_INDEX, rollout_id_for
from tests.capture.test_proxy import Servers, capture_lines, post_chat, servers, session
from tests.conftest import SimAgentFactory
from tests.helpers import free_port, run_args, run_cli, spawn_cli, wait_until, write_tasks
from tests.serve.test_service_e2e import Serve, rows

__all__ = ["servers", "session"]  # the fixtures, imported for these tests

# ---- the rules ------------------------------------------------------------------------


def test_the_group_of_a_rollout_is_its_task_within_its_hop() -> None:
    assert group_of("3-0") == group_of("3-7") == group_of("3-1-a2") == "t3"
    assert group_of("3-1.0a1b2c3d") == group_of("3-5-a1.0a1b2c3d") == "t3.0a1b2c3d"
    assert group_of("3-1.0a1b2c3d") != group_of("3-1.ffffffff")  # another hop or job
    assert group_of("my-own-id") == "my-own-id"  # names no siblings


def test_session_pins_a_rollouts_calls_and_starts_it_on_the_least_loaded() -> None:
    router = Router(["a", "b", "c"], RoutePolicy.SESSION)
    first = [router.pick(f"{task}-0") for task in range(3)]
    assert sorted(first) == [0, 1, 2]  # fewest live sessions first
    assert [router.pick(f"{task}-0") for task in range(3)] == first
    assert router.release("1-0") == "1-0" and router.release("1-0") is None
    assert router.pick("9-0") == first[1]  # the released one's upstream is the lightest


def test_group_keeps_siblings_together_until_the_margin_is_passed() -> None:
    router = Router(["a", "b"], RoutePolicy.GROUP, margin=2)
    home = router.pick("5-0")
    assert {router.pick(f"5-{i}") for i in range(1, 4)} == {home}
    for _ in range(3):  # 3 calls in flight at home, 0 elsewhere: past the margin of 2
        router.started(home)
    moved = router.pick("5-4")
    assert moved != home
    assert router.pick("5-1") == moved  # a session already started moves too, and stays
    assert router.pick("5-1") == moved  # where its conversation is now cached
    assert router.upstreams[home].passed_over == 2
    for _ in range(3):  # home is no longer loaded: the next sibling goes home again,
        router.ended(home)  # where the group's prefix is cached
    assert router.pick("5-5") == home


def test_the_margin_is_counted_from_the_least_loaded_upstream() -> None:
    router = Router(["a", "b", "c", "d"], RoutePolicy.SESSION, margin=4)
    home = router.pick("1-0")
    for index, calls in enumerate([6, 6, 6, 6]):
        for _ in range(calls):
            router.started(index)
    router.ended(
        (home + 1) % 4,
    )
    assert router.pick("1-0") == home  # 6 is not above the least loaded (5) + 4
    for _ in range(4):
        router.started(home)
    assert router.pick("1-0") != home  # 10 is


def test_idle_upstreams_take_new_rollouts_in_turn_not_the_first_one_always() -> None:
    router = Router(["a", "b", "c"], RoutePolicy.GROUP)
    homes = []
    for task in range(6):  # one rollout at a time: every upstream is idle at each pick
        homes.append(router.pick(f"{task}-0"))
        router.started(homes[-1])
        router.ended(homes[-1])
        router.release(f"{task}-0")
    assert homes == [0, 1, 2, 0, 1, 2]


def test_round_robin_is_per_call() -> None:
    router = Router(["a", "b", "c"], RoutePolicy.ROUND_ROBIN)
    assert [router.pick("1-0") for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_sessions_and_groups_stay_bounded() -> None:
    router = Router(["a", "b"], RoutePolicy.GROUP, max_sessions=10, max_groups=5)
    for task in range(1000):
        router.pick(f"{task}-0")
    assert router.live_sessions == 10
    assert sum(u.sessions for u in router.upstreams) == 10


# ---- through real sockets -------------------------------------------------------------


class Upstreams:
    """Model servers that answer a chat completion and note each call's headers."""

    def __init__(self, servers: Servers) -> None:
        self.servers = servers
        self.calls: list[tuple[int, dict[str, str]]] = []

    async def start(self, count: int) -> list[str]:
        return [await self.servers.start(self._app(index)) for index in range(count)]

    def _app(self, index: int) -> web.Application:
        async def handle(request: web.Request) -> web.StreamResponse:
            await request.read()
            self.calls.append((index, dict(request.headers)))
            answer = {"id": f"c{len(self.calls)}", "object": "chat.completion", "choices": []}
            return web.json_response(answer)

        app = web.Application()
        app.router.add_post("/{tail:.*}", handle)
        return app


class GatedUpstreams(Upstreams):
    """Upstream 0 holds every call until its gate opens (a replica far slower than the
    rest); it counts the calls it holds."""

    def __init__(self, servers: Servers) -> None:
        super().__init__(servers)
        self.gate = servers.gate()
        self.held = 0
        self.most_held = 0

    def _app(self, index: int) -> web.Application:
        app = super()._app(index)
        if index != 0:
            return app

        async def held(request: web.Request, handler: Any) -> web.StreamResponse:
            self.held += 1
            self.most_held = max(self.most_held, self.held)
            try:
                await self.gate.wait()
                response: web.StreamResponse = await handler(request)
                return response
            finally:
                self.held -= 1

        app.middlewares.append(web.middleware(held))
        return app


async def call(session: aiohttp.ClientSession, proxy: str, rollout_id: str, **kw: Any) -> None:
    url = f"{proxy}/ng-rollout/{rollout_id}/v1/chat/completions"
    async with post_chat(session, url, **kw) as answer:
        assert answer.status == 200, await answer.text()


async def test_a_groups_rollouts_and_their_turns_reach_one_upstream_with_both_headers(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    upstreams = Upstreams(servers)
    proxy = await servers.start(build_proxy_app(await upstreams.start(3), tmp_path))
    token = ".0a1b2c3d"
    spoofed = {"X-Session-ID": "not-mine", "X-Prefix-Group": "not-mine"}
    for _turn in range(3):
        for task in range(4):
            for repeat in range(4):
                await call(session, proxy, f"{task}-{repeat}{token}", headers=spoofed)
    by_group: dict[str, set[int]] = {}
    for index, headers in upstreams.calls:
        by_group.setdefault(headers["X-Prefix-Group"], set()).add(index)
        assert headers["X-Session-ID"].endswith(token)  # the proxy's, not the agent's
    assert sorted(by_group) == [f"t{task}{token}" for task in range(4)]
    assert all(len(indexes) == 1 for indexes in by_group.values())
    # Load-aware: the four groups did not all land on one upstream.
    assert len({next(iter(i)) for i in by_group.values()}) > 1


async def test_a_call_that_cannot_connect_fails_over_and_the_pin_moves(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    upstreams = Upstreams(servers)
    [live] = await upstreams.start(1)
    dead = f"http://127.0.0.1:{free_port()}"
    app = build_proxy_app([dead, live], tmp_path, route=RoutePolicy.SESSION)
    proxy = await servers.start(app)
    for _ in range(3):
        await call(session, proxy, "7-0")
    assert [index for index, _ in upstreams.calls] == [0, 0, 0]
    await wait_until(lambda: len(capture_lines(tmp_path, "7-0")) == 3)  # written behind
    records = capture_lines(tmp_path, "7-0")
    assert [r["upstream"] for r in records] == [live] * 3
    assert [r["error_category"] for r in records] == [None] * 3


async def test_release_forgets_a_session_and_tells_the_upstream_once(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    upstreams = Upstreams(servers)
    told: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def on_release(request: web.Request) -> web.Response:
        await told.put(await request.json())
        return web.json_response({})

    release_app = web.Application()
    release_app.router.add_post("/release", on_release)
    release_url = await servers.start(release_app) + "/release"
    app = build_proxy_app(await upstreams.start(2), tmp_path, release_url=release_url)
    proxy = await servers.start(app)
    await call(session, proxy, "1-0")
    for expected in (True, False):  # a second release is an unknown session: harmless
        async with session.post(f"{proxy}/ng-release/1-0") as answer:
            assert answer.status == 200
            assert await answer.json() == {"session_id": "1-0", "released": expected}
    assert await asyncio.wait_for(told.get(), 10) == {"session_id": "1-0"}
    assert told.empty()


async def test_several_sessions_are_released_in_one_call(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    spy = ReleaseSpy()
    proxy, router = await routed_stack(servers, tmp_path, spy)
    for task in range(3):
        await call(session, proxy, f"{task}-0")
    body = {"session_ids": ["0-0", "2-0", "9-0"]}  # 9-0: unknown, harmless
    async with session.post(f"{proxy}/ng-release", json=body) as answer:
        assert await answer.json() == {"released": 2, "unknown": 1}
    assert router.live_sessions == 1
    await wait_until(lambda: sorted(spy.released) == ["0-0", "2-0"])
    for bad in ({"session_ids": "0-0"}, {"ids": []}, {"session_ids": ["../x"]}, [1]):
        async with session.post(f"{proxy}/ng-release", json=bad) as answer:
            assert answer.status == 400
            assert "session_ids" in (await answer.json())["error"]["message"]
    assert router.live_sessions == 1


async def test_a_release_is_answered_while_every_call_slot_is_taken(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    # A release must not queue behind model calls: a proxy at --max-concurrency would
    # otherwise keep a rollout's session (and its upstream's) until some call ended.
    upstreams = GatedUpstreams(servers)
    limits = ProxyLimits(max_concurrency=1)
    app = build_proxy_app(await upstreams.start(1), tmp_path, limits=limits)
    proxy = await servers.start(app)
    held = asyncio.create_task(call(session, proxy, "1-0"))
    await wait_until(lambda: upstreams.held == 1)  # the one slot is taken
    answer = await asyncio.wait_for(session.post(f"{proxy}/ng-release/1-0"), 30)
    async with answer:
        assert await answer.json() == {"session_id": "1-0", "released": True}
    async with session.get(f"{proxy}/ng-metrics") as metrics:  # nor do the metrics
        assert metrics.status == 200
    assert upstreams.held == 1 and not held.done()
    upstreams.gate.set()
    await held


# ---- the dispatcher releases each rollout's session when it ends ----------------------


class ReleaseSpy:
    """The proxy's --session-release-url: the sessions it was told of, in order."""

    def __init__(self) -> None:
        self.released: list[str] = []

    async def start(self, servers: Servers) -> str:
        async def on_release(request: web.Request) -> web.Response:
            self.released.append((await request.json())["session_id"])
            return web.json_response({})

        app = web.Application()
        app.router.add_post("/release", on_release)
        return await servers.start(app) + "/release"


async def routed_stack(
    servers: Servers, tmp_path: Path, spy: ReleaseSpy, error_rate: float = 0.0
) -> tuple[str, Any]:
    """Two sim models behind a routing proxy that tells ``spy`` of each release."""
    config = SimModelConfig(error_rate=error_rate, seed=3)
    models = [await servers.start(build_sim_model_app(config)) for _ in range(2)]
    app = build_proxy_app(models, tmp_path / "captures", release_url=await spy.start(servers))
    return await servers.start(app), app[UPSTREAM_KEY].router


async def test_a_run_releases_every_rollouts_session_as_it_ends(
    servers: Servers, tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    spy = ReleaseSpy()
    proxy, router = await routed_stack(servers, tmp_path, spy)
    agent_url, _ = await sim_agent(model_url=proxy, model_calls=2, reward_p=1.0)
    tasks = write_tasks(tmp_path / "tasks.jsonl", 5)
    args = run_args(tasks, tmp_path / "out" / "x.jsonl", agent_url, "--num-repeats", "2")
    args += ["--capture-dir", str(tmp_path / "captures"), "--capture-proxy-url", proxy]
    result = await run_cli(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = {f"{task}-{repeat}" for task in range(5) for repeat in range(2)}
    await wait_until(lambda: len(spy.released) == len(expected))
    assert set(spy.released) == expected
    assert router.live_sessions == 0


async def test_a_served_job_releases_its_rollouts_sessions_failed_ones_too(
    servers: Servers, tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    spy = ReleaseSpy()
    # Half the model calls fail: their agents answer 500 (agent_run_error), after a call.
    proxy, router = await routed_stack(servers, tmp_path, spy, error_rate=0.5)
    agent_url, _ = await sim_agent(model_url=proxy, model_calls=1)
    serve = await Serve.start(
        tmp_path / "state", agent_url, "--capture-proxy-url", proxy, "--max-attempts", "1"
    )
    try:
        await serve.submit(job_id="j", rows=rows(6))
        assert (await serve.results("j", wait=True))[-1]["end"] in ("done", "failed")
    finally:
        await serve.stop()
    await wait_until(lambda: len(spy.released) == 6)
    assert sorted(spy.released) == [f"{task}-0" for task in range(6)]
    assert router.live_sessions == 0


async def test_a_groups_repeats_stay_together_on_a_slow_upstream(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    # A group's own calls are no load against its siblings: one group on an upstream is
    # the rule at work, not a pile-up (other groups' calls are: the test below).
    upstreams = GatedUpstreams(servers)
    app = build_proxy_app(await upstreams.start(2), tmp_path, route_margin=2)
    proxy = await servers.start(app)
    held = []
    for repeat in range(8):  # one group; its first call pins it to upstream 0, the slow one
        held.append(asyncio.create_task(call(session, proxy, f"5-{repeat}")))
        await wait_until(lambda r=repeat: upstreams.held == r + 1)
    assert upstreams.calls == []  # none went to upstream 1
    upstreams.gate.set()
    await asyncio.gather(*held)
    assert [index for index, _ in upstreams.calls] == [0] * 8


class GatedModels:
    """Simulated model servers; the first holds the calls it gets while ``slow`` is set
    (a replica that slowed down after rollouts were pinned to it), counting them."""

    def __init__(self, servers: Servers) -> None:
        self.servers = servers
        self.slow = asyncio.Event()
        self.go = servers.gate()
        self.held = self.most_held = 0
        self.answered = [0, 0]

    async def start(self) -> list[str]:
        return [await self.servers.start(self._app(index)) for index in range(2)]

    def _app(self, index: int) -> web.Application:
        app = build_sim_model_app(SimModelConfig(seed=index))

        async def counted(request: web.Request, handler: Any) -> web.StreamResponse:
            if index == 0 and self.slow.is_set():
                self.held += 1
                self.most_held = max(self.most_held, self.held)
                try:
                    await self.go.wait()
                finally:
                    self.held -= 1
            response: web.StreamResponse = await handler(request)
            self.answered[index] += 1
            return response

        app.middlewares.append(web.middleware(counted))
        return app


@pytest.mark.parametrize("policy", [RoutePolicy.GROUP, RoutePolicy.SESSION])
async def test_rollouts_pinned_to_a_replica_that_slowed_move_past_the_margin(
    servers: Servers, session: aiohttp.ClientSession, tmp_path: Path, policy: RoutePolicy
) -> None:
    models = GatedModels(servers)
    margin = 2
    app = build_proxy_app(await models.start(), tmp_path, route=policy, route_margin=margin)
    proxy = await servers.start(app)
    router = app[UPSTREAM_KEY].router
    rollouts = [f"{task}-0" for task in range(16)]  # 16 tasks, 16 groups
    for rollout in rollouts:  # the first turns, placed in turn: every other one on 0
        await call(session, proxy, rollout)
    assert models.answered == [8, 8]
    models.slow.set()
    held: list[asyncio.Task[None]] = []
    for rollout in rollouts:  # the second turns, each held at 0 or answered by 1 in turn
        before = models.held
        task = asyncio.create_task(call(session, proxy, rollout))
        held.append(task)
        await wait_until(
            lambda b=before, t=task: (
                models.held > b or (t.done() and not router.upstreams[1].in_flight)
            )
        )
    # Level with the other upstream, then the margin; the rest went to the other one.
    moved = 8 - margin - 1
    assert models.most_held == margin + 1
    assert models.answered == [8, 16 + moved]
    assert router.upstreams[0].passed_over == moved
    models.go.set()
    await asyncio.gather(*held)
    for rollout in rollouts:  # the moved ones stay where their conversation is now
        await call(session, proxy, rollout)
    assert models.answered == [8 + 2 * (margin + 1), 16 + moved + 8 + moved]


class HoldingAgent:
    """An agent that makes one model call through the proxy for its rollout, then holds
    the rollout until the test ends: its session is live when the dispatcher ends it."""

    def __init__(self, servers: Servers, proxy: str) -> None:
        self.servers, self.proxy = servers, proxy
        self.gate = servers.gate()

    async def start(self) -> str:
        async def run(request: web.Request) -> web.Response:
            row = await request.json()
            rollout_id = rollout_id_for(row, int(row.get(ATTEMPT_INDEX, 0)))
            async with aiohttp.ClientSession() as client:
                await call(client, self.proxy, rollout_id)
            await self.gate.wait()
            return web.json_response({"reward": 1.0})

        app = web.Application()
        app.router.add_post("/run", run)
        return await self.servers.start(app)


async def test_a_cancelled_jobs_rollouts_release_their_sessions(
    servers: Servers, tmp_path: Path
) -> None:
    spy = ReleaseSpy()
    proxy, router = await routed_stack(servers, tmp_path, spy)
    agent_url = await HoldingAgent(servers, proxy).start()
    serve = await Serve.start(tmp_path / "state", agent_url, "--capture-proxy-url", proxy)
    try:
        await serve.submit(job_id="j", rows=rows(3))
        await wait_until(lambda: router.live_sessions == 3)  # each made its call, held
        async with serve.http.delete(f"{serve.url}/v1/jobs/j") as answer:
            assert answer.status < 300, await answer.text()
        await wait_until(lambda: len(spy.released) == 3)
    finally:
        await serve.stop()
    assert sorted(spy.released) == [f"{task}-0" for task in range(3)]
    assert router.live_sessions == 0


async def test_a_drained_runs_rollouts_release_their_sessions(
    servers: Servers, tmp_path: Path
) -> None:
    spy = ReleaseSpy()
    proxy, router = await routed_stack(servers, tmp_path, spy)
    agent_url = await HoldingAgent(servers, proxy).start()
    tasks = write_tasks(tmp_path / "tasks.jsonl", 3)
    args = run_args(tasks, tmp_path / "out" / "x.jsonl", agent_url, "--shutdown-grace-s", "0")
    run = await spawn_cli(*args, "--capture-proxy-url", proxy)
    try:
        await wait_until(lambda: router.live_sessions == 3, timeout_s=60)
        run.send_signal(signal.SIGTERM)  # drain: no grace, the held rollouts are cut
        result = await run.wait()
    finally:
        await run.kill()
    assert result.returncode == 75, result.stderr[-3000:]  # left for a rerun
    await wait_until(lambda: len(spy.released) == 3)
    assert sorted(spy.released) == [f"{task}-0" for task in range(3)]
    assert router.live_sessions == 0


async def test_a_restarted_proxy_answers_releases_of_sessions_it_never_saw(
    servers: Servers, tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    # The run's rollouts called one proxy; the proxy it releases to is a fresh one (a
    # restart): every release is an unknown session, and the run is no worse for it.
    spy = ReleaseSpy()
    first, _ = await routed_stack(servers, tmp_path, spy)
    restarted, router = await routed_stack(servers, tmp_path, spy)
    agent_url, _ = await sim_agent(model_url=first, model_calls=1, reward_p=1.0)
    tasks = write_tasks(tmp_path / "tasks.jsonl", 4)
    args = run_args(tasks, tmp_path / "out" / "x.jsonl", agent_url)
    result = await run_cli(*args, "--capture-proxy-url", restarted)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "session_release_failed" not in result.stderr
    assert spy.released == [] and router.live_sessions == 0
