"""``X_aggregate_metrics.json``: the per-agent metrics NeMo Gym's collector writes at the end
of a run, and which ``gym eval compare`` reads.

As in Gym, the numbers come from the agents themselves: each agent's
``POST /aggregate_metrics`` (Gym's agents forward it to their resources server,
which knows what its rewards mean) receives that agent's rows, stripped
(``aggregate_rows.py``), and its answer becomes one entry of the file. An agent
without the endpoint simply has no entry; the file is written only when some
agent answered. A small output's bodies are sent whole, from one pass in
memory; a big one's are streamed from spools beside the output as the body is
sent, and the pass goes on only as far as the bodies being sent need: an
agent that answers before reading its body (a 404 from one that does not
aggregate) spares the rest of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Container,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import structlog

from dispatcher.files.atomic import write_atomic
from dispatcher.run.aggregate_rows import ON_LOOP_BYTES, AgentRows, RowSpools, small_bodies
from dispatcher.tasks.keys import ENVIRONMENT_SERVER

log = structlog.get_logger("dispatcher.aggregate")

JsonObject = dict[str, Any]

SUFFIX = "_aggregate_metrics.json"


def aggregate_metrics_path(output: Path) -> Path:
    """``runs/x.jsonl`` → ``runs/x_aggregate_metrics.json`` (Gym's name for it)."""
    return output.with_name(output.stem + SUFFIX)


async def _streamed(chunks: Iterator[bytes]) -> AsyncGenerator[bytes, None]:
    while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
        yield chunk


def _replicas_to_ask(urls: Sequence[str], last: str | None) -> list[str]:
    # The replica that answered last is alive; a dead or silent one is asked only after it.
    return sorted(urls, key=lambda url: url != last)


def _parsed(answer: bytes) -> JsonObject | None:
    try:
        value = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


class WithoutRoute:
    """The agents that answered 404 or 405 to ``/aggregate_metrics`` lately: a daemon's,
    kept between its jobs, so that an agent without the route is not asked at the
    end of every job (a request and a pass over its rows each time) but once every
    ``ttl_s``. One entry per agent of the settings."""

    def __init__(self, ttl_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._since: dict[str, float] = {}

    def skips(self, agent: str) -> bool:
        since = self._since.get(agent)
        return since is not None and self._clock() - since < self._ttl_s

    def note(self, agent: str) -> None:
        self._since[agent] = self._clock()


@dataclass
class Aggregated:
    """What the agents answered: the file written (None when none did) and the agents
    with an entry in it."""

    path: Path | None
    answered: set[str]

    def states(self, agents: Iterable[str]) -> dict[str, str]:
        """Each agent's aggregation status once the run is complete (contracts §15):
        ``complete`` when the file has its entry, else ``error``."""
        return {agent: "complete" if agent in self.answered else "error" for agent in agents}


async def aggregate_metrics(
    output: Path,
    agents: Mapping[str, Sequence[str]],
    *,
    timeout_s: float = 30.0,
    connect_timeout_s: float = 2.0,
    session: aiohttp.ClientSession | None = None,
    durable: bool = True,
    without: WithoutRoute | None = None,
) -> Aggregated:
    """Ask each agent for its metrics and write the file (its path None when no agent
    answered), and which agents answered. ``session``: the caller's (its connections
    kept between calls), else one of its own; ``durable=False``: the file is written
    without fsync (``write_atomic``). The agents ``without`` remembers are not asked
    (no entry, as when asked), and those that answer 404 or 405 are remembered there."""
    entries: list[JsonObject] = []
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
    without = without or WithoutRoute()
    agents = {name: urls for name, urls in agents.items() if not without.skips(name)}
    if not agents:
        return Aggregated(None, set())
    single = {name for name, urls in agents.items() if len(urls) <= 1}
    async with contextlib.AsyncExitStack() as own:
        if session is None:
            session = await own.enter_async_context(aiohttp.ClientSession())
        small = small_bodies(output, agents, single, ON_LOOP_BYTES)
        if small is None:
            small = await asyncio.to_thread(small_bodies, output, agents, single)
        if small is None:
            await _ask_streamed(session, output, agents, single, timeout, entries, without)
        else:
            for name, (found, body) in sorted(small.items()):
                urls = _replicas_to_ask(agents[name], found.last_replica)
                post = _posting(session, body, timeout)
                metrics = await _first_answer(name, urls, post, without)
                if metrics is not None:
                    entries.append(_entry(name, metrics, found.environment_server))
    if not entries:
        return Aggregated(None, set())
    path = aggregate_metrics_path(output)
    text = orjson.dumps(entries, option=orjson.OPT_INDENT_2)
    await asyncio.to_thread(functools.partial(write_atomic, durable=durable), path, [text])
    names = [e["agent_ref"]["name"] for e in entries]
    log.info("aggregate_metrics_written", path=str(path), agents=names)
    return Aggregated(path, set(names))


async def _ask_streamed(
    session: aiohttp.ClientSession,
    output: Path,
    agents: Mapping[str, Sequence[str]],
    single: Container[str],
    deadlines: aiohttp.ClientTimeout,
    entries: list[JsonObject],
    without: WithoutRoute,
) -> None:
    """The agents' entries of a big output: its rows spooled to files as the bodies
    being sent need them."""
    with contextlib.ExitStack() as spools:
        rows = await asyncio.to_thread(RowSpools, output, spools, single, agents)
        try:
            for name in sorted(agents):
                found = await asyncio.to_thread(rows.rows_of, name)
                if found is None:
                    continue
                if found.track_replica:
                    # The replica that answered last is asked first: known at the end.
                    await asyncio.to_thread(rows.finish)
                urls = _replicas_to_ask(agents[name], found.last_replica)
                post = _streaming(session, found, rows, deadlines)
                metrics = await _first_answer(name, urls, post, without)
                if metrics is not None:
                    # An answer before the whole body was read: its rows may still
                    # name the server.
                    await asyncio.to_thread(rows.finish)
                    entries.append(_entry(name, metrics, found.environment_server))
        finally:
            await asyncio.to_thread(rows.close)


# Posts an agent's body to one replica's URL: its HTTP status and answer.
Post = Callable[[str], Awaitable[tuple[int, bytes]]]


def _posting(session: aiohttp.ClientSession, body: bytes, deadlines: aiohttp.ClientTimeout) -> Post:
    """A whole body, sent with its length."""
    return lambda url: _post(session, f"{url}/aggregate_metrics", body, deadlines)


def _streaming(
    session: aiohttp.ClientSession, found: AgentRows, rows: RowSpools,
    deadlines: aiohttp.ClientTimeout,
) -> Post:  # fmt: skip
    """A spooled body, streamed as the pass goes on."""

    async def post(url: str) -> tuple[int, bytes]:
        async with contextlib.aclosing(_streamed(found.body_chunks(rows))) as body:
            return await _post(session, f"{url}/aggregate_metrics", body, deadlines)

    return post


async def _first_answer(
    name: str, urls: Sequence[str], post: Post, without: WithoutRoute
) -> JsonObject | None:
    """The agent's metrics from the first replica that answers at all; an HTTP answer
    that is not metrics (404 from an agent that does not aggregate, remembered in
    ``without``) ends the search (None)."""
    for url in urls:
        try:
            status, answer = await post(url)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("aggregate_metrics_unavailable", agent=name, replica=url, error=repr(exc))
            continue
        metrics = _parsed(answer) if status < 300 else None
        if metrics is not None:
            return metrics
        # 404/405: an agent that does not aggregate (not a Gym agent); nothing is wrong.
        if status in (404, 405):
            without.note(name)
        level = log.info if status in (404, 405) else log.warning
        level("aggregate_metrics_unavailable", agent=name, http_status=status)
        return None
    return None


async def _post(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes | AsyncIterator[bytes],
    deadlines: aiohttp.ClientTimeout,
) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    async with session.post(url, data=body, headers=headers, timeout=deadlines) as response:
        return response.status, await response.read()


def _entry(name: str, metrics: Mapping[str, Any], server: str | None = None) -> JsonObject:
    """One agent's entry, in the shape of the entries Gym's collector writes (with the
    environment server its rows name, as Gym 0.7.0 names it)."""
    entry: JsonObject = {"agent_ref": {"name": name}}
    if server is not None:
        entry[ENVIRONMENT_SERVER] = server
    for key in ("agent_metrics", "key_metrics"):
        entry[key] = metrics.get(key) or {}
    for key in ("group_level_metrics", "repeat_level_metrics"):
        entry[key] = metrics.get(key) or []
    if metrics.get("perf_summary") is not None:
        entry["perf_summary"] = metrics["perf_summary"]
    return entry
