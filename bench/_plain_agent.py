"""A plain aiohttp agent: ``POST /run`` answers at once with a realistic row.

Not the dispatcher's simulated agent (no latency model, failures, statistics or
model calls): a minimal server of the kind a user writes, so that a benchmark's
baseline and the dispatcher meet an agent that is not the project's own. The row
is NeMo Gym's shape: the request's fields, a Responses API ``response`` with one
assistant message and its usage, and a reward.
``python bench/_plain_agent.py --listen 127.0.0.1:0`` prints ``listening on URL``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import orjson
import uvloop
from aiohttp import web


def answer(row: dict[str, object]) -> bytes:
    index = row.get("_ng_task_index")
    text = f"The answer to problem {index} is {row.get('expected_answer')}."
    response = {
        "id": f"resp_{index}",
        "created_at": time.time(),
        "model": "policy",
        "object": "response",
        "output": [
            {
                "id": f"msg_{index}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {"input_tokens": 24, "output_tokens": 12, "total_tokens": 36},
    }
    return orjson.dumps({**row, "response": response, "reward": 1.0})


async def run(request: web.Request) -> web.Response:
    row = orjson.loads(await request.read())
    if "_ng_task_index" not in row:
        return web.json_response({"detail": "not a run request"}, status=422)
    return web.Response(body=answer(row), content_type="application/json")


async def serve(host: str, port: int) -> None:
    app = web.Application()
    app.router.add_post("/run", run)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    print(f"plain agent listening on http://{bound[0]}:{bound[1]}", flush=True)
    await asyncio.Event().wait()


@contextmanager
def plain_agent() -> Iterator[str]:
    """The plain agent in its own process; yields its URL."""
    from _common import server_process

    with server_process([sys.executable, __file__], "the plain aiohttp agent") as url:
        yield url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen", default="127.0.0.1:0")
    host, port = parser.parse_args().listen.rsplit(":", 1)
    uvloop.run(serve(host, int(port)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
