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
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import structlog

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


def rows_by_agent(output: Path) -> dict[str, list[JsonObject]]:
    """Each agent's success rows as /aggregate_metrics takes them (blocking: run in a thread)."""
    grouped: dict[str, list[JsonObject]] = {}
    with output.open("rb") as lines:
        for line in lines:
            row = _parsed(line)
            agent = row.get("agent_ref") if row else None
            name = agent.get("name") if isinstance(agent, dict) else None
            if row is not None and isinstance(name, str):
                grouped.setdefault(name, []).append(stripped(row))
    return grouped


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
    output: Path, agents: Mapping[str, Sequence[str]], *, timeout_s: float = 30.0
) -> Path | None:
    """Ask each agent for its metrics and write the file; None when no agent answered."""
    grouped = await asyncio.to_thread(rows_by_agent, output)
    entries: list[JsonObject] = []
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for name, rows in sorted(grouped.items()):
            urls = agents.get(name)
            if urls:
                entry = await _agent_entry(session, name, urls[0], rows)
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


async def _agent_entry(
    session: aiohttp.ClientSession, name: str, url: str, rows: list[JsonObject]
) -> JsonObject | None:
    body = orjson.dumps({"verify_responses": rows})
    headers = {"Content-Type": "application/json"}
    try:
        async with session.post(f"{url}/aggregate_metrics", data=body, headers=headers) as response:
            answer = await response.read() if response.status < 300 else None
            status = response.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("aggregate_metrics_unavailable", agent=name, error=repr(exc))
        return None
    metrics = _parsed(answer) if answer is not None else None
    if metrics is None:
        # 404/405: an agent that does not aggregate (not a Gym agent); nothing is wrong.
        level = log.info if status in (404, 405) else log.warning
        level("aggregate_metrics_unavailable", agent=name, http_status=status)
        return None
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
