"""``X_aggregate_metrics.json``: the per-agent metrics NeMo Gym's collector writes at the end
of a run, and which ``gym eval compare`` reads.

As in Gym, the numbers come from the agents themselves: each agent's
``POST /aggregate_metrics`` (Gym's agents forward it to their resources server,
which knows what its rewards mean) receives that agent's rows, stripped of the
heavy keys, and its answer becomes one entry of the file. An agent without the
endpoint simply has no entry; the file is written only when some agent answered.
The rows are read once, from the output file, after every row is durable.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import structlog

from dispatcher.contracts import DISPATCH_KEY
from dispatcher.store import fsync_dir

log = structlog.get_logger("dispatcher.aggregate")

JsonObject = dict[str, Any]

SUFFIX = "_aggregate_metrics.json"
# What Gym's collector leaves out before sending rows to /aggregate_metrics.
_HEAVY_KEYS = (
    "response",
    "responses_create_params",
    "ng_agent_observations",
    "ng_model_call_capture",
    "ng_trajectory",
)


def aggregate_metrics_path(output: Path) -> Path:
    """``runs/x.jsonl`` → ``runs/x_aggregate_metrics.json`` (Gym's name for it)."""
    return output.with_name(output.stem + SUFFIX)


@dataclass
class AgentRows:
    """One agent's rows as /aggregate_metrics takes them, and the replica of its last one."""

    rows: list[JsonObject] = field(default_factory=list)
    last_replica: str | None = None


def rows_by_agent(output: Path) -> dict[str, AgentRows]:
    """Each agent's success rows, stripped (blocking: run it in a thread)."""
    grouped: dict[str, AgentRows] = {}
    with output.open("rb") as lines:
        for line in lines:
            row = _parsed(line)
            agent = row.get("agent_ref") if row else None
            name = agent.get("name") if isinstance(agent, dict) else None
            if row is not None and isinstance(name, str):
                entry = grouped.setdefault(name, AgentRows())
                entry.rows.append(stripped(row))
                entry.last_replica = _replica(row) or entry.last_replica
    return grouped


def _replica(row: Mapping[str, Any]) -> str | None:
    stamp = row.get(DISPATCH_KEY)
    replica = stamp.get("replica") if isinstance(stamp, dict) else None
    return replica if isinstance(replica, str) else None


def _replicas_to_ask(urls: Sequence[str], last: str | None) -> list[str]:
    # The replica that answered last is alive; a dead or silent one is asked only after it.
    return sorted(urls, key=lambda url: url != last)


def _parsed(line: bytes) -> JsonObject | None:
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None  # a torn tail: resume repairs it, metrics skip it
    return value if isinstance(value, dict) else None


def stripped(row: Mapping[str, Any]) -> JsonObject:
    """A row without payloads, keeping the response's usage and incomplete_details."""
    entry = {key: value for key, value in row.items() if key not in _HEAVY_KEYS}
    response = row.get("response")
    if isinstance(response, dict):
        kept = {k: response[k] for k in ("usage", "incomplete_details") if k in response}
        if kept:
            entry["response"] = kept
    return entry


async def write_aggregate_metrics(
    output: Path,
    agents: Mapping[str, Sequence[str]],
    *,
    timeout_s: float = 30.0,
    connect_timeout_s: float = 2.0,
) -> Path | None:
    """Ask each agent for its metrics and write the file; None when no agent answered."""
    grouped = await asyncio.to_thread(rows_by_agent, output)
    entries: list[JsonObject] = []
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for name, found in sorted(grouped.items()):
            entry = await _first_answer(session, name, agents.get(name) or (), found)
            if entry is not None:
                entries.append(entry)
    if not entries:
        return None
    path = aggregate_metrics_path(output)
    await asyncio.to_thread(
        _write_atomically, path, orjson.dumps(entries, option=orjson.OPT_INDENT_2)
    )
    log.info(
        "aggregate_metrics_written",
        path=str(path),
        agents=[e["agent_ref"]["name"] for e in entries],
    )
    return path


async def _first_answer(
    session: aiohttp.ClientSession, name: str, urls: Sequence[str], found: AgentRows
) -> JsonObject | None:
    """The agent's metrics from the first replica that answers at all; an HTTP answer
    that is not metrics (404 from an agent that does not aggregate) ends the search."""
    body = orjson.dumps({"verify_responses": found.rows})
    for url in _replicas_to_ask(urls, found.last_replica):
        try:
            status, answer = await _post(session, f"{url}/aggregate_metrics", body)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("aggregate_metrics_unavailable", agent=name, replica=url, error=repr(exc))
            continue
        metrics = _parsed(answer) if status < 300 else None
        if metrics is not None:
            return _entry(name, metrics)
        # 404/405: an agent that does not aggregate (not a Gym agent); nothing is wrong.
        level = log.info if status in (404, 405) else log.warning
        level("aggregate_metrics_unavailable", agent=name, http_status=status)
        return None
    return None


async def _post(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    async with session.post(url, data=body, headers=headers) as response:
        return response.status, await response.read()


def _entry(name: str, metrics: Mapping[str, Any]) -> JsonObject:
    """One agent's entry, in the shape of the entries Gym's collector writes."""
    entry: JsonObject = {"agent_ref": {"name": name}}
    for key in ("agent_metrics", "key_metrics"):
        entry[key] = metrics.get(key) or {}
    for key in ("group_level_metrics", "repeat_level_metrics"):
        entry[key] = metrics.get(key) or []
    if metrics.get("perf_summary") is not None:
        entry["perf_summary"] = metrics["perf_summary"]
    return entry


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    fsync_dir(path.parent)
