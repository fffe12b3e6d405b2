"""The Gym drop-in on a real stack: ``dispatcher serve --gym-head-server`` in front of
Gym's own agents, and Gym's simple_agent asked directly for comparison."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from dispatcher.client.gym import DISPATCHER_KEYS, RolloutCollectionHelper
from tests.gym.conftest import LISTENING, GymStack, dispatcher_cmd, start, wait_for

# What differs between two answers of the same model to the same request: the
# ids and clocks that the model servers make up for each answer.
MINTED_KEYS = frozenset({"id", "created", "created_at", "response_id", "started_at"})


def head_server(stack: GymStack) -> str:
    return f"127.0.0.1:{stack.head_port}"


@contextmanager
def served(stack: GymStack, state_dir: Path) -> Iterator[str]:
    """``dispatcher serve`` with the stack's agents from its head server; its URL."""
    args = ["serve", "--listen", "127.0.0.1:0", "--state-dir", str(state_dir)]
    args += ["--gym-head-server", head_server(stack), "--log-format", "json"]
    state_dir.mkdir(parents=True)
    daemon = start(dispatcher_cmd(*args), state_dir / "serve.log", state_dir)
    try:
        yield wait_for(daemon, LISTENING, 60).group(1)
    finally:
        daemon.stop()


async def collect(url: str, examples: list[dict[str, Any]]) -> list[tuple[dict, dict]]:
    """What a trainer's loop does with Gym's API, on the dispatcher."""
    pairs = []
    for future in RolloutCollectionHelper(url).run_examples(examples):
        pairs.append(await future)
    return pairs


async def ask_directly(run_url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The agent's own ``/run`` answer to each body, as Gym's collector would get it."""
    async with aiohttp.ClientSession() as session:

        async def one(body: dict[str, Any]) -> dict[str, Any]:
            async with session.post(f"{run_url}/run", json=body) as answer:
                assert answer.status == 200, await answer.text()
                result: dict[str, Any] = await answer.json()
                return result

        return list(await asyncio.gather(*(one(body) for body in bodies)))


def without_dispatcher_keys(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k not in DISPATCHER_KEYS}


def unminted(value: Any) -> Any:
    """``value`` with the per-answer ids and clocks blanked, everywhere in it."""
    if isinstance(value, dict):
        return {k: "<minted>" if k in MINTED_KEYS else unminted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unminted(v) for v in value]
    return value
